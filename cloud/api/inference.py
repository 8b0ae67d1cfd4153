"""OpenAI-compatible inference: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

The prompt is templated and tokenized once, here (its length sizes ``max_tokens``), and the
ids are what the engine gets. ``n`` choices are ``n`` engine requests on the same ids (the
prefix cache shares the prompt's KV blocks), choice i seeded with ``seed + i``; a stream
interleaves their chunks by index. Both completion routes wait for every choice's first
token before answering, so an engine refusal still becomes a real status (429 queue full,
400 too long or an invalid grammar) rather than an error buried in a 200 stream. A client
that goes away (mid-stream or while waiting) cancels its engine requests, which aborts them
and frees their KV blocks.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import anyio
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from apiary.shared.logs import get_logger

from apiary.cloud.api.errors import ERROR_RESPONSES, InvalidParam, ModelNotFound, OpenAIRoute, error_body
from apiary.cloud.api.logprobs import chat_logprobs, completion_logprobs
from apiary.cloud.api.schemas import (ChatChoice, ChatCompletion, ChatCompletionRequest, ChatLogprobs, ChatMessageOut,
                               Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, ErrorResponse,
                               ModelCard, ModelList, PromptTokensDetails, Usage, _Request, ignored_fields)
from apiary.cloud.api.security import require

_log = get_logger("apiary.cloud.api.inference")
router = APIRouter(tags=["inference"], dependencies=[Depends(require("inference"))], route_class=OpenAIRoute)

ENGINE_RESPONSES = {
    **{code: spec for code, spec in ERROR_RESPONSES.items() if code != 422},
    400: {"model": ErrorResponse, "description": "invalid request (the message names the field), or one the engine "
                                                 "can never serve (too long, invalid grammar)"},
    404: {"model": ErrorResponse, "description": "unknown model"},
    429: {"model": ErrorResponse, "description": "engine queue full; retry after Retry-After seconds"},
}
IGNORED_HEADER = "X-Apiary-Ignored-Fields"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_HEADER_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


class EventStream(StreamingResponse):
    """Server-sent events that always watch for the client leaving, then close the generator.

    Closing the generator cancels the engine streams inside it, which aborts the requests and
    frees their KV blocks, whatever ASGI spec version the server speaks.
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


# ---------------------------------------------------------------- request -> engine parameters


def _check_model(ctx, name: str | None) -> None:
    """404 unless ``name`` is the served model: its id or an alias (its file name), so either is served."""
    if name is not None and name != ctx.model_name and name not in ctx.settings.model_aliases:
        raise ModelNotFound(name, ctx.model_name)


def _max_tokens(ctx, body: _Request, prompt_len: int, chat: bool) -> int:
    """The request's own max_tokens (400 over the server's limit), else the default capped to the context left."""
    limit = ctx.settings.max_tokens_limit
    if body.max_tokens is not None and body.model_fields_set & {"max_tokens", "max_completion_tokens"}:
        if body.max_tokens > limit:
            raise InvalidParam("max_tokens", f"{body.max_tokens} is over this server's limit of {limit}")
        return body.max_tokens
    default = ctx.settings.default_max_tokens if chat else COMPLETION_DEFAULT_MAX_TOKENS
    return max(1, min(default, limit, ctx.engine.max_model_len - prompt_len))


def _structured(body: _Request) -> tuple[str, Any] | None:
    """The one output constraint of ``response_format`` or vLLM's ``guided_*`` fields: (field, StructuredOutput)."""
    from apiary.cloud.engine.sampling_params import StructuredOutput

    fmt = body.response_format
    given = [(name, value) for name, value in (
        ("response_format", fmt if fmt is not None and fmt.type != "text" else None),
        ("guided_json", body.guided_json), ("guided_regex", body.guided_regex),
        ("guided_choice", body.guided_choice), ("guided_grammar", body.guided_grammar)) if value is not None]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidParam(given[1][0], f"give one output constraint, not {' and '.join(n for n, _ in given)}")
    name, value = given[0]
    if name == "response_format":
        if value.type == "json_object":
            return name, StructuredOutput("json_object")
        if value.json_schema is None:
            raise InvalidParam("response_format.json_schema", "required when type is json_schema")
        schema = value.json_schema.schema_
        spec = StructuredOutput("json_object") if schema is None else StructuredOutput("json_schema", json.dumps(schema))
        return name, spec
    if name == "guided_json":
        return name, StructuredOutput("json_schema", value if isinstance(value, str) else json.dumps(value))
    if name == "guided_choice":
        return name, StructuredOutput("choice", json.dumps(value))
    return name, StructuredOutput("regex" if name == "guided_regex" else "grammar", value)


