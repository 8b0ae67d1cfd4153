"""The agent against a real Mosquitto: kill -9 with undelivered escalations, and a broker outage mid-stream.

The cloud is a small test double on MqttTransport that answers escalations the way
the cloud worker does (shared subscription, reply to ``reply_to`` with the request's
correlation id, one answer per request envelope id).
"""
from __future__ import annotations

import collections
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import pytest

from apiary.edge.agent import EdgeAgent
from apiary.edge.settings import EdgeSettings, PolicySettings
from apiary.shared import topics
from apiary.shared.config import MqttConfig
from apiary.shared.protocol import DeviceState, Envelope, InferenceRequest, InferenceResult, Severity, encode, make
from apiary.shared.transport import MqttTransport
from tests.edge.helpers import DEVICE, SITE, RecordingModel, agent_process, question, reading
from tests.shared.helpers import AclBroker, Inbox, forged_payload, publish_raw, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def fast(config: MqttConfig) -> MqttConfig:
    return config.model_copy(update={"reconnect_min_s": 0.1, "reconnect_max_s": 0.5})


class FakeCloud:
    """Answers each escalation once per envelope id (a resend gets the same cached answer)."""

    def __init__(self, config: MqttConfig, name: str = "fake-cloud", *, dedup: bool = True) -> None:
        self.seen: collections.Counter[str] = collections.Counter()
        self.requests: dict[str, InferenceRequest] = {}
        self._cache: dict[str, InferenceResult] = {}
        self._lock = threading.Lock()
        self.transport = MqttTransport(config, name, persistent=True)
        # A plain filter, not topics.escalations_shared(): Mosquitto 2.0.11 does not restore a persistent
        # session's shared subscriptions after a broker restart (reported to the transport room).
        self.transport.subscribe(topics.all_of("escalate"), self._on_request, dedup=dedup)

    def start(self) -> "FakeCloud":
        self.transport.start()
        assert self.transport.wait_subscribed(10)  # escalations sent before the SUBACK would pass it by
        return self

    def _on_request(self, topic: str, env: Envelope) -> None:
        req: InferenceRequest = env.body  # type: ignore[assignment]
        with self._lock:
            self.seen[env.id] += 1
            self.requests[env.id] = req
            result = self._cache.get(env.id)
            if result is None:
                result = self._cache[env.id] = InferenceResult(
                    request_id=req.request_id, site=req.site, device=req.device, status="ok", tier="cloud",
                    text='{"assessment": "normal"}', action={"assessment": "normal", "action": "Nothing to do",
                                                             "urgency": "low", "explanation": "cloud says so"},
                    prompt_tokens=100, completion_tokens=20, model="fake-cloud")
        self.transport.reply(env, result)

    def stop(self) -> None:
        self.transport.stop()


class ForgetfulCloud(FakeCloud):
    """Loses the first copy of every escalation, as a cloud killed right after the broker delivered it."""

    def __init__(self, config: MqttConfig) -> None:
        super().__init__(config, "forgetful-cloud", dedup=False)  # sees re-sends (one envelope id), as the worker
        self.arrived: collections.Counter[str] = collections.Counter()

    def _on_request(self, topic: str, env: Envelope) -> None:
        with self._lock:
            self.arrived[env.id] += 1
            if self.arrived[env.id] == 1:
                return
        super()._on_request(topic, env)


class Observer:
    """Watches answers and state like an operator dashboard would (persistent session)."""

    def __init__(self, config: MqttConfig) -> None:
        self.answers, self.states, self.escalations = Inbox(), Inbox(), Inbox()
        self.transport = MqttTransport(config, "observer", persistent=True)
        self.transport.subscribe(topics.answer(SITE, DEVICE), self.answers)
        self.transport.subscribe(topics.state(SITE, DEVICE), self.states)
        self.transport.subscribe(topics.escalate(SITE, DEVICE), self.escalations)
        self.transport.start()
        assert self.transport.wait_subscribed(10)

    def answers_by_seq(self) -> collections.Counter[int]:
        return collections.Counter(e.body.event_seq for e in self.answers.envs)

    def state(self, status: str, session: int) -> DeviceState | None:
        for e in self.states.envs:
            if e.body.status == status and e.body.session == session:
                return e.body
        return None


