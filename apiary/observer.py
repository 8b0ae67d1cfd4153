"""Watches the mesh from the outside, over MQTT only, and keeps the numbers the demo shows.

The observer is just another MQTT client: it subscribes to every event, escalation,
answer and state topic and matches answers to the events they answer (site, device,
seq). What it reports is therefore what an operator could see on the wire, not what
the components claim about themselves.
"""
from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from apiary.edge.policy import rule_of
from apiary.edge.triage import needs_answer
from apiary.shared import topics
from apiary.shared.config import MqttConfig
from apiary.shared.protocol import DeviceState, Envelope, InferenceRequest, InferenceResult, OtaStatus, SensorEvent
from apiary.shared.transport import MqttTransport

EventKey = tuple[str, str, int]  # site, device, seq


@dataclass(slots=True)
class EventRecord:
    event: SensorEvent
    published_at: float  # the bridge's envelope timestamp
    seen_at: float
    answer: InferenceResult | None = None
    answered_at: float | None = None
    answers: int = 0  # more than one would be a double answer


def anomaly_runs(records: list[EventRecord]) -> list[list[EventRecord]]:
    """The injected anomalies among ``records``: each a run of one device's consecutive events (by seq)
    with the same ground-truth label other than normal. One anomaly lasts many sensor frames."""
    by_device: dict[tuple[str, str], list[EventRecord]] = {}
    for r in records:
        if r.event.truth and r.event.truth != "normal":
            by_device.setdefault((r.event.site, r.event.device), []).append(r)
    runs: list[list[EventRecord]] = []
    for device_records in by_device.values():
        device_records.sort(key=lambda r: r.event.seq)
        run = [device_records[0]]
        for prev, r in zip(device_records, device_records[1:]):
            if r.event.seq == prev.event.seq + 1 and r.event.truth == prev.event.truth:
                run.append(r)
            else:
                runs.append(run)
                run = [r]
        runs.append(run)
    return runs


def names_the_truth(r: EventRecord) -> bool:
    """The event's answer assessed it as what the simulator injected."""
    return r.answer is not None and bool(r.answer.action) and r.answer.action.get("assessment") == r.event.truth


@dataclass(slots=True)
class DeviceRecord:
    state: DeviceState | None = None
    first_battery_soc: float | None = None
    energy_j: float = 0.0
    ota: OtaStatus | None = None  # the newest OTA status the device published


