"""backend = "openai": escalations answered by an OpenAI-compatible upstream, over a real Mosquitto.

The upstreams are real servers: our own REST API (a CloudService on the shared engine, as the other
cloud tests run it) and llama.cpp's own ``llama-server`` built from llama-cpp-python's vendored
sources (deploy/build_llama_server.sh), serving the shipped student GGUF.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from apiary.cloud.actions import generate_action
from apiary.cloud.service import CloudService
from apiary.cloud.settings import CloudSettings
from apiary.cloud.upstream import UpstreamClient, UpstreamConfig
from apiary.shared import assets
from apiary.shared.prompting import ACTION_JSON_SCHEMA, build_messages
from apiary.shared.protocol import Action, InferenceRequest, SensorEvent, Severity
from tests.cloud.conftest import MODEL_NAME
from tests.cloud.test_mqtt import Edge
from tests.shared.helpers import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


class BodyRecorder:
    """ASGI middleware in front of the upstream: keeps the JSON body of every chat completion it is sent."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.bodies: list[dict[str, Any]] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") != "/v1/chat/completions":
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        self.bodies.append(json.loads(b"".join(chunks)))
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hot_event(seq: int, device: str = "hive-1") -> SensorEvent:
    return SensorEvent(site="meadow", device=device, seq=seq, timestamp=time.time(), severity=Severity.CRITICAL,
                       readings={"hive_temp_c": 41.5, "ambient_temp_c": 36.0, "battery_v": 3.9},
                       flags=["hive_temp_c_high", "ambient_temp_c_high"])


def escalation(request_id: str, seq: int, priority: int = 6, **kw: Any) -> InferenceRequest:
    return InferenceRequest(request_id=request_id, site="meadow", device="hive-1", event=hot_event(seq),
                            max_tokens=96, priority=priority, reason="critical", **kw)


@pytest.fixture
def upstream_key(keys, tmp_path: Path) -> Path:
    """A file holding an inference key of the upstream (our API): how an operator gives the worker its key."""
    path = tmp_path / "upstream.key"
    path.write_text(keys.create(["inference"]) + "\n")
    return path


@pytest.fixture
def openai_cloud(tmp_path: Path) -> Iterator[Any]:
    """Start CloudServices with backend = "openai" (no engine of their own); stopped afterwards."""
    services: list[CloudService] = []

    def make(**fields: Any) -> CloudService:
        base = dict(port=0, db=str(tmp_path / "openai-cloud.db"), api_key_file=str(tmp_path / "openai-keys.jsonl"),
                    generate_key="never", images=str(tmp_path / "images"), backend="openai",
                    worker_id="cloud-openai", record=False, upstream_probe_s=0.2)
        service = CloudService(CloudSettings(**{**base, **fields}))
        services.append(service)
        service.start()
        return service

    yield make
    for service in reversed(services):
        service.stop()


def test_settings_need_an_upstream_and_never_hold_its_key() -> None:
    with pytest.raises(ValueError, match="needs upstream_url"):
        CloudSettings(backend="openai", upstream_model="m")
    with pytest.raises(ValueError, match="needs upstream_model"):
        CloudSettings(backend="openai", upstream_url="http://127.0.0.1:1/v1")
    with pytest.raises(ValueError, match="upstream_key"):
        CloudSettings(backend="openai", upstream_url="http://x/v1", upstream_model="m", upstream_key="secret")
    with pytest.raises(ValueError, match="not both"):
        CloudSettings(backend="openai", upstream_url="http://x/v1", upstream_model="m", upstream_key_file="k",
                      upstream_key_env="K")


def test_upstream_key_missing_is_a_clear_start_error(tmp_path) -> None:
    from apiary.cloud.errors import CloudError

    service = CloudService(CloudSettings(port=0, db=str(tmp_path / "c.db"), api_key_file=str(tmp_path / "k.jsonl"),
                                         generate_key="never", backend="openai", upstream_url="http://127.0.0.1:1/v1",
                                         upstream_model="m", upstream_key_env="APIARY_TEST_NO_SUCH_KEY"))
    with pytest.raises(CloudError, match=r"\$APIARY_TEST_NO_SUCH_KEY is not set"):
        service.start()


