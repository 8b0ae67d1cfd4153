"""/health (liveness), /ready (readiness) and the drain: what a load balancer and an orchestrator see."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fastapi import FastAPI

from apiary.cloud.api.health import Gate, Lifecycle
from apiary.cloud.metrics import Metrics
from apiary.shared.config import MqttConfig
from apiary.shared.transport import MqttTransport
from tests.cloud.conftest import MODEL_NAME

COUNTING = "1, 2, 3, 4, 5, 6, 7,"


def call(app, method: str, path: str) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://cloud") as c:
            return await c.request(method, path)
    return asyncio.run(go())


def small_app(life: Lifecycle) -> FastAPI:
    """An app with the gate's neighbours: /ready reads the same lifecycle, /v1/models stands for any route."""
    app = FastAPI()

    @app.get("/ready")
    def ready():
        from fastapi.responses import JSONResponse
        ok, body = life.readiness()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models")
    def models():
        return {"data": []}

    return app


def test_gate_while_loading_serving_and_draining():
    life = Lifecycle(broker_required=False)
    metrics = Metrics()
    gate = Gate(life, metrics)

    # loading: alive, not ready, everything else refused in OpenAI's shape with Retry-After
    assert call(gate, "GET", "/health").json()["phase"] == "loading"
    r = call(gate, "GET", "/ready")
    assert r.status_code == 503 and r.json()["reasons"] == ["the model is loading"]
    r = call(gate, "GET", "/v1/models")
    assert r.status_code == 503 and r.headers["retry-after"] == "5" and r.json()["error"]["code"] == "loading"

    # serving
    life.model_loaded = True
    gate.app = small_app(life)
    assert call(gate, "GET", "/ready").status_code == 200
    assert call(gate, "GET", "/v1/models").status_code == 200

    # draining: not ready, new requests refused, probes still answered
    life.draining = True
    r = call(gate, "GET", "/ready")
    assert r.status_code == 503 and r.json()["phase"] == "draining"
    r = call(gate, "GET", "/v1/models")
    assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
    text = metrics.render().decode()
    assert 'apiary_refused_requests_total{reason="loading"} 1.0' in text
    assert 'apiary_refused_requests_total{reason="draining"} 1.0' in text
    assert life.in_flight == 0


def test_ready_needs_the_broker_when_one_is_configured():
    transport = MqttTransport(MqttConfig(host="127.0.0.1", port=1), "ready-test", persistent=False)
    life = Lifecycle(model_loaded=True, broker_required=True, transport=transport)
    ok, body = life.readiness()
    assert not ok and body["broker"] == "disconnected" and body["reasons"] == ["not connected to the broker"]
    assert Lifecycle(model_loaded=True, broker_required=False).readiness()[0]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_service_ready_with_broker_and_draining_finishes_in_flight(make_service, keys, mosquitto, idle_engine):
    service = make_service(broker=mosquitto.config.url, worker_id="ready-w")
    key = keys.create(["inference"])
    with httpx.Client(base_url=service.url, timeout=60, headers={"Authorization": f"Bearer {key}"}) as c:
        assert c.get("/health").json()["status"] == "ok"
        r = c.get("/ready")
        assert r.status_code == 200 and r.json()["broker"] == "connected", r.text
        assert c.get("/healthz").json()["status"] == "ok"  # the old name still answers

        # a long stream in flight when the drain starts
        tokens: list[str] = []
        started, finished = threading.Event(), threading.Event()

        def stream() -> None:
            with c.stream("POST", "/v1/completions", json={"model": MODEL_NAME, "prompt": COUNTING, "max_tokens": 40,
                                                           "temperature": 0, "ignore_eos": True,
                                                           "stream": True}) as s:
                for line in s.iter_lines():
                    if line.startswith("data: {"):
                        tokens.append(json.loads(line[6:])["choices"][0]["text"])
                        started.set()
            finished.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        result: list[bool] = []
        drainer = threading.Thread(target=lambda: result.append(service.drain(120)))
        drainer.start()
        deadline = time.monotonic() + 30
        while c.get("/ready").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert not finished.is_set() or result == [True]  # /ready turned before the stream could finish
        refused = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Bees", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert c.get("/health").status_code == 200
        drainer.join(120)
        t.join(60)
        assert result == [True] and finished.is_set()
        assert len(tokens) == 40  # the in-flight stream ran to its end


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_sigterm_drains_then_exits(tmp_path, gguf_path):
    """`apiary cloud serve`: /health answers while the model loads, /ready only after; SIGTERM turns /ready to 503,
    the stream in flight gets every token, then the process exits 0."""
    env = {**os.environ, "APIARY__CLOUD__KV_CACHE_MB": "32", "APIARY__CLOUD__MAX_MODEL_LEN": "256",
           "APIARY_LOG_LEVEL": "WARNING"}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [sys.executable, "-c", "from apiary.cli import app; app()", "cloud", "serve", "--port", str(port),
           "--model", str(gguf_path), "--db", str(tmp_path / "c.db"), "--api-key-file", str(tmp_path / "k.jsonl"),
           "--images", str(tmp_path / "img"), "--dtype", "float32", "--drain-timeout", "120"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        seen_loading = False
        while True:  # until the service prints its URL; meanwhile the probes answer
            assert proc.poll() is None, proc.stderr.read()
            try:
                ready = httpx.get(f"{url}/ready", timeout=5)
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            if ready.status_code == 503 and ready.json()["phase"] == "loading":
                seen_loading = True
                assert httpx.get(f"{url}/health", timeout=5).status_code == 200
            if ready.status_code == 200:
                break
            time.sleep(0.05)
        assert seen_loading, "/ready never answered while the model loaded"
        assert proc.stdout.readline().startswith("cloud service listening on")
        key = proc.stdout.readline().rsplit(" ", 1)[1].strip()
        tokens: list[str] = []
        started = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                              timeout=120, json={"prompt": COUNTING, "max_tokens": 30, "temperature": 0,
                                                 "ignore_eos": True, "stream": True}) as s:
                for line in s.iter_lines():
                    if line.startswith("data: {"):
                        tokens.append(json.loads(line[6:])["choices"][0]["text"])
                        started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        proc.send_signal(signal.SIGTERM)
        assert "draining" in proc.stdout.readline()
        t.join(120)
        assert len(tokens) == 30
        assert proc.wait(60) == 0
        assert "cloud service stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
