"""The edge agent process: MQTT in, durable inbox/outbox, one worker for the model, one flusher for the link.

Threads and why:

* **paho's network thread** runs the handlers. They only write to SQLite and wake a
  thread: an event is committed to the inbox *before* the handler returns, i.e. before
  the broker gets its PUBACK, so a kill -9 cannot lose an acknowledged event. A cloud
  reply is turned into the final answer in one transaction with removing its
  escalation, so a repeated reply is a no-op (exactly once at application level).
* **worker** takes pending events (most urgent first) and runs the
  :class:`~edge.responder.Responder`; its outgoing message is committed together with
  marking the event done.
* **flusher** sends the outbox. It sleeps until something is queued or the link comes
  back (the transport's link listener), never on a polling timer; the only timed
  wake-ups are escalation re-sends (``apiary.edge.resend``: an unanswered escalation goes out
  again until its deadline, even while the link stays up), escalation deadlines (fall
  back to the local draft) and telemetry.

* **ota** (``[edge.ota] enabled``) applies the OTA commands of the device's own ``ota/cmd``
  topic with :class:`~edge.ota.OtaUpdater`: download, verify, install, health check, all off
  the answering path. Its health check also loads the new model in this process and asks it
  the probe; once the update is committed the worker switches to that model between two
  events (the answer in flight finishes on the old one), so no event waits for a restart
  or is lost. A failed check keeps the old model and the old slot (``rolled_back``). A
  command deferred for a low battery is taken up again once a reading shows it recovered.

Identity comes from the topic (``apiary.shared.identity``): an event, a reply or an OTA command whose
body names another site or device than the topic it arrived on is dropped, counted
(``foreign_events``, ``foreign_replies``, ``foreign_ota_commands``) and logged, never acted on.

Answer envelope ids are derived from the event's id, so whatever path produced the
final answer (edge, cloud, fallback), a resend has the same id and consumers de-duplicate it.
"""
from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from apiary.edge.errors import EdgeError
from apiary.edge.model import LocalModel
from apiary.edge.ota import HealthCheckFailed, LlamaHealthCheck, OtaUpdater, judge_probe, probe
from apiary.edge.resend import ResendSchedule
from apiary.edge.responder import Outcome, Responder
from apiary.edge.settings import EdgeSettings
from apiary.edge.store import DeviceStore, OutboxItem
from apiary.shared import identity, image, topics
from apiary.shared.config import MqttConfig
from apiary.shared.logs import bind, get_logger
from apiary.shared.protocol import (DeviceState, Envelope, InferenceResult, MessageType, OtaCommand, ProtocolError,
                             SensorEvent, decode, encode, make, priority_for)

log = get_logger(__name__)

RETRY_S = 1.0  # a publish that was not acknowledged while the link is up is retried after this


def derived_id(prefix: str, event_id: str) -> str:
    """A stable envelope id for the message an event causes (``a``: answer, ``e``: escalation)."""
    return prefix + hashlib.sha256(event_id.encode()).hexdigest()[:31]


def final_from_reply(reply: InferenceResult, fallback: InferenceResult, *, waited_s: float) -> InferenceResult:
    """The final answer once the cloud replied: the cloud's when it is usable, else the local draft."""
    reason = fallback.escalation_reason
    if reply.status == "ok":
        return reply.model_copy(update={
            "request_id": fallback.request_id, "site": fallback.site, "device": fallback.device, "tier": "cloud",
            "event_seq": fallback.event_seq, "escalation_reason": reason,
            "latency_ms": fallback.latency_ms + waited_s * 1000.0, "energy_j": fallback.energy_j})
    why = f"cloud answered {reply.status}" + (f": {reply.error}" if reply.error else "")
    if fallback.action is not None:
        return fallback.model_copy(update={"escalation_reason": f"{reason}; {why}; local answer used",
                                           "latency_ms": fallback.latency_ms + waited_s * 1000.0})
    return reply.model_copy(update={
        "request_id": fallback.request_id, "site": fallback.site, "device": fallback.device,
        "event_seq": fallback.event_seq, "escalation_reason": reason,
        "latency_ms": fallback.latency_ms + waited_s * 1000.0})


