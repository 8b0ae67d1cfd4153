"""Escalation workers and the fleet recorder on a real Mosquitto, with the real engine."""
from __future__ import annotations

import json
import math
import threading
import time
from collections import defaultdict

import httpx
import pytest

from apiary.shared import topics
from apiary.shared.protocol import (Action, DeviceState, InferenceRequest, InferenceResult, OtaCommand, OtaStatus,
                             SensorEvent, Severity, make)
from apiary.shared.transport import MqttTransport

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


class Edge:
    """A stand-in edge fleet: publishes escalations and collects every reply per request id."""

    def __init__(self, config, client_id: str = "edge-test") -> None:
        self.t = MqttTransport(config, client_id, persistent=False)
        self.replies: dict[str, list] = defaultdict(list)
        self.lock = threading.Condition()
        self.t.subscribe(topics.all_of("reply"), self._on_reply)
        self.t.start()

    def _on_reply(self, topic: str, env) -> None:
        with self.lock:
            self.replies[env.body.request_id].append(env)
            self.lock.notify_all()

    def escalate(self, req: InferenceRequest, envelope_id: str | None = None) -> None:
        env = make(req, sender=f"edge-{req.device}", reply_to=topics.reply(req.site, req.device),
                   correlation_id=req.request_id, id=envelope_id)
        self.t.publish(topics.escalate(req.site, req.device), env, timeout=5)

    def wait(self, request_ids, count: int = 1, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        with self.lock:
            while not all(len(self.replies[r]) >= count for r in request_ids):
                left = deadline - time.monotonic()
                assert left > 0, {r: len(self.replies[r]) for r in request_ids}
                self.lock.wait(left)


def request(i: int, **kw) -> InferenceRequest:
    fields = dict(request_id=f"req-{i}", site="meadow", device=f"hive-{i % 3}", prompt=f"Bees, count to {i}:",
                  max_tokens=3, temperature=0.0, response_format="text", priority=6)
    fields.update(kw)
    return InferenceRequest(**fields)


def test_two_workers_share_escalations_exactly_once(mosquitto, make_service, idle_engine):
    """Two `cloud serve` workers on one broker: every escalation answered exactly once, none lost."""
    a = make_service(broker=mosquitto.config.url, worker_id="cloud-a", record=False)
    b = make_service(broker=mosquitto.config.url, worker_id="cloud-b", record=False)
    edge = Edge(mosquitto.config)
    try:
        n = 16
        for i in range(n):
            edge.escalate(request(i))
        ids = [f"req-{i}" for i in range(n)]
        edge.wait(ids)
        time.sleep(0.5)  # a duplicate would arrive right behind the first answer
        assert all(len(edge.replies[r]) == 1 for r in ids), {r: len(edge.replies[r]) for r in ids}
        results = [edge.replies[r][0].body for r in ids]
        assert all(isinstance(x, InferenceResult) and x.tier == "cloud" for x in results)
        assert [x.status for x in results] == ["ok"] * n, [x.error for x in results]
        assert all(x.completion_tokens >= 1 and x.text for x in results)
        assert all(edge.replies[r][0].correlation_id == r for r in ids)
        computed = (a.worker.stats["computed"], b.worker.stats["computed"])
        assert sum(computed) == n and min(computed) > 0, computed  # the broker split the load

        # The edge re-sends req-3 (store-and-forward retry, new envelope): the stored answer comes back.
        edge.escalate(request(3))
        edge.wait(["req-3"], count=2)
        assert edge.replies["req-3"][1].body.text == edge.replies["req-3"][0].body.text
        assert (a.worker.stats["computed"], b.worker.stats["computed"]) == computed

        # Deadline already passed: answered "expired" without computing.
        edge.escalate(request(99, deadline=time.time() - 5))
        edge.wait(["req-99"])
        expired = edge.replies["req-99"][0].body
        assert expired.status == "expired" and "deadline" in expired.error
        assert (a.worker.stats["computed"], b.worker.stats["computed"]) == computed

        rows = a.store.escalations(limit=100)
        assert len(rows) == n + 1 and {r["outcome"] for r in rows} == {"ok", "expired"}
        assert all(r["latency_ms"] > 0 for r in rows)
        assert {r["worker"] for r in rows} == {"cloud-a", "cloud-b"}
    finally:
        edge.t.stop()


def test_worker_restart_answers_from_the_store(mosquitto, make_service, idle_engine):
    """A result stored by one worker is re-sent by another process that never computed it."""
    # cloud-1 is retired for good, so without a persistent session: the broker would hold its share of the
    # shared subscription's messages for it until its session expires
    first = make_service(broker=mosquitto.config.url, worker_id="cloud-1", record=False, persistent_session=False)
    edge = Edge(mosquitto.config)
    try:
        edge.escalate(request(1), envelope_id="env-fixed-1")
        edge.wait(["req-1"])
        first.stop()
        second = make_service(broker=mosquitto.config.url, worker_id="cloud-2", record=False)
        edge.escalate(request(1), envelope_id="env-fixed-1")  # same envelope, new worker process
        edge.wait(["req-1"], count=2)
        assert second.worker.stats["computed"] == 0 and second.worker.stats["cached"] == 1
        assert edge.replies["req-1"][1].body == edge.replies["req-1"][0].body
    finally:
        edge.t.stop()


def test_json_action_answers_with_the_schema_and_a_confidence(mosquitto, make_service, idle_engine):
    """json_action: one request decoded under the action's JSON Schema; the reply carries the confidence
    scored by the edge's rule, and a re-sent request gets the stored answer with it."""
    from apiary.shared.prompting import ACTION_FIELDS, SYSTEM_PROMPT

    service = make_service(broker=mosquitto.config.url, worker_id="cloud-json", record=False)
    edge = Edge(mosquitto.config)
    try:
        def escalation(request_id: str, user: str, **kw) -> InferenceRequest:
            fields = dict(request_id=request_id, site="meadow", device="hive-7", max_tokens=128, priority=0,
                          messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}])
            return InferenceRequest(**{**fields, **kw})

        def ask(request_id: str, user: str, **kw) -> InferenceResult:
            edge.escalate(escalation(request_id, user, **kw), envelope_id=f"env-{request_id}")
            edge.wait([request_id])
            return edge.replies[request_id][0].body

        too_hot = "The hive is at 42 C, far too hot. Assessment: heat_stress."
        hot = ask("hot", too_hot, reason="low confidence")
        assert hot.status == "ok", hot.error
        action = Action.model_validate(hot.action)
        assert action.assessment == "heat_stress" and action.action and action.urgency in ("low", "medium", "high")
        assert tuple(json.loads(hot.text)) == ACTION_FIELDS  # the schema's order: explanation first
        assert hot.escalation_reason == "low confidence" and hot.prompt_tokens > 100 and hot.completion_tokens > 3
        assert hot.confidence is not None and math.isfinite(hot.confidence) and hot.confidence <= 0.0
        assert hot.logprob_quantiles["p10"] == pytest.approx(hot.confidence, abs=1e-4)

        # Re-sent (same envelope): the stored answer, confidence and all, without computing again.
        computed = service.worker.stats["computed"]
        edge.escalate(escalation("hot", too_hot, reason="low confidence"), envelope_id="env-hot")
        edge.wait(["hot"], count=2)
        assert edge.replies["hot"][1].body == hot and service.worker.stats["computed"] == computed

        # A bare sensor event (no messages): the worker builds the shared prompt itself.
        event = SensorEvent(site="meadow", device="hive-7", seq=42, timestamp=time.time(), severity=Severity.CRITICAL,
                            readings={"hive_temp_c": 41.5, "ambient_temp_c": 36.0, "battery_v": 3.9},
                            flags=["hive_temp_high"])
        edge.escalate(InferenceRequest(request_id="evt-42", site="meadow", device="hive-7", event=event, max_tokens=128))
        edge.wait(["evt-42"])
        result = edge.replies["evt-42"][0].body
        assert result.event_seq == 42 and result.prompt_tokens > 500  # the shared prompt with its worked examples
        assert result.status == "ok", result.error
        Action.model_validate(result.action)
        assert result.confidence is not None and result.confidence <= 0.0

        # Too few tokens for the JSON: an error that says so, not a crash.
        short = ask("short", "The hive is at 42 C.", max_tokens=5)
        assert short.status == "error" and short.action is None and "cut off at max_tokens=5" in short.error
    finally:
        edge.t.stop()