class Bridge:
    """Publishes events like the firmware bridge: in order, each retried until the broker acknowledged it."""

    def __init__(self, config: MqttConfig) -> None:
        self.transport = MqttTransport(config, "bridge-test", persistent=True).start()
        self._queue: list[Envelope] = []
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def send(self, body) -> None:
        with self._cv:
            self._queue.append(make(body, sender="bridge.test"))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue)
                env = self._queue[0]
            if env is None:
                return
            if self.transport.publish(topics.event(SITE, DEVICE), env, timeout=2.0):
                with self._cv:
                    self._queue.pop(0)
            else:
                time.sleep(0.05)

    def stop(self) -> None:
        with self._cv:
            self._queue.append(None)  # type: ignore[arg-type]
            self._cv.notify()
        self._thread.join(10)
        self.transport.stop()


def outbox_rows(state_dir: Path) -> list[tuple[str, str]]:
    db = sqlite3.connect(f"file:{state_dir / f'{SITE}.{DEVICE}.sqlite3'}?mode=ro", uri=True)
    try:
        return db.execute("SELECT id, kind FROM outbox").fetchall()
    finally:
        db.close()


def test_kill_9_with_undelivered_escalations_then_exactly_once(mosquitto, tmp_path: Path, gguf_path: Path) -> None:
    config = fast(mosquitto.config)
    state_dir, log = tmp_path / "state", tmp_path / "agent.log"
    cfg_file = tmp_path / "apiary.toml"
    cfg_file.write_text(f'[edge]\nthreads = 1\nmodel_path = "{gguf_path}"\nescalation_deadline_s = 120\n'
                        "[mqtt]\nreconnect_max_s = 0.5\n")
    observer = Observer(config)
    bridge = Bridge(config)
    agent = agent_process(config, state_dir, cfg_file, log)
    cloud = None
    try:
        wait_until(lambda: observer.state("birth", 1) is not None, 60, "birth certificate of session 1")
        birth = observer.state("birth", 1)
        assert birth.online and birth.model_version.startswith("SmolLM2-135M-Instruct.Q4_1.gguf")
        # No cloud is listening yet: the escalations reach the broker and go nowhere.
        n = 5
        for seq in range(1, n + 1):
            bridge.send(question(seq, f"Question {seq}: should I feed?", want_cloud=True))
        wait_until(lambda: len({e.id for e in observer.escalations.envs}) == n, 30, "escalations on the broker")
        assert sorted(k for _, k in outbox_rows(state_dir)) == ["escalation"] * n
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        wait_until(lambda: observer.state("death", 1) is not None, 30, "Last Will death certificate")
        assert not observer.state("death", 1).online
        assert len(outbox_rows(state_dir)) == n  # survived kill -9
        assert observer.answers.envs == []

        cloud = FakeCloud(config).start()
        agent = agent_process(config, state_dir, cfg_file, log)
        wait_until(lambda: observer.state("birth", 2) is not None, 60, "birth certificate of session 2")
        wait_until(lambda: len(observer.answers.envs) >= n, 60, f"{n} final answers")
        time.sleep(1.0)  # anything extra would arrive now
        by_seq = observer.answers_by_seq()
        assert by_seq == collections.Counter(range(1, n + 1)), by_seq  # each event answered exactly once
        assert {e.body.tier for e in observer.answers.envs} == {"cloud"}
        assert all(e.body.escalation_reason == "operator asked for a cloud answer" for e in observer.answers.envs)
        # The cloud handled each escalation once: n distinct envelope ids, one per event.
        assert len(cloud.seen) == n and set(cloud.seen.values()) == {1}
        assert sorted(r.event.seq for r in cloud.requests.values()) == list(range(1, n + 1))
        wait_until(lambda: outbox_rows(state_dir) == [], 20, "an empty outbox")
        agent.send_signal(signal.SIGTERM)  # clean stop: the agent publishes its own death certificate
        assert agent.wait(30) == 0, log.read_text()[-3000:]
        wait_until(lambda: observer.state("death", 2) is not None, 10, "death certificate of session 2")
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(20)
            except subprocess.TimeoutExpired:
                agent.kill()
        bridge.stop()
        for t in (observer.transport,) + ((cloud.transport,) if cloud else ()):
            t.stop()


