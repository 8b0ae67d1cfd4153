"""OpenAI-compatible inference: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Both completion routes wait for the request's first token before answering, so an
engine refusal still becomes a real status (429 queue full, 400 too long) rather than an
error buried in a 200 stream. A client that goes away (mid-stream or while waiting)
cancels its engine request, which aborts it and frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from shared.logs import get_logger

from cloud.api.errors import ERROR_RESPONSES, error_body
from cloud.api.schemas import (ChatChoice, ChatCompletion, ChatCompletionRequest, ChatMessageOut, Completion,
                               CompletionChoice, CompletionRequest, ErrorResponse, ModelCard, ModelList, Usage,
                               _Request)
from cloud.api.security import require

_log = get_logger("cloud.api.inference")
router = APIRouter(tags=["inference"], dependencies=[Depends(require("inference"))])

ENGINE_RESPONSES = {
    **ERROR_RESPONSES,
    400: {"model": ErrorResponse, "description": "the engine can never serve this request (e.g. too long)"},
    404: {"model": ErrorResponse, "description": "unknown model"},
    429: {"model": ErrorResponse, "description": "engine queue full; retry after Retry-After seconds"},
}


COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


class EventStream(StreamingResponse):
    """Server-sent events that always watch for the client leaving, then close the generator.

    Closing the generator cancels the engine stream inside it, which aborts the request and
    frees its KV blocks, whatever ASGI spec version the server speaks.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the socket went away under us
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()