def _logprobs(body: _Request) -> int | None:
    """The engine's ``logprobs`` (None, or alternatives per token) from the route's fields."""
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidParam("top_logprobs", "needs logprobs=true")
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def _refuse_unsupported(body: _Request) -> None:
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidParam("best_of", "only best_of equal to n is supported")
    if body.stream_options is not None and not body.stream:
        raise InvalidParam("stream_options", "only allowed with stream=true")
    if isinstance(body, ChatCompletionRequest):
        if body.tools or body.functions:
            raise InvalidParam("tools" if body.tools else "functions", "tool calling is not supported")
        if body.tool_choice not in (None, "none", "auto"):
            raise InvalidParam("tool_choice", "tool calling is not supported")
    else:
        if body.echo:
            raise InvalidParam("echo", "echo is not supported")
        if body.suffix:
            raise InvalidParam("suffix", "suffix is not supported")


def _sampling_params(body: _Request, max_tokens: int, structured: tuple[str, Any] | None) -> list:
    """One SamplingParams per choice (choice i: seed + i); a 400 naming the field the engine refuses."""
    from apiary.cloud.engine import RequestRejected, SamplingParams

    common = dict(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=max(0, body.top_k),
                  stop=list(body.stop or []), stop_token_ids=list(body.stop_token_ids or []),
                  ignore_eos=body.ignore_eos, min_p=body.min_p, min_tokens=body.min_tokens,
                  presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                  repetition_penalty=body.repetition_penalty, logit_bias=dict(body.logit_bias or {}),
                  logprobs=_logprobs(body), structured=structured and structured[1])
    try:
        return [SamplingParams(seed=None if body.seed is None else body.seed + i, **common) for i in range(body.n)]
    except RequestRejected as e:  # the engine's messages start with the parameter's name
        name = str(e).split(" ", 1)[0]
        if name in type(body).model_fields:
            raise InvalidParam(name, str(e)) from None
        raise


# ---------------------------------------------------------------- running the choices


@dataclass(slots=True)
class _Job:
    """A request's ``n`` engine streams, from their first outputs on."""

    request_id: str
    prompt_ids: list[int]
    streams: list[AsyncIterator]
    last: list[Any]  # each choice's latest RequestOutput (the first, until outputs() moves on)
    start: float
    created: int = field(default_factory=lambda: int(time.time()))

    async def outputs(self) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, output) from the first outputs on, interleaved as the engine steps, in index order per step."""
        for i, out in enumerate(list(self.last)):
            yield i, out
        pending: dict[asyncio.Future, int] = {}

        def follow(i: int) -> None:
            pending[asyncio.ensure_future(anext(self.streams[i]))] = i

        for i, out in enumerate(self.last):
            if not out.finished:
                follow(i)
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=pending.__getitem__):
                    i = pending.pop(task)
                    out = self.last[i] = task.result()
                    yield i, out
                    if not out.finished:
                        follow(i)
        finally:  # cancelling a pending step of a stream aborts its request
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def finish(self) -> list[Any]:
        """Every choice's final output."""
        async with aclosing(self.outputs()) as outputs:
            async for _ in outputs:
                pass
        return self.last

    async def close(self) -> None:
        """Abort whatever is still running (a no-op for finished streams)."""
        for stream in self.streams:
            await stream.aclose()

    def usage(self, ctx) -> Usage:
        """Usage over all choices (the prompt counted once) and the request's metrics."""
        prompt, completion = len(self.prompt_ids), sum(len(out.output_token_ids) for out in self.last)
        usage = Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                      prompt_tokens_details=PromptTokensDetails(
                          cached_tokens=self.last[0].metrics.cached_prompt_tokens))
        ctx.metrics.tokens.labels(path="rest", kind="prompt").inc(usage.prompt_tokens)
        ctx.metrics.tokens.labels(path="rest", kind="completion").inc(usage.completion_tokens)
        ctx.metrics.e2e.labels(path="rest").observe(time.perf_counter() - self.start)
        return usage