def test_broker_outage_mid_stream_every_event_one_final_answer(mosquitto, tmp_path: Path, local_model) -> None:
    config = fast(mosquitto.config)
    cloud = FakeCloud(config).start()
    observer = Observer(config)
    bridge = Bridge(config)
    settings = EdgeSettings(threads=1, state_dir=str(tmp_path / "state"), ack_timeout_s=2.0,
                            policy=PolicySettings(min_confidence=-100.0))  # model events stay local
    agent = EdgeAgent(settings, site=SITE, device=DEVICE, mqtt=config, model=local_model).start()
    try:
        wait_until(lambda: observer.state("birth", 1) is not None, 30, "birth")

        def event_for(seq: int):
            if seq % 4 == 0:
                return reading(seq)  # routine: logged, no answer
            if seq in (1, 5):  # not right before a routine reading: that one would stay watched (edge.triage)
                return reading(seq, severity=Severity.WARNING, flags=("bee_traffic_high",), bee_traffic=8000.0)
            return question(seq, f"Question {seq}?", want_cloud=True)

        needs_answer = [s for s in range(1, 13) if s % 4 != 0]
        for seq in range(1, 5):
            bridge.send(event_for(seq))
            time.sleep(0.1)
        mosquitto.stop()  # the link goes down with answers and escalations in flight
        for seq in range(5, 9):
            bridge.send(event_for(seq))  # queued by the bridge's client while the broker is away
            time.sleep(0.1)
        time.sleep(2.0)
        mosquitto.start()
        for seq in range(9, 13):
            bridge.send(event_for(seq))
            time.sleep(0.1)
        wait_until(lambda: set(observer.answers_by_seq()) >= set(needs_answer), 90,
                   f"answers for {needs_answer} (have {sorted(observer.answers_by_seq())})")
        time.sleep(1.0)
        by_seq = observer.answers_by_seq()
        assert by_seq == collections.Counter(needs_answer), by_seq
        tiers = {e.body.event_seq: e.body.tier for e in observer.answers.envs}
        assert tiers[1] == tiers[5] == "edge" and tiers[2] == "cloud"
        assert set(cloud.seen.values()) == {1} and len(cloud.seen) == len(needs_answer) - 2
        counters = agent.store.counters()
        assert counters["routine_logged"] == 3 and counters["answered_edge"] == 2
        assert counters["answered_cloud"] == len(needs_answer) - 2
        wait_until(lambda: agent.store.count() == 0, 20, "an empty outbox")
        assert agent.transport.stats["reconnects"] >= 1
        agent.stop()
        wait_until(lambda: observer.state("death", 1) is not None, 10, "death certificate")
    finally:
        agent.stop()
        bridge.stop()
        for t in (observer.transport, cloud.transport):
            t.stop()


def test_no_cloud_answer_by_deadline_falls_back_and_bad_input_is_counted(mosquitto, tmp_path: Path,
                                                                         local_model) -> None:
    config = fast(mosquitto.config)
    observer = Observer(config)
    bridge = Bridge(config)
    settings = EdgeSettings(threads=1, state_dir=str(tmp_path / "state"), escalation_deadline_s=1.0,
                            escalation_grace_s=0.5)
    agent = EdgeAgent(settings, site=SITE, device=DEVICE, mqtt=config, model=local_model).start()
    try:
        wait_until(lambda: observer.state("birth", 1) is not None, 30, "birth")
        # Not events for this agent: another device's event on our topic, and a state message.
        bridge.send(question(1, "wrong device", device="hive-99"))
        bridge.send(DeviceState(site=SITE, device=DEVICE, status="update", online=True, session=0))
        bridge.send(question(2, "Is it swarming?", want_cloud=True))  # escalated without a draft
        bridge.send(reading(3, severity=Severity.CRITICAL, flags=("hive_temp_c_high",), hive_temp_c=40.2))
        wait_until(lambda: set(observer.answers_by_seq()) == {2, 3}, 60, "two fallback answers")
        answers = {e.body.event_seq: e.body for e in observer.answers.envs}
        assert answers[2].tier == "edge" and answers[2].status == "expired" and answers[2].action is None
        assert answers[2].escalation_reason == "operator asked for a cloud answer; no cloud answer within 1 s"
        assert answers[3].tier == "edge" and answers[3].status == "ok" and answers[3].action is not None  # the draft
        assert answers[3].escalation_reason.startswith("severity critical is critical")
        counters = agent.store.counters()
        assert counters["foreign_events"] == 1 and counters["unexpected_messages"] == 1
        assert counters["answered_fallback"] == 2 and counters["escalations_sent"] == 2
        # A late cloud reply to a resolved escalation changes nothing.
        escalation = next(e for e in observer.escalations.envs if e.body.event.seq == 2)
        late = MqttTransport(config, "late-cloud", persistent=False).start()
        late.reply(escalation, InferenceResult(request_id=escalation.body.request_id, site=SITE, device=DEVICE,
                                               tier="cloud", text="late"), timeout=5)
        late.stop()
        wait_until(lambda: agent.store.counters().get("duplicate_replies", 0) == 1, 10, "the late reply counted")
        assert observer.answers_by_seq() == collections.Counter({2: 1, 3: 1})
        state = agent._state_envelope("update").body
        assert state.counters["answered_fallback"] == 2 and state.model_version == local_model.version
    finally:
        agent.stop()
        bridge.stop()
        observer.transport.stop()


