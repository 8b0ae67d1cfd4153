"""Three `apiary cloud serve` replicas on one Mosquitto and one PostgreSQL (issue 19), end to end.

Escalations spread over the `$share` group land in the database exactly once; fleet state and events
recorded by all three recorders are stored once; any replica answers any REST call; and a replica
killed with `kill -9` under load leaves no escalation unanswered (the edge re-sends; a survivor takes
the dead replica's claim over once its lease ends) and none computed twice.
"""
from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from apiary.cloud.auth import KeyRing
from apiary.cloud.db import migrate
from apiary.cloud.store import open_store
from apiary.shared import topics
from apiary.shared.protocol import DeviceState, InferenceRequest, SensorEvent, make
from apiary.shared.transport import MqttTransport
from tests.shared.helpers import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
SITE = "field"
LEASE_S = 4.0


class Replica:
    """One `apiary cloud serve` process with its own worker id (its own broker session) on the shared database."""

    def __init__(self, name: str, db: str, broker: str, directory: Path, model: Path, keys: Path) -> None:
        self.name, self.log = name, directory / f"{name}.log"
        self.cmd = [sys.executable, "-c", "from apiary.cli import app; app()", "cloud", "serve", "--port", "0",
                    "--model", str(model), "--broker", broker, "--db", db, "--worker-id", name,
                    "--api-key-file", str(keys), "--images", str(directory / "images"), "--dtype", "float32"]
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> "Replica":
        env = {**os.environ, "APIARY__CLOUD__KV_CACHE_MB": "64", "APIARY__CLOUD__CLAIM_LEASE_S": str(LEASE_S),
               "APIARY__CLOUD__NUM_THREADS": "1", "APIARY_LOG_FORMAT": "text", "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=open(self.log, "ab"),
                                     stderr=subprocess.STDOUT)
        return self

    def wait_up(self) -> None:
        def listening() -> str | None:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            found = re.search(r"listening on (http://\S+)", self.log.read_text())
            return found.group(1) if found else None

        wait_until(lambda: listening() is not None, 240, f"{self.name} up")
        self.url = listening()

    def computed(self) -> float:
        """Escalations this process computed to an "ok" answer (its Prometheus counter)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        found = re.search(r'^apiary_escalations_total\{outcome="ok"\} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class Edge:
    """Sends escalations like the edge agent does (reply-to, correlation) and re-sends the unanswered ones."""

    def __init__(self, config) -> None:
        self.replies: dict[str, list[str]] = collections.defaultdict(list)
        self.requests: dict[str, InferenceRequest] = {}
        self._lock = threading.Lock()
        self.transport = MqttTransport(config, "test-edge", persistent=False)
        self.transport.subscribe(topics.all_of("reply", SITE), self._reply)
        self.transport.start(10)
        assert self.transport.wait_subscribed(10)

    def _reply(self, topic: str, env) -> None:
        with self._lock:
            self.replies[env.body.request_id].append(env.body.text if env.body.status == "ok" else env.body.status)

    def send(self, req: InferenceRequest) -> None:
        self.requests[req.request_id] = req
        env = make(req, sender=req.device, reply_to=topics.reply(SITE, req.device))  # a new envelope each time
        assert self.transport.publish(topics.escalate(SITE, req.device), env, timeout=10)

    def unanswered(self) -> list[str]:
        with self._lock:
            return [r for r in self.requests if not self.replies.get(r)]

    def resend_until_answered(self, every_s: float, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.unanswered():
            assert time.monotonic() < deadline, f"unanswered after {timeout}s: {self.unanswered()}"
            time.sleep(every_s)
            for rid in self.unanswered():
                self.send(self.requests[rid])

    def publish(self, topic: str, body) -> None:
        assert self.transport.publish(topic, make(body, sender=body.device), timeout=10)


@pytest.fixture
def fleet(postgres, mosquitto, tmp_path: Path, gguf_path: Path):
    url = postgres.create_database()
    migrate.upgrade(url)  # PostgreSQL is migrated on purpose, once, before the replicas start
    keys = KeyRing(tmp_path / "keys.jsonl")
    key = keys.create(["inference", "operator"], name="ops")
    replicas = [Replica(f"cloud-r{i}", url, mosquitto.config.url, tmp_path, gguf_path, keys.path)
                for i in range(1, 4)]
    edge = None
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_up()
        edge = Edge(mosquitto.config)
        yield url, replicas, edge, key
    finally:
        if edge is not None:
            edge.transport.stop()
        for r in replicas:
            r.close()


def rows(url: str) -> list[dict]:
    store = open_store(url)
    try:
        return store.escalations(limit=10_000)
    finally:
        store.close()


def test_three_replicas_share_the_work_and_survive_a_kill_9(fleet) -> None:
    url, (r1, r2, r3), edge, key = fleet
    auth = {"Authorization": f"Bearer {key}"}

    # fleet state and an event, recorded by all three recorders, stored once, shown by every replica
    edge.publish(topics.state(SITE, "hive-0"), DeviceState(site=SITE, device="hive-0", status="birth", online=True,
                                                           session=7, battery_soc=0.8))
    edge.publish(topics.event(SITE, "hive-0"), SensorEvent(site=SITE, device="hive-0", seq=1, timestamp=1.0,
                                                           readings={"hive_temp_c": 35.0}))
    for r in (r1, r2, r3):
        wait_until(lambda r=r: len(httpx.get(f"{r.url}/v1/fleet/devices/{SITE}/hive-0/events", headers=auth,
                                             timeout=30).json()) == 1, 60, f"the event via {r.name}")
        (dev,) = [d for d in httpx.get(f"{r.url}/v1/fleet/devices", headers=auth, timeout=30).json()
                  if d["device"] == "hive-0"]
        assert dev["session"] == 7 and dev["battery_soc"] == 0.8

    # load: escalations spread over the $share group; r2 is killed while it computes some of them
    n = 18
    for i in range(n):
        edge.send(InferenceRequest(request_id=f"req-{i}", site=SITE, device=f"hive-{i % 3}",
                                   prompt=f"Hive {i}: the colony is loud at dusk. What should the keeper check?",
                                   max_tokens=24, temperature=0.0, response_format="text", priority=5))
    wait_until(lambda: any(row["worker"] == r2.name and row["state"] == "pending" for row in rows(url)), 120,
               "the second replica computing")
    r2.proc.send_signal(signal.SIGKILL)
    r2.proc.wait(10)
    orphaned = {row["request_id"] for row in rows(url) if row["worker"] == r2.name and row["state"] == "pending"}
    assert orphaned
    edge.resend_until_answered(every_s=3.0, timeout=300)

    # every escalation answered, stored once, computed once
    final = rows(url)
    assert sorted(row["request_id"] for row in final) == sorted(f"req-{i}" for i in range(n))
    assert {row["state"] for row in final} == {"done"} and {row["outcome"] for row in final} == {"ok"}
    for rid, texts in edge.replies.items():
        assert len(set(texts)) == 1, (rid, texts)  # repeats carry the stored answer, never a second computation
    by_worker = collections.Counter(row["worker"] for row in final)
    assert by_worker[r1.name] and by_worker[r3.name], by_worker  # spread over the group
    assert all(row["worker"] != r2.name for row in final if row["request_id"] in orphaned)  # taken over
    assert r1.computed() + r3.computed() == by_worker[r1.name] + by_worker[r3.name]  # nobody computed one twice

    # any replica answers any REST call: the same escalations from each survivor, inference on each
    for r in (r1, r3):
        listed = httpx.get(f"{r.url}/v1/fleet/escalations", params={"limit": 100}, headers=auth, timeout=30).json()
        assert sorted(e["request_id"] for e in listed) == sorted(row["request_id"] for row in final)
        model = httpx.get(f"{r.url}/v1/models", headers=auth, timeout=30).json()["data"][0]["id"]
        answer = httpx.post(f"{r.url}/v1/chat/completions", headers=auth, timeout=120, json={
            "model": model, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Why do bees fan?"}]})
        assert answer.status_code == 200, answer.text