async def _first_outputs(streams: list[AsyncIterator]) -> list[Any]:
    """Every stream's first output; the first refusal (429, 400) is raised and the other requests are aborted."""
    tasks = [asyncio.ensure_future(anext(s)) for s in streams]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _start(request: Request, body: _Request, *, kind: str, prompt: Any = None,
                 messages: list[dict] | None = None) -> _Job:
    """Tokenize once, submit the n choices and wait (disconnect-aware) for their first outputs."""
    from apiary.cloud.engine import RequestRejected

    ctx = request.app.state.ctx
    _check_model(ctx, body.model)
    _refuse_unsupported(body)
    prompt_ids = await asyncio.to_thread(ctx.engine.prompt_token_ids, prompt=prompt, messages=messages)
    structured = _structured(body)
    params = _sampling_params(body, _max_tokens(ctx, body, len(prompt_ids), chat=kind == "chat"), structured)
    priority = ctx.settings.default_priority if body.priority is None else body.priority
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    streams = [ctx.engine.stream(prompt_ids, params=p, priority=priority,
                                 request_id=request_id if len(params) == 1 else f"{request_id}-{i}")
               for i, p in enumerate(params)]
    start = time.perf_counter()
    try:
        firsts = await unless_disconnected(request, _first_outputs(streams))
    except BaseException as e:
        for stream in streams:
            await stream.aclose()
        if structured and isinstance(e, RequestRejected) and str(e).startswith(f"invalid {structured[1].kind}"):
            raise InvalidParam(structured[0], str(e)) from None  # the grammar backend refused the constraint
        raise
    ctx.metrics.ttft.labels(path="rest").observe(time.perf_counter() - start)
    return _Job(request_id, prompt_ids, streams, firsts, start)


def _ignored(body: _Request, path: str) -> dict[str, str]:
    """Log the unknown fields (ignored, as vLLM does) and name them in a response header."""
    names = ignored_fields(body)
    if not names:
        return {}
    _log.warning("%s: ignored unknown fields %s", path, ", ".join(repr(n) for n in names[:32]))
    return {IGNORED_HEADER: ", ".join(_HEADER_SAFE.sub("?", n[:64]) for n in names[:32])}


def _sse(doc: dict) -> bytes:
    return f"data: {json.dumps(doc, separators=(',', ':'))}\n\n".encode()


def _messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]


def _event_stream(ctx, job: _Job, kind: str, include_usage: bool, headers: dict[str, str],
                  chunks: Any) -> EventStream:
    """SSE of ``chunks(outputs)`` (the choices' chunks), then the usage chunk when asked for, then [DONE]."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    async def events() -> AsyncIterator[bytes]:
        try:
            async with aclosing(job.outputs()) as outputs, aclosing(chunks(outputs)) as docs:
                async for doc in docs:
                    yield _sse(doc)
            usage = job.usage(ctx)
            if include_usage:
                yield _sse({"id": job.request_id, "object": obj, "created": job.created, "model": ctx.model_name,
                            "choices": [], "usage": usage.model_dump()})
        except Exception as e:  # the status line is gone already: report in-band, like OpenAI
            _log.exception("%s stream %s failed", kind, job.request_id)
            yield _sse(error_body(500, f"stream failed: {e}"))
        finally:
            await job.close()
        yield b"data: [DONE]\n\n"

    return EventStream(events(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})


# ---------------------------------------------------------------- routes


async def _serve(request: Request, body: _Request, response: Response, *, kind: str, answer: Any, chunks: Any,
                 prompt: Any = None, messages: list[dict] | None = None) -> Any:
    """Run the request; ``answer(job, finals)`` is the whole response, ``chunks(job, outputs)`` the stream's."""
    ctx = request.app.state.ctx
    headers = _ignored(body, request.url.path)
    try:
        job = await _start(request, body, kind=kind, prompt=prompt, messages=messages)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _event_stream(ctx, job, kind, include_usage, headers, lambda outputs: chunks(job, outputs))
        try:
            finals = await unless_disconnected(request, job.finish())
        finally:
            await job.close()
    except ClientGone:
        return JSONResponse(error_body(499, "client disconnected"), status_code=499)
    response.headers.update(headers)
    return answer(job, finals)


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=ENGINE_RESPONSES,
             summary="Chat completion (OpenAI-compatible; SSE when stream=true)")