# ---------------------------------------------------------------------------- the shipped ACL broker

ACL_DEVICE = "hive-0001"  # the device's username: the ACL lets it use apiary/v1/+/hive-0001/# only


def acl_agent(acl_mosquitto: AclBroker, tmp_path: Path) -> EdgeAgent:
    settings = EdgeSettings(threads=1, state_dir=str(tmp_path / "state"), escalation_deadline_s=600.0)
    return EdgeAgent(settings, site=SITE, device=ACL_DEVICE, mqtt=acl_mosquitto.login(ACL_DEVICE),
                     model=RecordingModel()).start()


def test_a_reply_naming_another_device_is_dropped_and_counted(acl_mosquitto, tmp_path: Path) -> None:
    agent = acl_agent(acl_mosquitto, tmp_path)
    escalations, answers = Inbox(), Inbox()
    cloud = MqttTransport(acl_mosquitto.login("cloud"), "cloud-test", persistent=False)
    cloud.subscribe(topics.escalate(SITE, ACL_DEVICE), escalations)
    cloud.subscribe(topics.answer(SITE, ACL_DEVICE), answers)
    cloud.start(10)
    bridge = MqttTransport(acl_mosquitto.login("bridge"), "bridge-test", persistent=False).start(10)
    try:
        ask = question(1, "Is it swarming?", want_cloud=True, device=ACL_DEVICE)
        assert bridge.publish(topics.event(SITE, ACL_DEVICE), make(ask, sender="bridge"), timeout=10)
        (escalation,) = escalations.wait(1)
        action = {"assessment": "normal", "action": "Nothing to do", "urgency": "low", "explanation": ""}

        def reply(device: str, text: str) -> None:
            body = InferenceResult(request_id=escalation.body.request_id, site=SITE, device=device, tier="cloud",
                                   text=text, action=action)
            assert cloud.reply(escalation, body, timeout=10)

        reply("hive-0002", "for another device")  # the right correlation id, another device's answer
        reply(ACL_DEVICE, "for this device")  # after it, on the same connection
        (answer,) = answers.wait(1)
        assert answer.body.tier == "cloud" and answer.body.text == "for this device"
        counters = agent.store.counters()
        assert counters["foreign_replies"] == 1 and counters["answered_cloud"] == 1
        assert "duplicate_replies" not in counters
    finally:
        agent.stop()
        bridge.stop()
        cloud.stop()