class EdgeAgent:
    """One device's agent. ``start()``, then ``stop()``; or ``run(stop_event)`` for a process."""

    def __init__(self, settings: EdgeSettings, *, site: str, device: str, mqtt: MqttConfig,
                 model: LocalModel | None = None, state_dir: str | Path | None = None) -> None:
        from apiary.shared.transport import MqttTransport

        topics.event(site, device)  # validates the names (TopicError)
        self.settings, self.site, self.device = settings, site, device
        self.sender = f"edge.{site}.{device}"
        state_dir = Path(state_dir or settings.state_dir).expanduser()
        self.store = DeviceStore(state_dir / f"{site}.{device}.sqlite3", outbox_max=settings.outbox_max,
                                 inbox_max=settings.inbox_max)
        self.session = self.store.next_session()
        self._model = model
        self._own_model = model is None  # a model handed in belongs to the caller; don't close it
        self.image_version: str | None = None  # the signed image the running model came from
        self.responder: Responder | None = None
        self.transport = MqttTransport(mqtt, client_id=f"edge-{site}-{device}", persistent=True,
                                       will=(topics.state(site, device), self._state_envelope("death")),
                                       retain_will=True)
        self._stop = threading.Event()
        self._closed = False
        self._wake_worker = threading.Event()
        self._wake_flush = threading.Event()
        self._link_gen = 0  # bumped on every (re)connect
        self._born_gen = -1  # the link generation our last birth certificate was published in
        self._resend = ResendSchedule(settings.escalation_resend_s)  # when each escalation goes out again
        self._last_state = 0.0
        self._threads: list[threading.Thread] = []
        self.ota: OtaUpdater | None = None
        self._ota_cv = threading.Condition()
        self._ota_queue: deque[OtaCommand] = deque()
        self._ota_deferred: OtaCommand | None = None  # waits for the battery
        self._staged: LocalModel | None = None  # the new model, loaded and probed during the health check
        self._swap_to: tuple[LocalModel, str] | None = None  # committed: the worker switches to it
        self._swap_lock = threading.Lock()
        if settings.ota.enabled:
            try:
                operator_keys = [image.load_public_key(k) for k in settings.ota.operator_keys]
            except image.ImageError as e:
                raise EdgeError(f"[edge.ota] operator_keys: {e}") from None
            try:
                self.ota = OtaUpdater(state_dir / f"{site}.{device}.ota", self.transport, site, device,
                                      settings.resolve_ota_key(), health_check=self._check_and_stage,
                                      max_attempts=settings.ota.download_attempts,
                                      max_image_bytes=settings.ota.max_image_bytes,
                                      min_free_bytes=settings.ota.min_free_bytes, defer=self._ota_defers,
                                      operator_keys=operator_keys)
            except image.ImageError as e:
                raise EdgeError(f"[edge.ota] public_key: {e}") from None

    # ------------------------------------------------------------------ lifecycle

    @property
    def model_version(self) -> str | None:
        return self._model.version if self._model is not None else None

    def _load_model(self) -> None:
        """The active OTA slot's model when one is installed, else the built-in one (handed in or configured)."""
        slot = self.ota.active_model_path() if self.ota else None
        if slot is not None:
            assert self.ota is not None
            try:
                self._model, self._own_model = LocalModel.from_settings(self.settings, slot), True
                self.image_version = self.ota.active_version()
                return
            except EdgeError as e:  # e.g. a runtime that no longer reads it: the built-in model still answers
                log.error("the installed image's model does not load (%s); running the built-in model", e)
        if self._model is None:
            self._model = LocalModel.from_settings(self.settings)
        self.image_version = self._image_of(self._model)
        if self.ota is not None:
            self.ota.builtin_version = self.image_version  # the anti-rollback floor while no slot is active

    def _image_of(self, model: Any) -> str | None:
        """The version of the signed image ``model``'s file was unpacked from (the shipped student is one), when
        its manifest beside it is signed by the key this device trusts for OTA; None otherwise."""
        path = getattr(model, "path", None)
        if path is None:
            return None
        try:
            manifest = image.read_installed(Path(path).parent, self.ota.public_key if self.ota else None)
        except image.ImageError:
            return None
        return manifest.image_version if manifest.model.filename == Path(path).name else None

    def start(self, connect_timeout: float = 10.0) -> "EdgeAgent":
        """Load the model, subscribe, connect (retrying until stopped), start the threads."""
        s = self.settings
        self._load_model()
        self.responder = Responder(s, self._model, max_payload=self.transport.config.max_payload)
        self.transport.set_will(topics.state(self.site, self.device), self._state_envelope("death"))
        self.transport.add_link_listener(self._on_link)
        self.transport.subscribe(topics.event(self.site, self.device), self._on_event)
        self.transport.subscribe(topics.reply(self.site, self.device), self._on_reply)
        workers = [("edge-worker", self._work), ("edge-flusher", self._flush_loop)]
        if self.ota is not None:
            self.transport.subscribe(topics.ota_command(self.site, self.device), self._on_ota)
            workers.append(("edge-ota", self._ota_loop))
        for name, target in workers:
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        from apiary.shared.transport import TransportError

        while not self._stop.is_set():
            try:
                self.transport.start(timeout=connect_timeout)
                break
            except TransportError as e:
                if "refused client" in str(e):
                    raise EdgeError(str(e)) from None
                log.warning("broker not reachable yet (%s); working offline and retrying", e)
        if self.transport.connected and not self.transport.wait_subscribed(connect_timeout):
            log.warning("the broker has not confirmed this device's subscriptions after %g s; events published "
                        "before it does may pass it by", connect_timeout)
        log.info("edge agent %s/%s up (session %d, model %s)", self.site, self.device, self.session,
                 self.model_version)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the current event, publish the death certificate, disconnect cleanly (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake_worker.set()
        self._wake_flush.set()
        with self._ota_cv:
            self._ota_cv.notify_all()
        for t in self._threads:
            t.join(timeout)
        if self.transport.connected:
            self.transport.publish(topics.state(self.site, self.device), self._state_envelope("death"), retain=True,
                                   timeout=2.0)
        try:
            self.transport.stop()
        except Exception:  # never let a broken link block shutdown
            log.exception("transport stop failed")
        self.store.close()
        if self._model is not None and self._own_model:
            self._model.close()
        for left in (self._staged, self._swap_to[0] if self._swap_to else None):
            if left is not None and left is not self._model:
                left.close()

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set (the CLI sets it on SIGTERM/SIGINT), even while still connecting."""
        threading.Thread(target=lambda: (stop.wait(), self._stop.set()), name="edge-stop", daemon=True).start()
        self.start()
        try:
            stop.wait()
        finally:
            self.stop()

    # ------------------------------------------------------------------ network-thread handlers

    def _on_link(self, up: bool) -> None:
        if up:
            self._link_gen += 1
            self._wake_flush.set()

    def _on_event(self, topic: str, env: Envelope) -> None:
        if env.type != MessageType.SENSOR_EVENT:
            self.store.bump("unexpected_messages")
            return
        if not self._speaks_for_us(topic, env, "foreign_events"):
            return
        ev: SensorEvent = env.body  # type: ignore[assignment]
        fresh = self.store.receive(env.id, device=ev.device, seq=ev.seq, ts=ev.timestamp,
                                   priority=priority_for(ev.severity, question=ev.kind == "question"),
                                   payload=encode(env))
        if fresh:
            self._wake_worker.set()
        else:
            self.store.bump("duplicate_events")

    def _on_reply(self, topic: str, env: Envelope) -> None:
        if env.type != MessageType.INFERENCE_RESULT or not env.correlation_id:
            self.store.bump("unexpected_messages")
            return
        if not self._speaks_for_us(topic, env, "foreign_replies"):
            return
        item = self.store.get(env.correlation_id)
        if item is None or item.kind != "escalation" or item.fallback is None:
            self.store.bump("duplicate_replies")
            return
        fallback: InferenceResult = decode(item.fallback).body  # type: ignore[assignment]
        final = final_from_reply(env.body, fallback, waited_s=max(0.0, time.time() - item.created))  # type: ignore[arg-type]
        answer = self._answer_item(final, item.event_id, item.priority)
        counter = "answered_cloud" if final.tier == "cloud" else "answered_fallback"
        if self.store.resolve(item.id, answer, counter=counter):
            self._resend.forget(item.id)
            self._count_answer(final)
            self._wake_flush.set()
        else:
            self.store.bump("duplicate_replies")

    def _on_ota(self, topic: str, env: Envelope) -> None:
        if env.type != MessageType.OTA_COMMAND:
            self.store.bump("unexpected_messages")
            return
        if not self._speaks_for_us(topic, env, "foreign_ota_commands"):
            return
        with self._ota_cv:
            self._ota_queue.append(env.body)  # type: ignore[arg-type]
            self._ota_deferred = None  # a newer command replaces one waiting for the battery
            self._ota_cv.notify_all()

    def _speaks_for_us(self, topic: str, env: Envelope, counter: str) -> bool:
        """The body names the node of its topic (ours: the agent subscribes only to its own); else count and log."""
        try:
            identity.check(topic, env)
        except identity.IdentityError as e:
            self.store.bump(counter)
            log.warning("ignored %s: %s", env.type.value, e)
            return False
        return True

    # ------------------------------------------------------------------ worker

    def _work(self) -> None:
        while not self._stop.is_set():
            if self._swap_to is not None:
                self._swap_model()
            nxt = self.store.next_event()
            if nxt is None:
                self._wake_worker.wait()
                self._wake_worker.clear()
                continue
            event_id, payload = nxt
            try:
                self._handle(event_id, payload)
            except Exception:  # a bug must not stop the device; the event gets an error answer
                log.exception("failed to handle event %s", event_id)
                self.store.finish(event_id, counter="event_errors")
            self._wake_flush.set()
            if self._ota_deferred is not None:  # the event's battery reading may let it go on
                with self._ota_cv:
                    self._ota_cv.notify_all()

    def _handle(self, event_id: str, payload: bytes) -> None:
        try:
            env = decode(payload)
        except ProtocolError as e:
            log.warning("stored event %s is unreadable (%s); dropped", event_id, e)
            self.store.finish(event_id, counter="bad_events")
            return
        ev: SensorEvent = env.body  # type: ignore[assignment]
        context = []
        for raw in self.store.context(ev.device, ev.timestamp, self.settings.context_events):
            try:
                context.append(decode(raw).body)
            except ProtocolError:
                continue
        assert self.responder is not None
        with bind(site=ev.site, device=ev.device, event_seq=ev.seq):
            out = self.responder.respond(ev, context, link_up=self.transport.connected,
                                         request_id=f"{ev.device}-{ev.seq}-{event_id[:8]}")
            self._finish(event_id, ev, out)

    def _finish(self, event_id: str, ev: SensorEvent, out: Outcome) -> None:
        priority = priority_for(ev.severity, question=ev.kind == "question")
        if out.route == "logged":
            self.store.finish(event_id, counter="routine_logged")
            return
        assert out.answer is not None
        if out.route == "escalated":
            assert out.request is not None
            esc_id = derived_id("e", event_id)
            env = make(out.request, sender=self.sender, id=esc_id, correlation_id=esc_id,
                       reply_to=topics.reply(self.site, self.device))
            fallback = make(out.answer, sender=self.sender, id=derived_id("a", event_id))
            item = OutboxItem(id=esc_id, kind="escalation", topic=topics.escalate(self.site, self.device),
                              payload=encode(env), priority=priority, event_id=event_id, created=time.time(),
                              deadline=out.request.deadline, fallback=encode(fallback))
            dropped = self.store.finish(event_id, [item], counter="escalated")
            log.info("escalated: %s", out.decision.explain() if out.decision else "")
            if out.trimmed:
                self.store.bump("escalations_trimmed")
                log.warning("escalation trimmed to fit the %d-byte payload limit: %s",
                            self.transport.config.max_payload, out.trimmed)
        else:
            item = self._answer_item(out.answer, event_id, priority)
            dropped = self.store.finish(event_id, [item], counter="answered_edge" if out.route == "answered"
                                        else "deferred")
            self._count_answer(out.answer)
            if out.decision is not None and out.decision.blocked:
                log.warning("not escalated (%s): answered locally", out.decision.blocked)
            log.info("answered locally (%s): %s", out.answer.status,
                     out.answer.action.get("assessment") if out.answer.action else out.answer.error)
        if dropped:
            log.warning("outbox full: dropped %d lowest-priority message(s)", len(dropped))

    def _answer_item(self, result: InferenceResult, event_id: str, priority: int) -> OutboxItem:
        env = make(result, sender=self.sender, id=derived_id("a", event_id))
        return OutboxItem(id=env.id, kind="answer", topic=topics.answer(self.site, self.device), payload=encode(env),
                          priority=priority, event_id=event_id, created=time.time())

    def _count_answer(self, result: InferenceResult) -> None:
        if result.status == "ok" and self.responder is not None:
            self.responder.budget.answered_event()

    def _swap_model(self) -> None:
        """Answer with the committed update's model from the next event on (runs on the worker, between events)."""
        assert self.responder is not None
        with self._swap_lock:
            taken, self._swap_to = self._swap_to, None
        if taken is None:
            return
        model, version = taken
        old, own = self._model, self._own_model
        self._model, self._own_model, self.image_version = model, True, version
        self.responder.model = model
        if old is not None and own:
            old.close()
        self.store.bump("models_switched")
        log.info("now answering with %s (image %s) instead of %s", model.version, version,
                 old.version if old is not None else None)
        self._last_state = float("-inf")  # tell the fleet at once
        self._wake_flush.set()
        # From the next connection on, the Last Will names the new model too (this connection's was sent at CONNECT).
        self.transport.set_will(topics.state(self.site, self.device), self._state_envelope("death"))

    # ------------------------------------------------------------------ OTA

    def _ota_loop(self) -> None:
        assert self.ota is not None
        while True:
            cmd = self._next_ota()
            if cmd is None:
                return
            final = self.ota.handle(cmd)
            staged, self._staged = self._staged, None
            if final.phase == "committed" and staged is not None:
                with self._swap_lock:  # a later update committed before the worker switched: it replaces it
                    replaced, self._swap_to = self._swap_to, (staged, cmd.image_version)
                if replaced is not None:
                    replaced[0].close()
                self._wake_worker.set()
            elif staged is not None:
                staged.close()
            if final.phase == "deferred":
                with self._ota_cv:
                    if not self._ota_queue:
                        self._ota_deferred = cmd

    def _next_ota(self) -> OtaCommand | None:
        """The next command; a deferred one once the battery allows it; None when stopping."""
        with self._ota_cv:
            while not self._stop.is_set():
                if self._ota_queue:
                    return self._ota_queue.popleft()
                if self._ota_deferred is not None and self._ota_defers() is None:
                    cmd, self._ota_deferred = self._ota_deferred, None
                    return cmd
                self._ota_cv.wait()
        return None

    def _ota_defers(self) -> str | None:
        if self._stop.is_set():
            return "the agent is stopping"
        budget = self.responder.budget if self.responder is not None else None
        return budget.defers_update(self.settings.ota.min_soc) if budget is not None else None

    def _check_and_stage(self, path: Path, manifest: image.Manifest) -> str:
        """The health check of an update: the probe in a child process (a model that crashes llama.cpp takes only
        the child down), then the model loaded here and asked the probe again; it is kept for the switch."""
        s = self.settings
        detail = LlamaHealthCheck(budget_s=s.ota.health_budget_s, max_tokens=s.max_tokens)(path, manifest)
        try:
            model = LocalModel.from_settings(s, path)
        except EdgeError as e:
            raise HealthCheckFailed(f"the agent could not load it: {e}") from None
        try:
            here = judge_probe(probe(model, max_tokens=s.max_tokens), max_tokens=s.max_tokens)
        except BaseException:
            model.close()
            raise
        self._staged = model
        return f"{detail}; loaded in the agent, {here}"

    # ------------------------------------------------------------------ flusher

    def _flush_loop(self) -> None:
        retry = False
        while not self._stop.is_set():
            self._wake_flush.wait(self._sleep_for(retry))
            self._wake_flush.clear()
            if self._stop.is_set():
                break
            try:
                self._expire_overdue()
                retry = self._flush_once() if self.transport.connected else False
                self._maybe_publish_state()
            except Exception:
                log.exception("outbox flush failed; retrying")
                retry = True

    def _sleep_for(self, retry: bool) -> float | None:
        """Until the next escalation deadline or telemetry update; None (until woken) when neither."""
        waits = [RETRY_S] if retry else []
        deadline = self.store.next_deadline()
        if deadline is not None:
            waits.append(deadline + self.settings.escalation_grace_s - time.time())
        if self.transport.connected:
            waits.append(self._last_state + self.settings.state_interval_s - time.monotonic())
            now = time.time()
            resend = self._resend.wait((i.id for i in self.store.pending("escalation")
                                        if i.deadline is None or now <= i.deadline), time.monotonic())
            if resend is not None:
                waits.append(resend)
        return max(0.05, min(waits)) if waits else None

    def _flush_once(self) -> bool:
        """Send what is due; True when something was not acknowledged and should be retried."""
        gen = self._link_gen
        if self._born_gen != gen:
            if not self._publish_state("birth"):
                return True
            self._born_gen = gen
            if self.ota is not None:
                self.ota.announce_boot()  # a trial slot reverted at start-up; a final status the link lost
        for item in self.store.pending():
            if self._stop.is_set() or not self.transport.connected:
                return False
            if item.kind == "escalation":
                if (item.deadline is not None and time.time() > item.deadline) or not self._resend.due(
                        item.id, gen, time.monotonic()):
                    continue
            env = decode(item.payload)
            if not self.transport.publish(item.topic, env, qos=1, timeout=self.settings.ack_timeout_s):
                return True
            if item.kind == "answer":
                self.store.ack(item.id)
                self.store.bump("answers_sent")
            else:
                self.store.sent(item.id)
                self._resend.sent(item.id, gen, time.monotonic())
                self.store.bump("escalations_sent")
        return False

    def _expire_overdue(self) -> None:
        """Escalations the cloud did not answer by deadline + grace get the local draft as final answer."""
        now = time.time()
        for item in self.store.pending("escalation"):
            if item.deadline is None or now < item.deadline + self.settings.escalation_grace_s or item.fallback is None:
                continue
            fallback: InferenceResult = decode(item.fallback).body  # type: ignore[assignment]
            final = fallback.model_copy(update={"escalation_reason": f"{fallback.escalation_reason}; no cloud answer "
                                                f"within {self.settings.escalation_deadline_s:.0f} s"})
            if self.store.resolve(item.id, self._answer_item(final, item.event_id, item.priority),
                                  counter="answered_fallback"):
                self._resend.forget(item.id)
                self._count_answer(final)

    # ------------------------------------------------------------------ birth / death / telemetry

    def _state_envelope(self, status: str) -> Envelope:
        budget = self.responder.budget if self.responder else None
        counters = self.store.counters()
        if budget is not None:
            counters.update(energy_mj=int(budget.energy_j * 1000), answered_ok=budget.answered)
            if budget.joules_per_answer is not None:
                counters["mj_per_answer"] = int(budget.joules_per_answer * 1000)
        counters.update(outbox=self.store.count(), pending_events=self.store.pending_events())
        tph = budget.tokens_per_hour if budget else None
        state = DeviceState(site=self.site, device=self.device, status=status, online=status != "death",
                            session=self.session, role="edge",
                            battery_soc=budget.battery_soc if budget else None,
                            battery_v=budget.battery_v if budget else None, solar_w=budget.solar_w if budget else None,
                            model_version=self.model_version, image_version=self.image_version,
                            budget_tokens_per_hour=None if tph is None else round(tph, 1), counters=counters)
        return make(state, sender=self.sender)

    def _publish_state(self, status: str) -> bool:
        ok = self.transport.publish(topics.state(self.site, self.device), self._state_envelope(status), retain=True,
                                    timeout=self.settings.ack_timeout_s)
        if ok:
            self._last_state = time.monotonic()
        return ok

    def _maybe_publish_state(self) -> None:
        if self.transport.connected and time.monotonic() - self._last_state >= self.settings.state_interval_s:
            self._publish_state("update")
