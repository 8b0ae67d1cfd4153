"""The fleet recorder: stores every state, event, answer and OTA status seen on the mesh.

It uses plain (not shared) subscriptions: retained birth certificates are only delivered
to plain subscribers, and every replica recording the same message is harmless because
the store's writes are idempotent on the envelope id. Handlers run on the MQTT network
thread and do one small indexed SQLite write each.

A message is stored only under the node of the topic it arrived on (``apiary.shared.identity``): a
body naming another site or device is refused, counted (``apiary_recorded_messages_total``,
kind ``<type>_refused``) and logged, so a device can write only its own fleet records, and a
retained spoof is refused again at every start. Device state then follows the Sparkplug
session rule (``Store.record_state``).
"""
from __future__ import annotations

from typing import Callable

from apiary.shared import identity, topics
from apiary.shared.logs import get_logger
from apiary.shared.protocol import DeviceState, Envelope, InferenceResult, OtaStatus, SensorEvent

from apiary.cloud.metrics import Metrics
from apiary.cloud.store import Store

_log = get_logger("apiary.cloud.recorder")

KINDS = ("state", "event", "answer", "ota/status")


class Recorder:
    def __init__(self, store: Store, metrics: Metrics | None = None, *,
                 on_ota_status: Callable[[OtaStatus], None] | None = None) -> None:
        """``on_ota_status``: called (on the MQTT thread; it must be quick) after each newly stored OTA status:
        the rollout driver's wake-up."""
        self.store = store
        self.metrics = metrics
        self.on_ota_status = on_ota_status

    def attach(self, transport) -> None:
        """Subscribe to every fleet topic on ``transport`` (a started or starting MqttTransport)."""
        for kind in KINDS:
            transport.subscribe(topics.all_of(kind), self.handle, qos=1)

    def handle(self, topic: str, env: Envelope) -> None:
        """Store one message; anything that does not fit is logged and dropped, never raised."""
        try:
            identity.check(topic, env)
        except identity.IdentityError as e:
            _log.warning("refused %s from %s: %s", env.type, env.sender, e)
            self._count(f"{env.type.value}_refused")
            return
        try:
            stored = self._store(env)
        except Exception:
            _log.exception("could not record %s from %s on %s", env.type, env.sender, topic)
            return
        if stored is None:
            _log.warning("ignored %s on %s: not a fleet message", env.type, topic)
        else:
            self._count(env.type.value if stored else f"{env.type.value}_ignored")

    def _count(self, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.recorded.labels(kind=kind).inc()

    def _store(self, env: Envelope) -> bool | None:
        body = env.body
        if isinstance(body, DeviceState):
            return self.store.record_state(body)
        if isinstance(body, SensorEvent):
            return self.store.record_event(env.id, body)
        if isinstance(body, InferenceResult):
            return self.store.record_answer(env.id, body)
        if isinstance(body, OtaStatus):
            stored = self.store.record_ota_status(env.id, body)
            if stored and self.on_ota_status is not None:
                self.on_ota_status(body)
            return stored
        return None
