"""The REST API on a live uvicorn server with the real engine and SmolLM2 weights."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.cloud.conftest import MODEL_NAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

COUNTING = "1, 2, 3, 4, 5, 6, 7,"  # greedy SmolLM2 keeps counting: long outputs without an early EOS


@pytest.fixture
def server(make_service, keys):
    service = make_service(max_body_bytes=64 * 1024)
    service.inference_key = keys.create(["inference"])
    service.operator_key = keys.create(["operator"])
    return service


def client(service, key: str | None = "inference", **kw) -> httpx.Client:
    headers = {}
    if key == "inference":
        headers["Authorization"] = f"Bearer {service.inference_key}"
    elif key == "operator":
        headers["Authorization"] = f"Bearer {service.operator_key}"
    elif key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.Client(base_url=service.url, headers=headers, **{"timeout": 60, **kw})


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not reached in time")


def test_openai_client_chat_completion_and_streaming(server, idle_engine):
    import openai
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key=server.inference_key, max_retries=0)

    assert [m.id for m in oa.models.list().data] == [MODEL_NAME]

    chat = oa.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "What do bees make?"}],
                                      max_tokens=12, temperature=0)
    text = chat.choices[0].message.content
    assert text and chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.prompt_tokens > 5 and 1 <= chat.usage.completion_tokens <= 12
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    stream = oa.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "What do bees make?"}],
                                        max_tokens=12, temperature=0, stream=True,
                                        stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text  # greedy: the stream and the one-shot answer agree token for token
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [chat.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    done = oa.completions.create(model=MODEL_NAME, prompt=COUNTING, max_tokens=6, temperature=0)
    assert done.choices[0].text.strip().startswith("8")
    assert done.usage.completion_tokens == 6 and done.choices[0].finish_reason == "length"
    pieces = [c.choices[0].text for c in oa.completions.create(model=MODEL_NAME, prompt=COUNTING, max_tokens=6,
                                                               temperature=0, stream=True)]
    assert "".join(pieces) == done.choices[0].text

    stopped = oa.completions.create(model=MODEL_NAME, prompt=COUNTING, max_tokens=20, temperature=0, stop=[" 10"])
    assert stopped.choices[0].finish_reason == "stop" and "10" not in stopped.choices[0].text
    assert "9" in stopped.choices[0].text

    seeded = [oa.completions.create(model=MODEL_NAME, prompt="Bees are", max_tokens=8, temperature=1.0, top_p=0.9,
                                    seed=1234).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]

    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="n: Input should be less than or equal to 8"):
        oa.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], n=9)


def test_keys_and_scopes(server):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
    with client(server, key=None) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert "missing API key" in r.json()["error"]["message"]
        assert c.get("/v1/fleet/devices").status_code == 401
        assert c.get("/v1/models", headers={"X-API-Key": server.inference_key}).status_code == 200
        assert c.get("/healthz").status_code == 200  # open endpoints stay open
    with client(server, key="apk_00000000_not-a-real-key") as c:
        assert c.post("/v1/completions", json=body).status_code == 401
    with client(server, key="inference") as c:
        r = c.get("/v1/fleet/devices")
        assert r.status_code == 403 and "operator" in r.json()["error"]["message"]
    with client(server, key="operator") as c:
        assert c.post("/v1/completions", json=body).status_code == 403
        assert c.get("/v1/fleet/devices").status_code == 200
    # keys are stored hashed: the file never contains a key
    assert server.inference_key not in server.keys.path.read_text()


def test_body_size_limit_declared_and_streamed(server):
    big = {"model": MODEL_NAME, "prompt": "x" * (80 * 1024), "max_tokens": 1}
    with client(server) as c:
        r = c.post("/v1/completions", json=big)
        assert r.status_code == 413 and "65536-byte limit" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: the limit must hold on the bytes actually received
            for _ in range(20):
                yield b"x" * 8192

        r = c.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413


def test_validation_errors_are_openai_400s_with_a_clear_message(server):
    with client(server) as c:
        cases = [
            ({"messages": [{"role": "user", "content": "hi"}], "n": 9}, "n"),
            ({"messages": [{"role": "user", "content": "hi"}], "temperature": 5}, "temperature"),
            ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
            ({"messages": [{"role": "user", "content": "hi"}], "best_of": 2}, "best_of"),
            ({"messages": [{"role": "user", "content": "hi"}], "priority": 12}, "priority"),
            ({"messages": []}, "messages"),
        ]
        for body, param in cases:
            r = c.post("/v1/chat/completions", json={"model": MODEL_NAME, **body})
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == param and param in error["message"], error
            assert error["type"] == "invalid_request_error"
        r = c.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
        # the operator routes keep FastAPI's 422
        operator = {"Authorization": f"Bearer {server.operator_key}"}
        assert c.post("/v1/fleet/ota", json={"site": 1}, headers=operator).status_code == 422
        # well-formed but impossible for this engine (context 2048): 400 with the engine's reason
        r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hello " * 2100, "max_tokens": 4})
        assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 5000})
        assert r.status_code == 400 and "limit" in r.json()["error"]["message"]


def test_queue_full_is_429_and_disconnects_free_kv_blocks(server, cloud_engine, idle_engine):
    """Fill the real engine (4 running + 6 waiting), get a 429, then hang up and see the KV blocks freed."""
    base = cloud_engine.metrics()
    before_aborted = base["requests_aborted"]
    streams: list[tuple[httpx.Client, httpx.Response]] = []
    started = threading.Semaphore(0)

    def open_stream() -> None:  # each holds one long generation open; waiting ones block until admitted
        c = client(server)
        request = c.build_request("POST", "/v1/completions", json={
            "model": MODEL_NAME, "prompt": COUNTING, "max_tokens": 400, "temperature": 0, "stream": True})
        response = c.send(request, stream=True)
        streams.append((c, response))
        started.release()

    for i in range(4):  # one at a time: simultaneous arrivals would all sit in the waiting queue first
        threading.Thread(target=open_stream, daemon=True).start()
        assert started.acquire(timeout=60)
        assert streams[-1][1].status_code == 200
    waiting = []
    for i in range(6):
        waiting.append(threading.Thread(target=open_stream, daemon=True))
        waiting[-1].start()
        wait_for(lambda: cloud_engine.metrics()["requests_waiting"] == i + 1)
    m = cloud_engine.metrics()
    assert m["requests_running"] == 4 and m["kv_blocks_used"] > 0

    with client(server) as c:
        r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 1 and "queue is full" in r.json()["error"]["message"]

    # Read a little from a running stream, then every client hangs up mid-stream.
    c, r = streams[0]
    lines = r.iter_lines()
    assert next(line for line in lines if line.startswith("data:"))
    closed = 0
    deadline = time.monotonic() + 90
    while closed < 10:  # hang up on whoever is streaming; the waiting ones get admitted and are next
        assert time.monotonic() < deadline, f"only {closed} streams ever started"
        for c, r in streams[closed:]:
            r.close()
            c.close()
            closed += 1
        time.sleep(0.05)
    for t in waiting:
        t.join(10)

    def drained():
        m = cloud_engine.metrics()
        return m["requests_running"] == 0 and m["requests_waiting"] == 0 and m["kv_blocks_used"] == 0 and m
    m = wait_for(drained)
    assert m["requests_aborted"] - before_aborted == 10  # nobody ran to 400 tokens for a client that left
    assert m["kv_blocks_free"] == m["kv_blocks_total"]


def test_non_streaming_disconnect_aborts(server, cloud_engine, idle_engine):
    before = cloud_engine.metrics()["requests_aborted"]
    c = client(server, timeout=httpx.Timeout(60, read=1.0))
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s, long before 400 tokens
        c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": COUNTING, "max_tokens": 400, "temperature": 0})
    c.close()
    wait_for(lambda: cloud_engine.metrics()["requests_aborted"] == before + 1)
    wait_for(lambda: cloud_engine.metrics()["kv_blocks_used"] == 0)


def test_images_with_range_requests(server, tmp_path):
    images = tmp_path / "images"
    images.mkdir(exist_ok=True)
    data = bytes(range(256)) * 40
    (images / "edge-1.2.0.img").write_bytes(data)
    with httpx.Client(base_url=server.url) as c:  # devices fetch images without an API key
        full = c.get("/v1/images/edge-1.2.0.img")
        assert full.status_code == 200 and full.content == data and full.headers["accept-ranges"] == "bytes"
        part = c.get("/v1/images/edge-1.2.0.img", headers={"Range": "bytes=1000-2999"})
        assert part.status_code == 206 and part.content == data[1000:3000]
        assert part.headers["content-range"] == f"bytes 1000-2999/{len(data)}"
        resume = c.get("/v1/images/edge-1.2.0.img", headers={"Range": "bytes=10000-"})
        assert resume.status_code == 206 and resume.content == data[10000:]
        assert c.get("/v1/images/missing.img").status_code == 404
        assert c.get("/v1/images/..%2Fcloud.db").status_code in (404, 422)
        assert c.get("/v1/images/edge-1.2.0.img", headers={"Range": "bytes=999999-"}).status_code == 416


def test_health_metrics_and_openapi(server):
    with client(server) as c:
        c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Bees", "max_tokens": 2})
        health = c.get("/healthz").json()
        assert health["status"] == "ok" and health["model"] == MODEL_NAME and health["broker"] is None
        assert health["engine"]["kv_blocks_total"] > 0
        text = c.get("/metrics").text
        for name in ("apiary_engine_kv_blocks_total", "apiary_http_requests_total", "apiary_inference_ttft_seconds",
                     "apiary_inference_e2e_seconds_bucket", 'apiary_tokens_total{kind="completion",path="rest"} 2.0'):
            assert name in text, name
        assert 'route="/v1/completions",status="200"' in text
        schema = c.get("/openapi.json").json()
        assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/fleet/devices", "/v1/fleet/ota",
                "/v1/fleet/escalations", "/healthz", "/metrics", "/v1/images/{filename}"} <= set(schema["paths"])
        props = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
        assert {"priority", "n", "logprobs", "top_logprobs", "response_format", "logit_bias", "top_k", "min_p",
                "guided_json", "stop_token_ids", "repetition_penalty"} <= set(props)
        assert "400" in schema["paths"]["/v1/chat/completions"]["post"]["responses"]
        assert "prompt_tokens_details" in schema["components"]["schemas"]["Usage"]["properties"]


def test_every_error_code_is_a_string(server, tmp_path):
    """Whatever raised it (auth, validation, a route's own 404/422/503, the body limit, an unknown method), the
    error's ``code`` is a string, as OpenAI's is, and the OpenAPI document says so."""
    ota = {"site": "farm", "device": "h1", "image_version": "1", "filename": "edge.img", "sha256": "0" * 64,
           "signature": "0" * 128, "size": 3}
    (tmp_path / "images").mkdir(exist_ok=True)
    with client(server) as c, client(server, key="operator") as op, client(server, key=None) as anonymous:
        responses = {
            "401": anonymous.get("/v1/models"),
            "403": c.get("/v1/fleet/devices"),
            "404 model": c.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi", "max_tokens": 1}),
            "404 image": anonymous.get("/v1/images/none.img"),
            "404 ota image": op.post("/v1/fleet/ota", json=ota),
            "400 validation": c.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": []}),
            "400 engine": c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 5000}),
            "405": c.delete("/v1/models"),
            "413": c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x" * (80 * 1024)}),
            "422 validation": op.post("/v1/fleet/ota", json={"site": 1}),
        }
        (tmp_path / "images" / "edge.img").write_bytes(b"abcd")
        responses["422 route"] = op.post("/v1/fleet/ota", json=ota)  # the size does not match
        responses["503"] = op.post("/v1/fleet/ota", json={**ota, "size": 4})  # no broker
        openapi = anonymous.get("/openapi.json").json()
    codes = {what: r.json()["error"]["code"] for what, r in responses.items()}
    assert all(str(r.status_code) == what.split()[0] for what, r in responses.items()), codes
    assert all(isinstance(code, str) and code for code in codes.values()), codes
    assert codes["404 model"] == "model_not_found" and codes["401"] == "invalid_api_key", codes
    assert openapi["components"]["schemas"]["ErrorDetail"]["properties"]["code"]["type"] == "string"