def test_recorder_fleet_api_and_ota(mosquitto, make_service, keys, tmp_path):
    service = make_service(broker=mosquitto.config.url, worker_id="cloud-rec", escalations=False)
    operator = keys.create(["operator"])
    dev = MqttTransport(mosquitto.config, "hive-1-agent", persistent=False)
    commands: list = []
    dev.subscribe(topics.ota_command("meadow", "hive-1"), lambda topic, env: commands.append(env))
    dev.start()
    http = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {operator}"}, timeout=30)

    def publish(topic, body):
        assert dev.publish(topic, make(body, sender="hive-1-agent"), retain=isinstance(body, DeviceState), timeout=5)

    def fleet():
        return {(d["site"], d["device"]): d for d in http.get("/v1/fleet/devices").json()}

    def until(predicate, timeout=15.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.05)
        raise AssertionError("not recorded in time")

    try:
        state = dict(site="meadow", device="hive-1", model_version="smollm2-q4-v3", image_version="1.1.0")
        publish(topics.state("meadow", "hive-1"), DeviceState(status="birth", online=True, session=2,
                                                              battery_soc=0.8, **state))
        until(lambda: fleet().get(("meadow", "hive-1"), {}).get("online"))
        # a stale Last Will (session 1) arriving after the session-2 birth must not mark the device offline
        publish(topics.state("meadow", "hive-1"), DeviceState(status="death", online=False, session=1, **state))
        publish(topics.state("meadow", "hive-1"), DeviceState(status="update", online=True, session=2,
                                                              battery_soc=0.55, **state))
        until(lambda: fleet()[("meadow", "hive-1")]["battery_soc"] == 0.55)
        d = fleet()[("meadow", "hive-1")]
        assert d["online"] and d["session"] == 2 and d["model_version"] == "smollm2-q4-v3"
        assert fleet()[("_cloud", "cloud-rec")]["role"] == "cloud"  # the worker's own birth certificate

        for seq in range(3):
            publish(topics.event("meadow", "hive-1"), SensorEvent(site="meadow", device="hive-1", seq=seq,
                                                                  timestamp=time.time(), readings={"hive_temp_c": 35.0 + seq}))
        publish(topics.answer("meadow", "hive-1"), InferenceResult(request_id="r-1", site="meadow", device="hive-1",
                                                                   tier="edge", text="ok", event_seq=2, latency_ms=80.0))
        publish(topics.ota_status("meadow", "hive-1"), OtaStatus(site="meadow", device="hive-1", image_version="1.2.0",
                                                                 phase="downloading", progress=0.5))
        until(lambda: len(http.get("/v1/fleet/devices/meadow/hive-1/events").json()) == 3)
        events = http.get("/v1/fleet/devices/meadow/hive-1/events", params={"limit": 2}).json()
        assert [e["seq"] for e in events] == [2, 1]
        until(lambda: http.get("/v1/fleet/devices/meadow/hive-1/answers").json())
        answer = http.get("/v1/fleet/devices/meadow/hive-1/answers").json()[0]
        assert answer["request_id"] == "r-1" and answer["tier"] == "edge"
        until(lambda: (fleet()[("meadow", "hive-1")]["last_ota"] or {}).get("phase") == "downloading")

        publish(topics.state("meadow", "hive-1"), DeviceState(status="death", online=False, session=2, **state))
        until(lambda: not fleet()[("meadow", "hive-1")]["online"])

        # OTA to the whole site: one command per known device, URL on our images endpoint
        images = tmp_path / "images"
        images.mkdir(exist_ok=True)
        (images / "edge-1.2.0.img").write_bytes(b"\x01" * 5000)
        body = {"site": "meadow", "image_version": "1.2.0", "filename": "edge-1.2.0.img", "sha256": "a" * 64,
                "signature": "b" * 128, "size": 5000}
        r = http.post("/v1/fleet/ota", json=body)
        assert r.status_code == 200, r.text
        assert [(t["device"], t["acked"]) for t in r.json()["targets"]] == [("hive-1", True)]
        until(lambda: commands)
        cmd = commands[0].body
        assert isinstance(cmd, OtaCommand) and cmd.image_version == "1.2.0" and cmd.size == 5000
        assert cmd.url == f"{service.url}/v1/images/edge-1.2.0.img"
        assert httpx.get(cmd.url, headers={"Range": "bytes=0-99"}).status_code == 206
        assert http.post("/v1/fleet/ota", json={**body, "size": 1}).status_code == 422
        assert http.post("/v1/fleet/ota", json={**body, "filename": "nope.img"}).status_code == 404
        assert http.post("/v1/fleet/ota", json={**body, "site": "empty-site"}).status_code == 404
    finally:
        http.close()
        dev.stop()
