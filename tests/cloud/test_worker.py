"""The escalation worker on the shipped ACL broker: it answers a device only where that device may be answered.

The cloud may publish anywhere (``apiary/#``); a device only under its own topics. A worker that
answered on the request's ``reply_to`` would publish for the device where the broker refuses it.
The engine here is a stand-in that answers at once: what is tested is where replies go.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Iterator

import pytest

from cloud.metrics import Metrics
from cloud.store import SqliteStore
from cloud.worker import EscalationWorker, WorkerConfig
from shared import topics
from shared.protocol import DeviceState, InferenceRequest, InferenceResult, make
from shared.transport import MqttTransport
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