def test_our_api_as_upstream_gives_the_engines_answer_and_confidence(make_service, cloud_engine, upstream_key):
    """The same messages through the engine path and through our REST API as the upstream: the same action
    and the same confidence, scored by one rule from the API's logprobs."""
    upstream = make_service()
    messages = [m.model_dump() for m in build_messages(hot_event(1), style=cloud_engine.prompt_style)]
    client = UpstreamClient(UpstreamConfig(url=f"{upstream.url}/v1", model=MODEL_NAME,
                                           key=upstream_key.read_text().strip()))

    async def both() -> tuple[Any, Any]:
        try:
            local = await generate_action(cloud_engine, messages=messages, max_tokens=96, priority=3)
            remote = await client.answer(messages, action=True, max_tokens=96, priority=3)
            return local, remote
        finally:
            await client.aclose()

    local, remote = asyncio.run(both())
    assert remote.error is None and local.error is None, (remote.error, local.error)
    assert remote.text == local.text and remote.action == local.action
    assert (remote.prompt_tokens, remote.completion_tokens) == (local.prompt_tokens, local.completion_tokens)
    assert remote.confidence is not None and local.confidence is not None
    assert remote.confidence.n_tokens == local.confidence.n_tokens > 0
    assert remote.score == pytest.approx(local.score, abs=1e-3)
    assert remote.confidence.entropy == pytest.approx(local.confidence.entropy, abs=1e-3)
    assert client.probe() is None


def test_escalations_over_mqtt_are_answered_through_our_api(mosquitto, make_service, openai_cloud, upstream_key,
                                                            idle_engine):
    """A worker with backend = "openai" answers edge escalations through our own REST API: the JSON Schema,
    greedy decoding, logprobs and each escalation's priority reach the upstream; the answers carry the action,
    its confidence and which backend answered, and are stored like the engine's."""
    upstream = make_service()
    recorder = BodyRecorder(upstream.gate.app)
    upstream.gate.app = recorder
    cloud = openai_cloud(broker=mosquitto.config.url, upstream_url=f"{upstream.url}/v1", upstream_model=MODEL_NAME,
                         upstream_key_file=str(upstream_key))
    wait_until(lambda: httpx.get(f"{cloud.url}/ready").status_code == 200, what="the openai cloud ready")
    edge = Edge(mosquitto.config)
    try:
        edge.escalate(escalation("urgent", 1, priority=1))
        edge.escalate(escalation("routine", 2, priority=8))
        edge.wait(["urgent", "routine"])
        for rid in ("urgent", "routine"):
            (reply,) = edge.replies[rid]
            result = reply.body
            assert result.status == "ok", result.error
            Action.model_validate(result.action)
            assert result.tier == "cloud" and result.model == f"openai:{MODEL_NAME}"
            assert result.confidence is not None and math.isfinite(result.confidence) and result.confidence <= 0
            assert result.prompt_tokens > 100 and result.completion_tokens > 3
        assert sorted(b["priority"] for b in recorder.bodies) == [1, 8]
        for body in recorder.bodies:
            assert body["model"] == MODEL_NAME and body["temperature"] == 0.0 and body["max_tokens"] == 96
            assert body["response_format"]["type"] == "json_schema"
            assert body["response_format"]["json_schema"]["schema"] == ACTION_JSON_SCHEMA
            assert body["logprobs"] is True and body["top_logprobs"] == 20
        stored = {r["request_id"]: r for r in cloud.store.escalations()}
        assert {rid: stored[rid]["outcome"] for rid in ("urgent", "routine")} == {"urgent": "ok", "routine": "ok"}
        # The REST inference routes of a process without a model name the upstream instead of failing.
        r = httpx.post(f"{cloud.url}/v1/chat/completions", json={"messages": []})
        assert r.status_code == 404 and upstream.url in r.json()["error"]["message"]
    finally:
        edge.t.stop()


def test_upstream_down_escalations_wait_and_are_answered_once_when_it_is_back(mosquitto, make_service, openai_cloud,
                                                                             upstream_key, idle_engine):
    """While the upstream is down the worker retries (nothing is answered, /ready says why); once it is back every
    escalation is answered exactly once."""
    port = free_port()
    cloud = openai_cloud(broker=mosquitto.config.url, upstream_url=f"http://127.0.0.1:{port}/v1",
                         upstream_model=MODEL_NAME, upstream_key_file=str(upstream_key))
    ready = httpx.get(f"{cloud.url}/ready")
    assert ready.status_code == 503 and "does not answer" in " ".join(ready.json()["reasons"])
    edge = Edge(mosquitto.config)
    ids = [f"down-{i}" for i in range(3)]
    try:
        for i, rid in enumerate(ids):
            edge.escalate(escalation(rid, 10 + i))
        client = cloud.engine
        wait_until(lambda: client.stats["retries"] >= 6, what="the worker retrying the upstream")
        assert not any(edge.replies[rid] for rid in ids) and cloud.worker.stats["computed"] == 0
        make_service(port=port)  # the upstream comes back on its address
        wait_until(lambda: httpx.get(f"{cloud.url}/ready").status_code == 200, what="/ready once the upstream is back")
        edge.wait(ids)
        assert all(r.body.status == "ok" for rid in ids for r in edge.replies[rid])
        assert cloud.worker.stats["computed"] == 3 and cloud.worker.stats["cached"] == 0
        assert {r["request_id"]: r["outcome"] for r in cloud.store.escalations()} == dict.fromkeys(ids, "ok")
        assert all(len(edge.replies[rid]) == 1 for rid in ids)
    finally:
        edge.t.stop()


