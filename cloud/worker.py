"""The MQTT escalation worker: answers edge escalations with the cloud engine.

N workers on N machines subscribe the same shared subscription
(``$share/<group>/apiary/v1/+/+/escalate``), so the broker hands each request to one of
them. For every request the worker

0. takes the sender from the topic: a body naming another site or device than the
   escalation topic's is dropped (``identity_mismatch``), and the only reply topic is the
   topic's own node's (``topics.reply_for``): a ``reply_to`` naming any other (another
   device's topics, the cloud's own, a wildcard) is refused with an error reply there
   (``reply_to_refused``). The cloud may publish anywhere, so answering wherever a device
   asks would let it publish where the broker forbids it;
1. claims it in the store, keyed by the envelope id (and the request id, for re-sends in
   a new envelope), durably and with the request itself before anything is computed: an
   already answered request gets its stored answer again, without computing, whichever
   worker or restart sees it; a request another worker is still computing is left to that
   worker (which renews its lease while it computes, so a re-send is never run twice);
2. answers ``expired`` without computing when its deadline has passed, and gives up the
   same way when the deadline passes while it is queued or running (the engine request is
   aborted, its KV blocks freed);
3. runs the engine at the request's priority (smaller = more urgent, the same scale on
   both sides), or with ``backend="openai"`` sends it to an OpenAI-compatible upstream
   (``apiary.cloud.upstream``: the same schema, priority and confidence rule; an upstream that
   stays unreachable leaves the request unfinished, its claim released, for the edge's re-send), and replies ``InferenceResult(tier="cloud")`` on that reply topic with
   the request's correlation id; a ``json_action`` answer is decoded under the action's JSON
   Schema and carries its confidence, scored by the edge's rule (``apiary.cloud.actions``);
4. stores the result with its outcome and latency.

At-least-once answering with exactly-once effect: a worker id is one process at a time (it
is the MQTT client id, and the session is persistent), so at its first connect a worker
takes up the claims its id left unfinished (killed or stopped mid-request) and answers
them; the edge re-sends an unanswered escalation until its deadline, and the store turns
every repeat into the stored answer or into one more reply of the computation in flight.

MQTT handlers run on the network thread; the worker hands each request to its own
asyncio loop thread and never blocks the network thread.
"""
from __future__ import annotations

import asyncio
import sys
import threading
import time
from dataclasses import dataclass

from apiary.shared import identity, topics
from apiary.shared.logs import bind, get_logger
from apiary.shared.protocol import Envelope, InferenceRequest, InferenceResult, ProtocolError, decode, encode

from apiary.cloud.actions import ActionOutcome, generate_action
from apiary.cloud.metrics import Metrics
from apiary.cloud.store import Store
from apiary.cloud.upstream import UpstreamUnavailable

_log = get_logger("apiary.cloud.worker")


@dataclass(slots=True)
class WorkerConfig:
    worker_id: str
    model_name: str
    share_group: str = topics.DEFAULT_SHARE_GROUP
    concurrency: int = 32
    claim_lease_s: float = 60.0
    overload_retry_s: float = 10.0  # keep retrying a full engine queue this long before answering "deferred"
    backend: str = "engine"  # "engine": ``engine`` is an AsyncEngine; "openai": a cloud.upstream.UpstreamClient