async def unless_disconnected(request: Request, awaitable: Any, poll_s: float = 0.2) -> Any:
    """Await ``awaitable``; if the client disconnects first, cancel it (aborting the engine request)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass


def _check_model(ctx, body: _Request) -> None:
    if body.model is not None and body.model != ctx.model_name:
        raise HTTPException(404, f"model {body.model!r} not found; this server serves {ctx.model_name!r}")


def _max_tokens(ctx, body: _Request, prompt: Any, messages: list[dict] | None) -> int:
    """The request's own max_tokens (400 over the server's limit), else the default capped to the context left."""
    limit = ctx.settings.max_tokens_limit
    if body.max_tokens is not None and body.model_fields_set & {"max_tokens", "max_completion_tokens"}:
        if body.max_tokens > limit:
            raise HTTPException(400, f"max_tokens {body.max_tokens} is over this server's limit of {limit}")
        return body.max_tokens
    engine = ctx.engine
    tok = engine.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True) if messages is not None else prompt
    used = len(tok.encode(text)) if isinstance(text, str) else len(text)
    default = ctx.settings.default_max_tokens if messages is not None else COMPLETION_DEFAULT_MAX_TOKENS
    return max(1, min(default, limit, engine.max_model_len - used))


def _sse(doc: dict) -> bytes:
    return f"data: {json.dumps(doc, separators=(',', ':'))}\n\n".encode()


def _messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]


async def _run(request: Request, body: _Request, *, kind: str, prompt: Any = None,
               messages: list[dict] | None = None):
    """Start the engine stream and wait (disconnect-aware) for its first output."""
    ctx = request.app.state.ctx
    _check_model(ctx, body)
    from cloud.engine import SamplingParams

    params = SamplingParams(max_tokens=_max_tokens(ctx, body, prompt, messages), temperature=body.temperature,
                            top_p=body.top_p, seed=body.seed, stop=list(body.stop or []))
    priority = ctx.settings.default_priority if body.priority is None else body.priority
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    stream = ctx.engine.stream(prompt=prompt, messages=messages, params=params, priority=priority,
                               request_id=request_id)
    start = time.perf_counter()
    try:
        first = await unless_disconnected(request, anext(stream))
    except BaseException:
        await stream.aclose()
        raise
    ctx.metrics.ttft.labels(path="rest").observe(time.perf_counter() - start)
    return request_id, stream, first, start


def _account(ctx, out, start: float) -> Usage:
    usage = Usage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=len(out.output_token_ids),
                  total_tokens=len(out.prompt_token_ids) + len(out.output_token_ids))
    ctx.metrics.tokens.labels(path="rest", kind="prompt").inc(usage.prompt_tokens)
    ctx.metrics.tokens.labels(path="rest", kind="completion").inc(usage.completion_tokens)
    ctx.metrics.e2e.labels(path="rest").observe(time.perf_counter() - start)
    return usage


async def _finish(request: Request, stream: AsyncIterator, last) -> Any:
    """Drain the stream to its final output (disconnect-aware)."""

    async def drain():
        out = last
        async for out in stream:
            pass
        return out

    if last.finished:
        await stream.aclose()
        return last
    try:
        return await unless_disconnected(request, drain())
    finally:
        await stream.aclose()


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=ENGINE_RESPONSES,
             summary="Chat completion (OpenAI-compatible; SSE when stream=true)")
async def chat_completions(request: Request, body: ChatCompletionRequest):
    ctx = request.app.state.ctx
    try:
        request_id, stream, first, start = await _run(request, body, kind="chat", messages=_messages(body))
    except ClientGone:
        return JSONResponse(error_body(499, "client disconnected"), status_code=499)
    created = int(time.time())
    if not body.stream:
        try:
            out = await _finish(request, stream, first)
        except ClientGone:
            return JSONResponse(error_body(499, "client disconnected"), status_code=499)
        return ChatCompletion(id=request_id, created=created, model=ctx.model_name, usage=_account(ctx, out, start),
                              choices=[ChatChoice(message=ChatMessageOut(content=out.text),
                                                  finish_reason=out.finish_reason)])
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(delta: dict, finish_reason: str | None = None) -> bytes:
        return _sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name,
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]})

    async def events() -> AsyncIterator[bytes]:
        out = first
        try:
            yield chunk({"role": "assistant", "content": ""})
            outputs = _chain(first, stream)
            async for out in outputs:
                if out.text_delta:
                    yield chunk({"content": out.text_delta})
                if out.finished:
                    yield chunk({}, out.finish_reason)
            usage = _account(ctx, out, start)
            if include_usage:
                yield _sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                            "model": ctx.model_name, "choices": [], "usage": usage.model_dump()})
        except Exception as e:  # the status line is gone already: report in-band, like OpenAI
            _log.exception("chat stream %s failed", request_id)
            yield _sse(error_body(500, f"stream failed: {e}"))
        finally:
            await stream.aclose()
        yield b"data: [DONE]\n\n"

    return EventStream(events(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.post("/v1/completions", response_model=Completion, responses=ENGINE_RESPONSES,
             summary="Text completion (OpenAI-compatible; SSE when stream=true)")
async def completions(request: Request, body: CompletionRequest):
    ctx = request.app.state.ctx
    try:
        request_id, stream, first, start = await _run(request, body, kind="completion", prompt=body.prompt)
    except ClientGone:
        return JSONResponse(error_body(499, "client disconnected"), status_code=499)
    created = int(time.time())
    if not body.stream:
        try:
            out = await _finish(request, stream, first)
        except ClientGone:
            return JSONResponse(error_body(499, "client disconnected"), status_code=499)
        return Completion(id=request_id, created=created, model=ctx.model_name, usage=_account(ctx, out, start),
                          choices=[CompletionChoice(text=out.text, finish_reason=out.finish_reason)])
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(text: str, finish_reason: str | None = None) -> bytes:
        return _sse({"id": request_id, "object": "text_completion", "created": created, "model": ctx.model_name,
                     "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}]})

    async def events() -> AsyncIterator[bytes]:
        out = first
        try:
            async for out in _chain(first, stream):
                if out.text_delta or out.finished:
                    yield chunk(out.text_delta, out.finish_reason if out.finished else None)
            usage = _account(ctx, out, start)
            if include_usage:
                yield _sse({"id": request_id, "object": "text_completion", "created": created,
                            "model": ctx.model_name, "choices": [], "usage": usage.model_dump()})
        except Exception as e:
            _log.exception("completion stream %s failed", request_id)
            yield _sse(error_body(500, f"stream failed: {e}"))
        finally:
            await stream.aclose()
        yield b"data: [DONE]\n\n"

    return EventStream(events(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _chain(first, stream: AsyncIterator) -> AsyncIterator:
    yield first
    if first.finished:
        return
    async for out in stream:
        yield out


@router.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES, summary="The served model")
async def models(request: Request) -> ModelList:
    ctx = request.app.state.ctx
    return ModelList(data=[ModelCard(id=ctx.model_name, created=int(ctx.started))])