def test_upstream_down_past_the_retry_window_leaves_the_escalation_for_the_re_send(mosquitto, make_service,
                                                                                   openai_cloud, upstream_key,
                                                                                   idle_engine):
    """Past upstream_retry_s the worker gives up without answering (no error reply for a request it could not
    try): the claim is released, and the edge's re-send of the same envelope is answered once the upstream is up."""
    port = free_port()
    cloud = openai_cloud(broker=mosquitto.config.url, upstream_url=f"http://127.0.0.1:{port}/v1",
                         upstream_model=MODEL_NAME, upstream_key_file=str(upstream_key), upstream_retry_s=1.0)
    edge = Edge(mosquitto.config)
    try:
        edge.escalate(escalation("later", 20), envelope_id="env-later")
        wait_until(lambda: cloud.worker.stats["unavailable"] == 1, what="the worker giving up on the upstream")
        assert not edge.replies["later"]
        assert [r["outcome"] for r in cloud.store.escalations()] in ([], [None])  # claimed, never finished
        make_service(port=port)
        edge.escalate(escalation("later", 20), envelope_id="env-later")  # the edge's store-and-forward re-send
        edge.wait(["later"])
        (reply,) = edge.replies["later"]
        assert reply.body.status == "ok", reply.body.error
        assert cloud.worker.stats["computed"] == 1
    finally:
        edge.t.stop()


def test_an_openai_cloud_process_never_loads_torch(make_service, upstream_key, tmp_path):
    """The whole service with backend = "openai", in a fresh interpreter, ready against a live upstream: neither
    torch nor the engine package was imported."""
    upstream = make_service()
    script = textwrap.dedent(f"""
        import json, sys, time, httpx
        from apiary.cloud.service import CloudService
        from apiary.cloud.settings import CloudSettings
        service = CloudService(CloudSettings(port=0, db={str(tmp_path / 'p.db')!r}, generate_key="never",
                                             api_key_file={str(tmp_path / 'p.jsonl')!r}, backend="openai",
                                             upstream_url={upstream.url + '/v1'!r}, upstream_model={MODEL_NAME!r},
                                             upstream_key_file={str(upstream_key)!r}))
        service.start()
        try:
            ready = httpx.get(service.url + "/ready").status_code
        finally:
            service.stop()
        print(json.dumps({{"ready": ready, "loaded": sorted(m for m in sys.modules
                          if m == "torch" or m.startswith(("torch.", "apiary.cloud.engine")))}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"ready": 200, "loaded": []}


@pytest.fixture
def llama_server() -> Iterator[str]:
    """llama.cpp's own server on the shipped student GGUF (2 slots), as ``apiary bench engine`` starts it;
    its OpenAI base URL."""
    from apiary.bench.http_serving import LLAMA_SERVER, llama_server as start

    if not LLAMA_SERVER.is_file():
        pytest.skip(f"llama-server is not built ({LLAMA_SERVER} missing): run bash deploy/build_llama_server.sh")
    with start(assets.model_file("edge-student"), threads=min(2, os.cpu_count() or 1), slots=2, ctx_per_slot=2048,
               alias="edge-student") as server:
        yield server.url


def test_escalations_over_mqtt_are_answered_by_llama_server(mosquitto, openai_cloud, llama_server):
    """The same worker against llama.cpp's own server: schema-constrained actions, confidence from its logprobs."""
    cloud = openai_cloud(broker=mosquitto.config.url, upstream_url=llama_server, upstream_model="edge-student",
                         upstream_prompt_style="short")
    wait_until(lambda: httpx.get(f"{cloud.url}/ready").status_code == 200, what="the openai cloud ready")
    edge = Edge(mosquitto.config)
    try:
        for i in range(2):
            edge.escalate(escalation(f"ls-{i}", 30 + i, priority=2 + i))
        edge.wait(["ls-0", "ls-1"], timeout=180)
        for rid in ("ls-0", "ls-1"):
            (reply,) = edge.replies[rid]
            result = reply.body
            assert result.status == "ok", result.error
            assert tuple(json.loads(result.text)) == tuple(ACTION_JSON_SCHEMA["properties"])  # the schema held
            Action.model_validate(result.action)
            assert result.model == "openai:edge-student" and result.completion_tokens > 3
            assert result.confidence is not None and math.isfinite(result.confidence) and result.confidence <= 0
    finally:
        edge.t.stop()
