"""The escalation worker on the shipped ACL broker: it answers a device only where that device may be answered.

The cloud may publish anywhere (``apiary/#``); a device only under its own topics. A worker that
answered on the request's ``reply_to`` would publish for the device where the broker refuses it.
The engine here is a stand-in that answers at once: what is tested is where replies go.
"""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Iterator

import pytest

from apiary.cloud.metrics import Metrics
from apiary.cloud.store import SqliteStore
from apiary.cloud.worker import EscalationWorker, WorkerConfig
from apiary.shared import topics
from apiary.shared.protocol import DeviceState, InferenceRequest, InferenceResult, encode, make
from apiary.shared.transport import MqttTransport
from tests.shared.helpers import AclBroker, Inbox, wait_until

pytestmark = pytest.mark.timeout(120)

SITE, WORKER = "s1", "cloud-w1"


class InstantEngine:
    """Answers every text request with "ok" at once, as the worker's engine would (no model)."""

    prompt_style = "examples"

    async def generate(self, prompt=None, messages=None, params=None, priority: int = 6) -> SimpleNamespace:
        return SimpleNamespace(text="ok", prompt_token_ids=[1, 2], output_token_ids=[3])


@pytest.fixture
def cloud(acl_mosquitto: AclBroker, tmp_path) -> Iterator[EscalationWorker]:
    """A worker as ``cloud serve`` runs it: the cloud's login, the shared subscription, a store."""
    store = SqliteStore(tmp_path / "cloud.db")
    worker = EscalationWorker(InstantEngine(), store, WorkerConfig(worker_id=WORKER, model_name="instant"), Metrics())
    transport = MqttTransport(acl_mosquitto.login("cloud"), WORKER, persistent=False)
    worker.start(transport)
    transport.start(10)
    yield worker
    worker.stop()
    transport.stop(flush_timeout=0)
    store.close()


def escalation(request_id: str, device: str = "hive-0001") -> InferenceRequest:
    return InferenceRequest(request_id=request_id, site=SITE, device=device, prompt="Is the hive loud?",
                            max_tokens=4, response_format="text")


def test_replies_go_only_to_the_escalating_devices_reply_topic(acl_mosquitto, cloud) -> None:
    seen = Inbox()  # everything on the mesh, to catch a reply published anywhere else
    watcher = MqttTransport(acl_mosquitto.login("cloud"), "watcher", persistent=False)
    watcher.subscribe("apiary/#", seen)
    watcher.start(10)
    replies = Inbox()
    hive1 = MqttTransport(acl_mosquitto.login("hive-0001"), "hive-0001", persistent=False)
    hive1.subscribe(topics.reply(SITE, "hive-0001"), replies)
    hive1.start(10)
    own_reply = topics.reply(SITE, "hive-0001")
    forged = [topics.reply(SITE, "hive-0002"), topics.event(SITE, "hive-0002"), topics.ota_command(SITE, "hive-0002"),
              topics.answer("s2", "hive-0002"), topics.state(topics.CLOUD_SITE, WORKER),
              f"apiary/v1/{SITE}/+/reply", "apiary/#"]
    try:
        def ask(req: InferenceRequest, reply_to: str) -> None:
            env = make(req, sender="hive-0001", reply_to=reply_to, correlation_id=req.request_id)
            assert hive1.publish(topics.escalate(SITE, "hive-0001"), env, timeout=10)

        for i, reply_to in enumerate(forged):
            ask(escalation(f"forged-{i}"), reply_to)
        ask(escalation("as-hive-0002", device="hive-0002"), topics.reply(SITE, "hive-0002"))  # body names another
        ask(escalation("honest"), own_reply)

        got = {e.correlation_id: e.body for e in replies.wait(len(forged) + 1)}
        assert set(got) == {f"forged-{i}" for i in range(len(forged))} | {"honest"}
        assert got["honest"].status == "ok" and got["honest"].text == "ok"
        for i, reply_to in enumerate(forged):
            refusal = got[f"forged-{i}"]
            assert isinstance(refusal, InferenceResult) and refusal.status == "rejected" and refusal.tier == "cloud"
            assert refusal.device == "hive-0001" and f"reply_to {reply_to!r} refused" in refusal.error
        assert cloud.stats["reply_to_refused"] == len(forged) and cloud.stats["identity_mismatch"] == 1
        assert cloud.stats["computed"] == 1
        assert [r["request_id"] for r in cloud.store.escalations()] == ["honest"]  # nothing refused was claimed

        # A last message from the worker's own connection: once the watcher has it, it has everything before it.
        fence = make(DeviceState(site=topics.CLOUD_SITE, device=WORKER, status="update", online=True, session=1),
                     sender=WORKER)
        assert cloud.transport.publish(topics.state(topics.CLOUD_SITE, WORKER), fence, timeout=10)
        wait_until(lambda: any(e.id == fence.id for e in seen.envs), what="the fence")
        from_worker = {topic for topic, env in seen.items if env.sender == WORKER and env.id != fence.id}
        assert from_worker == {own_reply}
    finally:
        hive1.stop(flush_timeout=0)
        watcher.stop(flush_timeout=0)