@dataclass
class MeshObserver:
    config: MqttConfig
    client_id: str = field(default_factory=lambda: f"apiary-observer-{int(time.time() * 1000)}")
    started: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.events: dict[EventKey, EventRecord] = {}
        self.devices: dict[tuple[str, str], DeviceRecord] = {}
        self.escalation_reasons: Counter[str] = Counter()
        self.escalations = 0
        self.orphan_answers = 0
        self.nodes: dict[tuple[str, str], DeviceState] = {}
        self.timeline: deque[tuple[float, str]] = deque(maxlen=100_000)  # (answer time, tier)
        self._event_times: deque[float] = deque(maxlen=100_000)
        # persistent: across a broker restart the broker keeps our subscriptions and queues for us
        self.transport = MqttTransport(self.config, self.client_id, persistent=True)

    def start(self) -> "MeshObserver":
        self.transport.start()
        self.transport.subscribe(topics.all_of("event"), self._on_event)
        self.transport.subscribe(topics.all_of("answer"), self._on_answer)
        self.transport.subscribe(topics.all_of("escalate"), self._on_escalation)
        self.transport.subscribe(topics.all_of("state"), self._on_state)
        self.transport.subscribe(topics.all_of("state", site=topics.CLOUD_SITE), self._on_state)
        self.transport.subscribe(topics.all_of("ota/status"), self._on_ota_status)
        return self

    def stop(self) -> None:
        self.transport.stop()

    # -------------------------------------------------------------- handlers (paho thread: keep quick)

    def _on_event(self, topic: str, env: Envelope) -> None:
        ev = env.body
        if not isinstance(ev, SensorEvent):
            return
        now = time.time()
        with self._lock:
            self.events.setdefault((ev.site, ev.device, ev.seq), EventRecord(ev, env.ts, now))
            self._event_times.append(now)

    def _on_answer(self, topic: str, env: Envelope) -> None:
        ans = env.body
        if not isinstance(ans, InferenceResult) or ans.event_seq is None:
            return
        now = time.time()
        with self._lock:
            rec = self.events.get((ans.site, ans.device, ans.event_seq))
            if rec is None:
                self.orphan_answers += 1
                return
            rec.answers += 1
            if rec.answer is None:
                rec.answer, rec.answered_at = ans, now
                self.timeline.append((now, ans.tier))
            dev = self.devices.setdefault((ans.site, ans.device), DeviceRecord())
            dev.energy_j += ans.energy_j or 0.0

    def _on_escalation(self, topic: str, env: Envelope) -> None:
        req = env.body
        if isinstance(req, InferenceRequest):
            with self._lock:
                self.escalations += 1
                for reason in (req.reason or "unspecified").split("; "):  # as edge.responder joins them
                    self.escalation_reasons[rule_of(reason)] += 1

    def _on_state(self, topic: str, env: Envelope) -> None:
        st = env.body
        if not isinstance(st, DeviceState):
            return
        with self._lock:
            self.nodes[(st.site, st.device)] = st
            if st.role == "edge":
                dev = self.devices.setdefault((st.site, st.device), DeviceRecord())
                dev.state = st
                if dev.first_battery_soc is None and st.battery_soc is not None:
                    dev.first_battery_soc = st.battery_soc

    def _on_ota_status(self, topic: str, env: Envelope) -> None:
        st = env.body
        if isinstance(st, OtaStatus):
            with self._lock:
                self.devices.setdefault((st.site, st.device), DeviceRecord()).ota = st

    # -------------------------------------------------------------- numbers

    def snapshot(self) -> dict[str, Any]:
        """Everything the live view and the final summary show, computed from one consistent copy."""
        with self._lock:
            records = list(self.events.values())
            devices = {k: (v.state, v.first_battery_soc, v.energy_j, v.ota) for k, v in self.devices.items()}
            reasons = dict(self.escalation_reasons)
            escalations, orphans = self.escalations, self.orphan_answers
            now = time.time()
            recent = sum(1 for t in self._event_times if t > now - 10.0)
            nodes = dict(self.nodes)
        answered = [r for r in records if r.answer is not None]
        lat: dict[str, list[float]] = {"edge": [], "cloud": []}
        by_tier: Counter[str] = Counter()
        by_status: Counter[str] = Counter()
        for r in answered:
            by_tier[r.answer.tier] += 1
            by_status[r.answer.status] += 1
            lat[r.answer.tier].append((r.answered_at - r.published_at) * 1000.0)
        anomalies = anomaly_runs(records)
        anomaly_events = [r for run in anomalies for r in run]
        needing = needing_answer(records)
        waiting = [r for r in needing if r.answer is None]  # the backlog: needing an answer, none yet
        # Against the simulator's ground truth: each tier's answers whose assessment names the event's label.
        graded: dict[str, list[int]] = {}
        for r in answered:
            if r.event.truth and r.answer.action:
                tally = graded.setdefault(r.answer.tier, [0, 0])
                tally[0] += r.answer.action.get("assessment") == r.event.truth
                tally[1] += 1

        def pct(xs: list[float], q: float) -> float | None:
            return float(np.percentile(xs, q)) if xs else None

        return {
            "elapsed_s": now - self.started,
            "events": len(records),
            "events_per_s_10s": recent / 10.0,
            "events_needing_answer": len(needing),
            "answered": len(answered),
            "unanswered": len(waiting),
            "oldest_unanswered_s": max((now - r.seen_at for r in waiting), default=None),
            "first_answer_at": min((r.answered_at for r in answered), default=None),  # wall clock
            "answers_by_tier": dict(by_tier),
            "answers_by_status": dict(by_status),
            "double_answers": sum(1 for r in records if r.answers > 1),
            "orphan_answers": orphans,
            "escalations": escalations,
            "escalation_reasons": reasons,
            "latency_ms": {t: {"p50": pct(v, 50), "p99": pct(v, 99), "n": len(v)} for t, v in lat.items()},
            "anomalies_injected": len(anomalies),
            "anomalies_caught": sum(1 for run in anomalies if any(names_the_truth(r) for r in run)),
            "anomaly_events": len(anomaly_events),
            "anomalies_exact": sum(1 for r in anomaly_events if names_the_truth(r)),  # events named exactly
            "accuracy_by_tier": {t: {"right": a, "graded": n, "accuracy": a / n} for t, (a, n) in sorted(graded.items())},
            "cloud_tokens": sum(r.answer.prompt_tokens + r.answer.completion_tokens for r in answered
                                if r.answer.tier == "cloud"),
            "devices": {f"{s}/{d}": {
                "online": st.online if st else None,
                "battery_soc": st.battery_soc if st else None,
                "battery_soc_start": soc0,
                "budget_tokens_per_hour": st.budget_tokens_per_hour if st else None,
                "energy_j": energy,
                "image_version": st.image_version if st else None,
                "ota_phase": ota.phase if ota else None,  # the newest OTA status: phase, its image, its progress
                "ota_image": ota.image_version if ota else None,
                "ota_progress": ota.progress if ota else None,
            } for (s, d), (st, soc0, energy, ota) in sorted(devices.items())},
            "nodes_online": {f"{s}/{d}": st.online for (s, d), st in nodes.items()},
        }

    def window(self, start: float, end: float) -> dict[str, Any]:
        """The events that arrived between ``start`` and ``end`` (wall clock, e.g. while a rollout swapped models):
        how many needed an answer, how many have exactly one, none, or more than one, and the models that
        answered them."""
        with self._lock:
            records = list(self.events.values())
        needing = {id(r) for r in needing_answer(records)}
        inside = [r for r in records if start <= r.seen_at <= end]
        wanted = [r for r in inside if id(r) in needing]
        return {"events": len(inside), "needing_answer": len(wanted),
                "answered_once": sum(1 for r in wanted if r.answers == 1),
                "unanswered": sum(1 for r in wanted if r.answer is None),
                "double_answers": sum(1 for r in inside if r.answers > 1),
                "models": dict(Counter(r.answer.model for r in wanted if r.answer is not None))}

    def unanswered(self) -> list[str]:
        """The events that need an answer and have none yet, oldest first, as ``site/device #seq``."""
        with self._lock:
            records = list(self.events.values())  # arrival order, as the triage judges them
        return [f"{r.event.site}/{r.event.device} #{r.event.seq}" for r in needing_answer(records) if r.answer is None]

    def latencies(self) -> dict[str, list[float]]:
        with self._lock:
            out: dict[str, list[float]] = {"edge": [], "cloud": []}
            for r in self.events.values():
                if r.answer is not None:
                    out[r.answer.tier].append((r.answered_at - r.published_at) * 1000.0)
            return out

    def tier_timeline(self) -> list[tuple[float, str]]:
        with self._lock:
            return list(self.timeline)


def needing_answer(records: list[Any]) -> list[Any]:
    """The records the edge answers, by the edge's own triage (``apiary.edge.triage.needs_answer``), each event
    judged with its device's earlier events as context, in arrival order, as the agent sees them."""
    history: dict[tuple[str, str], list[SensorEvent]] = {}
    out = []
    for r in records:
        context = history.setdefault((r.event.site, r.event.device), [])
        if needs_answer(r.event, context):
            out.append(r)
        context.append(r.event)
    return out