async def chat_completions(request: Request, body: ChatCompletionRequest, response: Response):
    ctx = request.app.state.ctx
    tokenizer = ctx.engine.tokenizer

    def answer(job: _Job, finals: list) -> ChatCompletion:
        return ChatCompletion(
            id=job.request_id, created=job.created, model=ctx.model_name, usage=job.usage(ctx),
            choices=[ChatChoice(index=i, message=ChatMessageOut(content=out.text), finish_reason=out.finish_reason,
                                logprobs=ChatLogprobs(content=chat_logprobs(tokenizer, out.logprobs))
                                if body.logprobs else None)
                     for i, out in enumerate(finals)])

    async def chunks(job: _Job, outputs: AsyncIterator) -> AsyncIterator[dict]:
        def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs: Any = None) -> dict:
            return {"id": job.request_id, "object": "chat.completion.chunk", "created": job.created,
                    "model": ctx.model_name, "choices": [{"index": index, "delta": delta,
                                                          "finish_reason": finish_reason, "logprobs": logprobs}]}

        for i in range(len(job.streams)):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for i, out in outputs:
            logprobs = None
            if body.logprobs and out.new_logprobs:
                logprobs = {"content": chat_logprobs(tokenizer, out.new_logprobs), "refusal": None}
            if out.text_delta or logprobs:
                yield chunk(i, {"content": out.text_delta}, logprobs=logprobs)
            if out.finished:
                yield chunk(i, {}, out.finish_reason)

    return await _serve(request, body, response, kind="chat", messages=_messages(body), answer=answer, chunks=chunks)


@router.post("/v1/completions", response_model=Completion, responses=ENGINE_RESPONSES,
             summary="Text completion (OpenAI-compatible; SSE when stream=true)")
async def completions(request: Request, body: CompletionRequest, response: Response):
    ctx = request.app.state.ctx
    tokenizer = ctx.engine.tokenizer
    want_logprobs = body.logprobs is not None

    def answer(job: _Job, finals: list) -> Completion:
        return Completion(
            id=job.request_id, created=job.created, model=ctx.model_name, usage=job.usage(ctx),
            choices=[CompletionChoice(index=i, text=out.text, finish_reason=out.finish_reason,
                                      logprobs=CompletionLogprobs(**completion_logprobs(tokenizer, out.logprobs))
                                      if want_logprobs else None)
                     for i, out in enumerate(finals)])

    async def chunks(job: _Job, outputs: AsyncIterator) -> AsyncIterator[dict]:
        offsets = [0] * len(job.streams)  # characters of each choice's token texts so far (text_offset)
        async for i, out in outputs:
            logprobs = None
            if want_logprobs and out.new_logprobs:
                logprobs = completion_logprobs(tokenizer, out.new_logprobs, offsets[i])
                offsets[i] += sum(len(t) for t in logprobs["tokens"])
            if out.text_delta or out.finished or logprobs:
                yield {"id": job.request_id, "object": "text_completion", "created": job.created,
                       "model": ctx.model_name,
                       "choices": [{"index": i, "text": out.text_delta, "logprobs": logprobs,
                                    "finish_reason": out.finish_reason if out.finished else None}]}

    return await _serve(request, body, response, kind="completion", prompt=body.prompt, answer=answer, chunks=chunks)


@router.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES, summary="The served model")
async def models(request: Request) -> ModelList:
    ctx = request.app.state.ctx
    return ModelList(data=[_card(ctx)])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard,
            responses={**ERROR_RESPONSES, 404: {"model": ErrorResponse, "description": "unknown model"}},
            summary="One model")
async def model(request: Request, model_id: str) -> ModelCard:
    ctx = request.app.state.ctx
    _check_model(ctx, model_id)
    return _card(ctx)


def _card(ctx) -> ModelCard:
    return ModelCard(id=ctx.model_name, created=int(ctx.started), max_model_len=ctx.engine.max_model_len)