class HeldEngine(InstantEngine):
    """Answers only once ``release`` is set: a request stays in flight as long as a test needs."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    async def generate(self, prompt=None, messages=None, params=None, priority: int = 6) -> SimpleNamespace:
        self.calls += 1
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        return await super().generate(prompt, messages, params, priority)


def test_a_restarted_worker_resumes_the_claims_its_predecessor_left_unfinished(acl_mosquitto, tmp_path) -> None:
    """The claim is durable before computing starts and keeps the request: a worker killed mid-request is
    answered for by the next process with its id, without waiting for any re-send."""
    store = SqliteStore(tmp_path / "cloud.db")
    topic = topics.escalate(SITE, "hive-0001")
    env = make(escalation("left-behind"), sender="hive-0001", reply_to=topics.reply(SITE, "hive-0001"),
               correlation_id="left-behind")
    assert store.claim_escalation(env.id, request_id="left-behind", site=SITE, device="hive-0001", priority=6,
                                  reason="", worker=WORKER, lease_s=60.0, topic=topic,
                                  envelope=encode(env)).state == "claimed"  # then kill -9
    replies = Inbox()
    hive1 = MqttTransport(acl_mosquitto.login("hive-0001"), "hive-0001", persistent=False)
    hive1.subscribe(topics.reply(SITE, "hive-0001"), replies)
    hive1.start(10)
    worker = EscalationWorker(InstantEngine(), store, WorkerConfig(worker_id=WORKER, model_name="instant"), Metrics())
    transport = MqttTransport(acl_mosquitto.login("cloud"), WORKER, persistent=True)
    worker.start(transport)
    transport.start(10)
    try:
        (reply,) = replies.wait(1)
        assert reply.correlation_id == "left-behind" and reply.body.status == "ok" and reply.body.text == "ok"
        assert worker.stats["resumed"] == 1 and worker.stats["computed"] == 1
        wait_until(lambda: store.unfinished_escalations(WORKER) == [], what="the claim finished")
        assert store.escalations()[0]["outcome"] == "ok"
    finally:
        worker.stop()
        transport.stop(flush_timeout=0)
        hive1.stop(flush_timeout=0)
        store.close()


def test_a_worker_keeps_its_claim_while_computing_so_a_repeat_is_not_run_twice(acl_mosquitto, tmp_path) -> None:
    """Past claim_lease_s the computing worker still holds the claim (it renews it): a re-send reaching another
    worker then is left to it, not computed a second time."""
    store = SqliteStore(tmp_path / "cloud.db")
    engine = HeldEngine()
    first = EscalationWorker(engine, store, WorkerConfig(worker_id="cloud-a", model_name="held",
                                                         claim_lease_s=0.3), Metrics())
    other = EscalationWorker(InstantEngine(), store, WorkerConfig(worker_id="cloud-b", model_name="instant",
                                                                  claim_lease_s=0.3), Metrics())
    transports = [MqttTransport(acl_mosquitto.login("cloud"), w.config.worker_id, persistent=False)
                  for w in (first, other)]
    for worker, transport in zip((first, other), transports):
        worker.start(transport)
        transport.start(10)
    topic = topics.escalate(SITE, "hive-0001")
    env = make(escalation("long"), sender="hive-0001", reply_to=topics.reply(SITE, "hive-0001"))
    try:
        first.on_message(topic, env)
        wait_until(lambda: engine.calls == 1, what="the first worker computing")
        claimed = store.escalations()[0]
        wait_until(lambda: store._query("SELECT claimed_at FROM escalations")[0][0] > claimed["received_at"] + 0.3,
                   what="the lease renewed past claim_lease_s")
        other.on_message(topic, env)  # the edge's re-send, handed by the broker to another worker
        wait_until(lambda: other.stats["busy"] == 1, what="the other worker leaving it alone")
        engine.release.set()
        wait_until(lambda: first.stats["computed"] == 1, what="the answer")
        assert other.stats["computed"] == 0 and engine.calls == 1
    finally:
        for worker, transport in zip((first, other), transports):
            worker.stop()
            transport.stop(flush_timeout=0)
        store.close()