class EscalationWorker:
    def __init__(self, engine, store: Store, config: WorkerConfig, metrics: Metrics | None = None) -> None:
        self.engine = engine  # cloud.engine.AsyncEngine, or cloud.upstream.UpstreamClient (backend "openai")
        self.store = store
        self.config = config
        self.metrics = metrics or Metrics()
        self.transport = None
        self.stats = {"received": 0, "computed": 0, "cached": 0, "busy": 0, "expired": 0, "errors": 0, "ignored": 0,
                      "overload_retries": 0, "identity_mismatch": 0, "reply_to_refused": 0, "resumed": 0,
                      "unavailable": 0}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=f"escalations-{config.worker_id}", daemon=True)
        self._inflight: dict[tuple[str, str, str], list[Envelope]] = {}  # (site, device, request id) -> waiters
        self._tasks: set[asyncio.Task] = set()
        self._semaphore: asyncio.Semaphore | None = None
        self._renewer: asyncio.Task | None = None
        self._started = False
        self._resumed = False

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self, transport) -> None:
        """Start the loop thread and subscribe to the shared escalation filter on ``transport``; once it is
        connected, resume this worker id's unfinished claims."""
        self.transport = transport
        self._thread.start()
        self._started = True
        transport.add_link_listener(self._on_link)
        # dedup=False: a store-and-forward retry re-sends the same envelope; the worker answers it again
        # (from SQLite or by joining the computation in flight), which the transport's id filter would prevent
        transport.subscribe(topics.escalations_shared(self.config.share_group), self.on_message, qos=1, dedup=False)
        if transport.connected:
            self._on_link(True)

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is still running and stop the loop. The cancelled claims stay in the store with their
        lease ended: another worker may take them over at once, and this worker id resumes them at its next
        start."""
        if not self._started:
            return
        self._started = False

        async def cancel_all() -> None:
            if self._renewer is not None:
                self._renewer.cancel()
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=timeout)

        asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(timeout + 1)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._semaphore = asyncio.Semaphore(self.config.concurrency)
        self._renewer = self._loop.create_task(self._renew_leases())
        self._loop.run_forever()
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())  # engine streams abort their requests
        self._loop.close()

    def _on_link(self, up: bool) -> None:
        """Network thread: at the first connect, hand the loop the claims a predecessor left unfinished."""
        if up and self._started and not self._resumed:
            self._resumed = True
            asyncio.run_coroutine_threadsafe(self._resume(), self._loop)

    async def _resume(self) -> None:
        """Answer this worker id's pending claims: it was killed or stopped while computing them."""
        for claim in await asyncio.to_thread(self.store.unfinished_escalations, self.config.worker_id):
            try:
                if claim.topic is None or claim.envelope is None:
                    raise ProtocolError("claimed by an older version, without its request")
                env = decode(claim.envelope, max_bytes=len(claim.envelope))
            except ProtocolError as e:
                _log.warning("cannot resume escalation %s (%s); the edge's re-send brings it back", claim.key, e)
                await asyncio.to_thread(self.store.release_escalation, claim.key)
                continue
            self.stats["resumed"] += 1
            _log.info("resuming escalation %s, left unfinished by this worker's previous run", claim.key)
            self._spawn(claim.topic, env, claim.received_at)

    async def _renew_leases(self) -> None:
        """Hold this worker's claims while it computes them: a re-send that reaches another worker after
        ``claim_lease_s`` is left to this one instead of being computed twice."""
        while True:
            await asyncio.sleep(self.config.claim_lease_s / 3)
            if not self._inflight:
                continue
            try:
                await asyncio.to_thread(self.store.renew_escalations, self.config.worker_id)
            except Exception as e:  # the database went away for a moment: the next round tries again
                _log.warning("could not renew escalation leases: %r", e)

    # ---- message path ---------------------------------------------------------------------------
    def on_message(self, topic: str, env: Envelope) -> None:
        """MQTT thread: hand the request to the worker loop and return at once."""
        if not self._started:
            return
        self._loop.call_soon_threadsafe(self._spawn, topic, env, time.time())

    def _spawn(self, topic: str, env: Envelope, received_at: float) -> None:
        task = self._loop.create_task(self.handle(topic, env, received_at))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # e.g. the database went away
            self.stats["errors"] += 1
            _log.error("escalation handling failed (the edge's retry will come back): %r", task.exception())

    async def handle(self, topic: str, env: Envelope, received_at: float | None = None) -> InferenceResult | None:
        """Answer one escalation envelope that arrived on ``topic`` (exactly one reply per envelope unless
        another worker owns it, none when its body speaks for another node than the topic's)."""
        received_at = received_at or time.time()
        self.stats["received"] += 1
        req = env.body
        if not isinstance(req, InferenceRequest):
            self.stats["ignored"] += 1
            _log.warning("ignored %s from %s on the escalation topic: not an inference_request", env.type, env.sender)
            return None
        try:
            identity.check(topic, env)
        except identity.IdentityError as e:
            self._refuse("identity_mismatch", "dropped escalation: %s", e)
            return None
        if not env.reply_to:
            self.stats["ignored"] += 1
            _log.warning("ignored escalation %s from %s: no reply-to", req.request_id, env.sender)
            return None
        reply_topic = topics.reply_for(topic)
        if env.reply_to != reply_topic:
            error = (f"reply_to {env.reply_to!r} refused: an escalation on {topic} is answered only on "
                     f"{reply_topic}")
            self._refuse("reply_to_refused", "escalation %s from %s: %s", req.request_id, env.sender, error)
            refusal = InferenceResult(request_id=req.request_id, site=req.site, device=req.device, status="rejected",
                                      tier="cloud", event_seq=req.event.seq if req.event else None,
                                      model=self.config.model_name, error=error)
            self._reply(env.model_copy(update={"reply_to": reply_topic}), refusal)
            return refusal
        key, ident = env.id, (req.site, req.device, req.request_id)
        with bind(site=req.site, device=req.device, request_id=req.request_id):
            waiting = self._inflight.get(ident)
            if waiting is not None:  # re-sent while this worker computes it: answer both when done
                waiting.append(env)
                return None
            self._inflight[ident] = [env]  # reserve before the first await: a re-send now joins this one
            try:
                claim = await asyncio.to_thread(  # SQLite may wait on another process's write lock
                    self.store.claim_escalation, key, request_id=req.request_id, site=req.site, device=req.device,
                    priority=req.priority, reason=req.reason, worker=self.config.worker_id,
                    lease_s=self.config.claim_lease_s, now=time.time(), topic=topic,
                    envelope=encode(env, max_bytes=sys.maxsize))
            except BaseException:
                self._inflight.pop(ident, None)
                raise
            if claim.state != "claimed":
                waiters = self._inflight.pop(ident, [env])
            if claim.state == "answered":
                self.stats["cached"] += len(waiters)
                self.metrics.escalations.labels(outcome="duplicate").inc(len(waiters))
                for waiter in waiters:
                    self._reply(waiter, claim.result)
                return claim.result
            if claim.state == "busy":
                self.stats["busy"] += 1
                _log.info("escalation %s is being computed by another worker", req.request_id)
                return None
            try:
                result = await self._answer(req, received_at)
            except asyncio.CancelledError:
                self.store.release_escalation(key)
                self._inflight.pop(ident, None)
                raise
            except UpstreamUnavailable as e:  # no answer is better than a wrong one: the re-send comes back
                await asyncio.to_thread(self.store.release_escalation, key)
                self._inflight.pop(ident, None)
                self.stats["unavailable"] += 1
                self.metrics.escalations.labels(outcome="unavailable").inc()
                _log.warning("escalation %s left unfinished for the edge's re-send: %s", req.request_id, e)
                return None
            await asyncio.to_thread(self.store.finish_escalation, key, result)
            for waiter in self._inflight.pop(ident, [env]):
                self._reply(waiter, result)
            self.metrics.escalations.labels(outcome=result.status).inc()
            self.metrics.escalation_latency.labels(outcome=result.status).observe(result.latency_ms / 1000)
            return result

    def _refuse(self, outcome: str, message: str, *args: object) -> None:
        """Count (stats and ``apiary_escalations_total{outcome}``) and log a request refused before any work."""
        self.stats[outcome] += 1
        self.metrics.escalations.labels(outcome=outcome).inc()
        _log.warning(message, *args)

    def _reply(self, env: Envelope, result: InferenceResult) -> None:
        if self.transport is None:
            return
        if not self.transport.reply(env, result):
            _log.warning("reply to %s could not be queued", env.reply_to)

    # ---- inference ------------------------------------------------------------------------------
    async def _answer(self, req: InferenceRequest, received_at: float) -> InferenceResult:
        EngineError, EngineOverloaded, RequestRejected = self._errors()

        def result(status: str, **fields) -> InferenceResult:
            return InferenceResult(
                request_id=req.request_id, site=req.site, device=req.device, status=status, tier="cloud",
                event_seq=req.event.seq if req.event else None, escalation_reason=req.reason or None,
                model=self.config.model_name, latency_ms=(time.time() - received_at) * 1000, **fields)

        remaining = None if req.deadline is None else req.deadline - time.time()
        if remaining is not None and remaining <= 0:
            self.stats["expired"] += 1
            return result("expired", error=f"deadline passed {-remaining:.1f} s before the cloud saw the request")
        try:
            outcome = await asyncio.wait_for(self._limited(req), timeout=remaining)
        except TimeoutError:
            self.stats["expired"] += 1
            return result("expired", error="deadline passed while the request was queued or running")
        except EngineOverloaded as e:
            return result("deferred", error=f"cloud engine overloaded, retry later: {e}")
        except RequestRejected as e:
            return result("rejected", error=str(e))
        except UpstreamUnavailable:
            raise  # not an answer: handle() leaves the request unfinished
        except (EngineError, ValueError) as e:
            self.stats["errors"] += 1
            return result("error", error=f"{type(e).__name__}: {e}")
        self.stats["computed"] += 1
        self.metrics.tokens.labels(path="mqtt", kind="prompt").inc(outcome.prompt_tokens)
        self.metrics.tokens.labels(path="mqtt", kind="completion").inc(outcome.completion_tokens)
        self.metrics.e2e.labels(path="mqtt").observe(time.time() - received_at)
        return result("error" if outcome.error else "ok", text=outcome.text, action=outcome.action,
                      error=outcome.error, confidence=outcome.score, logprob_quantiles=outcome.quantiles,
                      prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens)

    def _errors(self) -> tuple[type[Exception], type[Exception], type[Exception]]:
        """The backend's (failed, overloaded, rejected) exceptions; the engine's are imported only for the engine
        (importing cloud.engine loads torch)."""
        if self.config.backend == "openai":
            from apiary.cloud.upstream import UpstreamError, UpstreamOverloaded, UpstreamRejected

            return UpstreamError, UpstreamOverloaded, UpstreamRejected
        from apiary.cloud.engine import EngineError, EngineOverloaded, RequestRejected

        return EngineError, EngineOverloaded, RequestRejected

    async def _limited(self, req: InferenceRequest) -> ActionOutcome:
        """Run within the worker's concurrency; a full engine queue is retried with backoff, not bounced."""
        EngineOverloaded = self._errors()[1]

        async with self._semaphore:
            give_up = time.monotonic() + self.config.overload_retry_s
            delay = 0.05
            while True:
                try:
                    return await self._infer(req)
                except EngineOverloaded:
                    if time.monotonic() + delay > give_up:
                        raise
                    self.stats["overload_retries"] += 1
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)

    async def _infer(self, req: InferenceRequest) -> ActionOutcome:
        """One engine request: the schema-constrained Action (``json_action``, with its confidence) or plain text."""
        RequestRejected = self._errors()[2]
        messages = [m.model_dump() for m in req.messages]
        if req.event is not None and req.response_format == "json_action" and (
                not messages or self.engine.prompt_style != "examples"):
            # A sensor event is asked in the cloud model's own prompt style: a task-tuned teacher reads the
            # short prompt it was tuned on, whatever prompt the edge's model needed.
            from apiary.shared.prompting import build_messages

            messages = [m.model_dump() for m in build_messages(req.event, list(req.context),
                                                               style=self.engine.prompt_style)]
        if not messages and req.prompt is None:
            raise RequestRejected("the request has neither messages, a prompt nor an event")
        prompt = None if messages else req.prompt
        if self.config.backend == "openai":  # a bare prompt is sent as the user's message
            return await self.engine.answer(messages or [{"role": "user", "content": prompt}],
                                            action=req.response_format == "json_action", max_tokens=req.max_tokens,
                                            temperature=req.temperature, priority=req.priority)
        from apiary.cloud.engine import SamplingParams

        if req.response_format == "json_action":
            return await generate_action(self.engine, prompt, messages=messages or None, max_tokens=req.max_tokens,
                                         temperature=req.temperature, priority=req.priority)
        params = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature)
        out = await self.engine.generate(prompt=prompt, messages=messages or None, params=params,
                                         priority=req.priority)
        return ActionOutcome(out.text, None, None, len(out.prompt_token_ids), len(out.output_token_ids))
