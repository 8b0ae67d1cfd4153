"""`apiary cloud keys create` and `apiary cloud serve` as an operator runs them."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from typer.testing import CliRunner

from apiary.cli import app
from apiary.cloud.auth import KeyRing
from apiary.shared import topics
from apiary.shared.protocol import DeviceState, InferenceRequest, make
from apiary.shared.transport import MqttTransport


def test_keys_create(tmp_path):
    path = tmp_path / "keys.jsonl"
    result = CliRunner().invoke(app, ["cloud", "keys", "create", "--scope", "operator", "--scope", "inference",
                                      "--name", "ops", "--api-key-file", str(path)])
    assert result.exit_code == 0, result.output
    key = result.stdout.strip().splitlines()[0]
    assert KeyRing(path).verify(key).scopes == frozenset({"operator", "inference"})
    assert json.loads(path.read_text())["name"] == "ops"
    bad = CliRunner().invoke(app, ["cloud", "keys", "create", "--scope", "root", "--api-key-file", str(path)])
    assert bad.exit_code == 2 and "scopes" in bad.output


def test_serve_reports_a_taken_port_before_loading_the_model(tmp_path):
    """The HTTP port is taken first: a busy port is the error, not something said after a long model load
    (here the model does not even exist, and that is not what fails)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = CliRunner().invoke(app, ["cloud", "serve", "--port", str(port), "--model", str(tmp_path / "none.gguf"),
                                          "--db", str(tmp_path / "c.db"), "--api-key-file", str(tmp_path / "k")])
    assert result.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in result.output, result.output
    assert "none.gguf" not in result.output


def test_serve_reports_an_unreachable_broker_before_loading_the_model(tmp_path, caplog):
    """The broker is asked first: its refusal is logged at once with the retry policy, while the model loads."""
    from apiary.shared.brokers import free_port

    broker = f"mqtt://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(app, ["cloud", "serve", "--port", "0", "--broker", broker, "--model",
                                      str(tmp_path / "none.gguf"), "--db", str(tmp_path / "c.db"),
                                      "--api-key-file", str(tmp_path / "k")])
    assert result.exit_code == 2 and "none.gguf" in result.output, result.output  # the model still fails
    reports = [r.getMessage() for r in caplog.records if broker in r.getMessage()]
    assert len(reports) == 1 and "ConnectionRefused" in reports[0] and "up to 30 s" in reports[0], reports
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_serve_subprocess_end_to_end(tmp_path, gguf_path, mosquitto):
    """The real command: loads the model, prints URL + key, answers REST and MQTT, leaves a death certificate.
    With --kv-cache-dtype int8 its 32 MiB KV cache holds int8 rows: 12,240 bytes per token (SmolLM2: 30 layers x
    K and V x 3 heads x (64 + a 4-byte scale)), as /metrics says; with --weights int8 its projections are int8
    (the grouped kernel where AVX-512 VNNI is, per-token W8A8 elsewhere; none here: dtype weights)."""
    env = {**os.environ, "APIARY__CLOUD__KV_CACHE_MB": "32", "APIARY__CLOUD__MAX_MODEL_LEN": "256",
           "APIARY_LOG_LEVEL": "WARNING"}
    cmd = [sys.executable, "-c", "from apiary.cli import app; app()", "cloud", "serve", "--port", "0",
           "--model", str(gguf_path), "--broker", mosquitto.config.url, "--db", str(tmp_path / "c.db"),
           "--api-key-file", str(tmp_path / "keys.jsonl"), "--images", str(tmp_path / "img"), "--worker-id", "cli-w",
           "--kv-cache-dtype", "int8"]
    from apiary.cloud.engine import int8

    if int8.gemm_choice().backend is not None:
        cmd += ["--weights", "int8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    states: list = []
    edge = MqttTransport(mosquitto.config, "cli-edge", persistent=False)
    try:
        url = proc.stdout.readline().split()[4]
        key = proc.stdout.readline().rsplit(" ", 1)[1].strip()
        auth = {"Authorization": f"Bearer {key}"}
        r = httpx.post(f"{url}/v1/completions", headers=auth, timeout=60,
                       json={"prompt": "Honey bees live in a", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        metrics = httpx.get(f"{url}/metrics", headers=auth, timeout=10).text
        per_token = re.search(r"^apiary_engine_kv_cache_bytes_per_token\S* (\S+)$", metrics, re.M)
        tokens = re.search(r"^apiary_engine_kv_cache_tokens\S* (\S+)$", metrics, re.M)
        assert per_token and float(per_token[1]) == 12240, metrics[-2000:]
        assert tokens and float(tokens[1]) == (32 << 20) // (16 * 12240) * 16
        replies: list = []
        edge.subscribe(topics.reply("farm", "h1"), lambda t, e: replies.append(e))
        edge.subscribe(topics.state(topics.CLOUD_SITE, "cli-w"), lambda t, e: states.append(e.body))
        edge.start()
        req = InferenceRequest(request_id="cli-1", site="farm", device="h1", prompt="Bees", max_tokens=2,
                               response_format="text")
        edge.publish(topics.escalate("farm", "h1"), make(req, sender="h1", reply_to=topics.reply("farm", "h1")))
        deadline = time.monotonic() + 60
        while not replies and time.monotonic() < deadline:
            time.sleep(0.05)
        assert replies and replies[0].body.status == "ok" and replies[0].body.completion_tokens == 2
        assert states and states[-1].status == "birth"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        deadline = time.monotonic() + 10
        while states[-1].status != "death" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert isinstance(states[-1], DeviceState) and states[-1].status == "death" and not states[-1].online
    finally:
        edge.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
