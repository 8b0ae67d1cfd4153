"""Asyncio front of the engine for the REST and MQTT tiers: a background thread runs the step loop.

Callers never touch the engine directly (it is not thread-safe): submissions and aborts go
through a command queue the loop thread drains before each step, and outputs come back to each
caller's event loop through ``call_soon_threadsafe``. What callers need besides is here too:
the tokenizer and chat template (immutable after load: safe from any thread), the model's
limits, and a metrics snapshot the loop thread takes between steps. A stream whose consumer
goes away (cancelled task, closed generator) aborts its request, so a vanished client never
keeps KV blocks.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from apiary.cloud.engine.errors import EngineError
from apiary.cloud.engine.llm_engine import LLMEngine
from apiary.cloud.engine.outputs import RequestOutput
from apiary.cloud.engine.sampling_params import SamplingParams
from apiary.cloud.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Subscriber:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._snapshot: dict[str, Any] = engine.metrics()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._subscribers: dict[str, _Subscriber] = {}
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ loop thread

    def _call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn`` on the loop thread before its next step; the future carries its result or exception."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if self._stopped:
            future.set_exception(EngineError("engine is shut down"))
            return future

        def command() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # delivered to the caller
                    future.set_exception(e)

        self._commands.put(command)
        self._wake.set()
        return future

    def _run(self) -> None:
        try:
            while not self._stopped:
                while True:
                    try:
                        self._commands.get_nowait()()
                    except queue.Empty:
                        break
                if self._stopped:
                    break
                if not self._engine.has_unfinished():
                    self._snapshot = self._engine.metrics()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs = self._engine.step()
                self._snapshot = self._engine.metrics()  # before delivery: a caller that got its answer sees it done
                for out in outputs:
                    self._deliver(out.request_id, out)
        except BaseException as e:  # a broken engine must not leave callers waiting forever
            self._error = e
            self._stopped = True
            for rid in list(self._subscribers):
                self._deliver(rid, EngineError(f"engine loop failed: {e!r}"))
        finally:
            while True:  # fail commands that arrived too late
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        sub = self._subscribers.get(request_id)
        if sub is None:
            return
        if isinstance(item, BaseException) or item.finished:
            self._subscribers.pop(request_id, None)
        try:
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody listens any more
            if isinstance(item, RequestOutput) and not item.finished:
                self._engine.abort(request_id)

    # ------------------------------------------------------------ what callers need of the engine

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer and chat template (read-only after load, so safe from any thread)."""
        return self._engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def prompt_style(self) -> str:
        """The prompt style the served model was tuned for (its LoRA adapter's; ``examples`` otherwise)."""
        return self._engine.adapter.prompt_style if self._engine.adapter is not None else "examples"

    @property
    def vocab_size(self) -> int:
        return self._engine.model_config.vocab_size

    def prompt_token_ids(self, prompt: str | list[int] | None = None,
                         messages: list[dict[str, Any]] | None = None) -> list[int]:
        """The token ids the engine would run for ``prompt`` or chat ``messages`` (RequestRejected if bad).

        Callers that need the length (to size ``max_tokens``) tokenize once here and submit the ids.
        """
        return self._engine.prompt_tokens(prompt, messages)

    # ------------------------------------------------------------ public API

    async def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict[str, Any]] | None = None,
                     params: SamplingParams | None = None, priority: int = 0,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield an output per step that produced tokens, the last one with ``finished=True``.

        Raises RequestRejected / EngineOverloaded (from the first ``__anext__``) like ``add_request``.
        """
        if self._error is not None or self._stopped:
            raise EngineError("engine is shut down" if self._error is None else f"engine loop failed: {self._error!r}")
        request_id = request_id or uuid.uuid4().hex
        sub = _Subscriber(asyncio.get_running_loop(), asyncio.Queue())

        def add() -> str:  # on the loop thread, between steps: no output can slip past the subscription
            try:
                rid = self._engine.add_request(prompt, messages=messages, params=params, priority=priority,
                                              request_id=request_id)
            finally:
                self._engine.withdraw_arrival(priority)
            self._subscribers[rid] = sub
            return rid

        self._engine.announce_arrival(priority)  # a running step of less urgent work stops early
        await asyncio.wrap_future(self._call(add))
        finished = False
        try:
            while True:
                item = await sub.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def generate(self, prompt: str | list[int] | None = None, *, messages: list[dict[str, Any]] | None = None,
                       params: SamplingParams | None = None, priority: int = 0,
                       request_id: str | None = None) -> RequestOutput:
        """The final output of one request."""
        last = None
        async for last in self.stream(prompt, messages=messages, params=params, priority=priority,
                                      request_id=request_id):
            pass
        assert last is not None and last.finished
        return last

    def abort(self, request_id: str) -> None:
        """Cancel a request from any thread; its blocks are freed before the next step."""
        def drop() -> None:
            self._subscribers.pop(request_id, None)
            self._engine.abort(request_id)

        self._call(drop)

    def metrics(self) -> dict[str, Any]:
        """Engine metrics as of the last step (the loop thread takes the snapshot between steps; never blocks)."""
        return dict(self._snapshot)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the loop thread; requests still in flight are aborted and their streams end with an error."""
        if not self._stopped:
            def stop() -> None:
                for rid in list(self._engine.requests):
                    self._engine.abort(rid)
                for rid in list(self._subscribers):
                    self._deliver(rid, EngineError("engine shut down"))
                self._stopped = True

            self._call(stop)
        self._thread.join(timeout)
        if self._thread.is_alive():  # a step still running: exiting now would kill torch mid-call ("terminate called")
            log.warning("engine loop still inside a step %ss after shutdown was asked; it stops after that step",
                        timeout)