def test_values_storage_cannot_hold_are_refused_at_decode_and_the_agent_goes_on(acl_mosquitto,
                                                                                  tmp_path: Path) -> None:
    agent = acl_agent(acl_mosquitto, tmp_path)
    escalations = Inbox()
    cloud = MqttTransport(acl_mosquitto.login("cloud"), "cloud-test", persistent=False)
    cloud.subscribe(topics.escalate(SITE, ACL_DEVICE), escalations)
    cloud.start(10)
    try:
        topic, bridge = topics.event(SITE, ACL_DEVICE), acl_mosquitto.login("bridge")
        publish_raw(bridge, topic, forged_payload(reading(1, device=ACL_DEVICE), seq=2**64 - 1))
        publish_raw(bridge, topic, forged_payload(reading(2, device=ACL_DEVICE), timestamp=float("nan")))
        publish_raw(bridge, topic, forged_payload(reading(3, device=ACL_DEVICE), readings={"hive_temp_c": float("inf")}))
        publish_raw(bridge, topic, encode(make(question(4, want_cloud=True, device=ACL_DEVICE), sender="bridge")))
        (escalation,) = escalations.wait(1)  # the valid question, handled after the three before it
        assert escalation.body.event.seq == 4
        assert agent.transport.stats["decode_errors"] == 3 and agent.transport.stats["handler_errors"] == 0
        counters = agent.store.counters()
        assert "duplicate_events" not in counters and "event_errors" not in counters
    finally:
        agent.stop()
        cloud.stop()


def test_large_valid_events_in_the_context_never_leave_an_event_without_an_answer(mosquitto, tmp_path: Path) -> None:
    """Two valid ~210 KB readings, then a normal critical one: its escalation would carry both as context
    (over the payload limit); trimmed, it reaches the cloud and the event is answered once."""
    config = fast(mosquitto.config)
    cloud = FakeCloud(config).start()
    observer = Observer(config)
    bridge = Bridge(config)
    settings = EdgeSettings(threads=1, state_dir=str(tmp_path / "state"), escalation_deadline_s=600.0)
    agent = EdgeAgent(settings, site=SITE, device=DEVICE, mqtt=config, model=RecordingModel()).start()
    try:
        big = [reading(seq, **{f"probe_{k:05d}": float(k) for k in range(10_000 + 500 * seq)}) for seq in (1, 2)]
        assert all(200_000 < len(encode(make(e, sender="bridge.test"))) < 240_000 for e in big)
        for event in big:
            bridge.send(event)
        bridge.send(reading(3, severity=Severity.CRITICAL, flags=("hive_temp_c_high",), hive_temp_c=40.5))
        (answer,) = observer.answers.wait(1, timeout=60)
        assert answer.body.event_seq == 3 and answer.body.tier == "cloud"
        (request,) = cloud.requests.values()
        assert request.event.seq == 3 and [e.seq for e in request.context] == [1]  # the largest one left out
        counters = agent.store.counters()
        assert counters["escalations_trimmed"] == 1 and counters["answered_cloud"] == 1
        assert "event_errors" not in counters and counters["routine_logged"] == 2
    finally:
        agent.stop()
        bridge.stop()
        for t in (observer.transport, cloud.transport):
            t.stop()


def test_an_unanswered_escalation_is_re_sent_on_a_timer_while_the_link_stays_up(mosquitto, tmp_path: Path) -> None:
    """Not only after a reconnect: the same envelope (same id, same request id) goes out again until answered."""
    config = fast(mosquitto.config)
    cloud = ForgetfulCloud(config).start()
    observer = Observer(config)
    bridge = Bridge(config)
    settings = EdgeSettings(threads=1, state_dir=str(tmp_path / "state"), escalation_deadline_s=600.0,
                            escalation_resend_s=0.2)
    agent = EdgeAgent(settings, site=SITE, device=DEVICE, mqtt=config, model=RecordingModel()).start()
    try:
        bridge.send(reading(1, severity=Severity.CRITICAL, flags=("hive_temp_c_high",), hive_temp_c=40.5))
        (answer,) = observer.answers.wait(1, timeout=60)
        assert answer.body.event_seq == 1 and answer.body.tier == "cloud"
        (env_id,) = cloud.arrived  # one envelope id, however often it came
        assert cloud.arrived[env_id] >= 2 and len({r.request_id for r in cloud.requests.values()}) == 1
        assert agent.transport.stats["reconnects"] == 0
        counters = agent.store.counters()
        assert counters["answered_cloud"] == 1 and counters["escalations_sent"] >= 2
        wait_until(lambda: agent.store.count() == 0, 20, "an empty outbox")
    finally:
        agent.stop()
        bridge.stop()
        for t in (observer.transport, cloud.transport):
            t.stop()
