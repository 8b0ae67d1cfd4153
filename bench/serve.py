"""Serving load test: Poisson arrivals on the REST API (SSE) and the MQTT escalation path.

Starts its own Mosquitto and ``apiary cloud serve`` subprocess (the server gets its own
process, so the load generator never shares its GIL), then drives the same seeded
workload through both paths, one after the other, against the same server (each path's
prompts start differently, so neither rides on the other's prefix cache): prompts of
a random number of words, a random ``max_tokens``, exponential inter-arrival times at
``--rate`` requests/s with at most ``--concurrency`` in flight. Reports request
throughput, output tokens/s, TTFT / TPOT / end-to-end p50 and p99, and goodput: requests
per second that met the SLO (REST: TTFT and TPOT; MQTT replies are not streamed, so
end-to-end). The machine is shared and noisy: compare the rows of one run, not runs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import typer

WORDS = ("hive colony brood queen worker drone nectar pollen honey comb frame wax propolis forage swarm "
         "temperature humidity weight sensor battery solar morning evening meadow flower clover heather "
         "entrance guard robbing varroa mite inspection super winter spring summer autumn beekeeper smoke").split()


@dataclass(slots=True)
class Sample:
    prompt: str
    max_tokens: int
    arrival: float  # seconds after the start of the run


@dataclass(slots=True)
class Outcome:
    ok: bool
    start: float = 0.0
    ttft: float | None = None
    e2e: float = 0.0
    output_tokens: int = 0
    error: str = ""


@dataclass(slots=True)
class PathResult:
    path: str
    outcomes: list[Outcome] = field(default_factory=list)
    wall: float = 0.0


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 1 <= lo_i <= hi_i:
        raise typer.BadParameter(f"expected LO-HI with 1 <= LO <= HI, got {text!r}")
    return lo_i, hi_i


def workload(n: int, rate: float, words: tuple[int, int], out: tuple[int, int], seed: int) -> list[Sample]:
    import numpy as np

    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=n)) if rate > 0 else np.zeros(n)
    samples = []
    for i in range(n):
        k = int(rng.integers(words[0], words[1] + 1))
        text = " ".join(rng.choice(WORDS, size=k))
        samples.append(Sample(prompt=f"Field notes {i}: {text}. Summary:", max_tokens=int(rng.integers(out[0], out[1] + 1)),
                              arrival=float(arrivals[i])))
    return samples


async def run_rest(url: str, key: str, model: str, samples: list[Sample], concurrency: int) -> PathResult:
    import asyncio
    import json

    import httpx

    result = PathResult("rest")
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600,
                                 limits=limits) as client:
        t0 = time.perf_counter()

        async def one(s: Sample) -> Outcome:
            await asyncio.sleep(max(0.0, s.arrival - (time.perf_counter() - t0)))
            async with gate:
                o = Outcome(ok=False, start=time.perf_counter())
                body = {"model": model, "prompt": s.prompt, "max_tokens": s.max_tokens, "temperature": 0,
                        "stream": True, "stream_options": {"include_usage": True}}
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            o.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                            return o
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            doc = json.loads(line[6:])
                            if o.ttft is None and doc.get("choices") and doc["choices"][0].get("text"):
                                o.ttft = time.perf_counter() - o.start
                            if doc.get("usage"):
                                o.output_tokens = doc["usage"]["completion_tokens"]
                            if "error" in doc:
                                o.error = doc["error"]["message"]
                                return o
                except httpx.HTTPError as e:
                    o.error = f"{type(e).__name__}: {e}"
                    return o
                o.e2e = time.perf_counter() - o.start
                o.ok = True
                return o

        result.outcomes = await asyncio.gather(*(one(s) for s in samples))
        result.wall = time.perf_counter() - t0
    return result


def run_mqtt(mqtt_config, samples: list[Sample], concurrency: int, timeout: float = 600.0) -> PathResult:
    import threading

    from apiary.shared import topics
    from apiary.shared.protocol import InferenceRequest, make
    from apiary.shared.transport import MqttTransport

    result = PathResult("mqtt")
    outcomes = [Outcome(ok=False) for _ in samples]
    done = threading.Semaphore(0)
    gate = threading.Semaphore(concurrency)
    edge = MqttTransport(mqtt_config, f"bench-edge-{time.time_ns()}", persistent=False)

    def on_reply(topic: str, env) -> None:
        i = int(env.body.request_id.rsplit("-", 1)[1])
        o = outcomes[i]
        o.e2e = time.perf_counter() - o.start
        o.ok = env.body.status == "ok"
        o.output_tokens = env.body.completion_tokens
        o.error = env.body.error or ""
        gate.release()
        done.release()

    edge.subscribe(topics.all_of("reply", "bench"), on_reply)
    edge.start()
    try:
        run_id = time.time_ns()
        t0 = time.perf_counter()
        for i, s in enumerate(samples):
            time.sleep(max(0.0, s.arrival - (time.perf_counter() - t0)))
            gate.acquire()
            device = f"hive-{i % 8}"
            req = InferenceRequest(request_id=f"bench-{run_id}-{i}", site="bench", device=device, prompt=s.prompt,
                                   max_tokens=s.max_tokens, temperature=0.0, response_format="text", priority=6)
            outcomes[i].start = time.perf_counter()
            edge.publish(topics.escalate("bench", device),
                         make(req, sender="bench-edge", reply_to=topics.reply("bench", device)))
        deadline = time.monotonic() + timeout
        for _ in samples:
            if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
                break
        result.wall = time.perf_counter() - t0
    finally:
        edge.stop()
    for o in outcomes:
        if not o.ok and not o.error:
            o.error = "no reply"
    result.outcomes = outcomes
    return result


def summarise(r: PathResult, slo_ttft: float, slo_tpot: float, slo_e2e: float) -> dict:
    from apiary.bench.common import percentile

    ok = [o for o in r.outcomes if o.ok]
    tpot = [(o.e2e - o.ttft) / (o.output_tokens - 1) for o in ok if o.ttft is not None and o.output_tokens > 1]
    if r.path == "rest":
        good = [o for o in ok if o.ttft is not None and o.ttft <= slo_ttft and
                (o.output_tokens <= 1 or (o.e2e - o.ttft) / (o.output_tokens - 1) <= slo_tpot)]
    else:
        good = [o for o in ok if o.e2e <= slo_e2e]
    out_tokens = sum(o.output_tokens for o in ok)
    wall = max(r.wall, 1e-9)
    return {
        "path": r.path, "requests": len(r.outcomes), "ok": len(ok), "wall_s": r.wall,
        "req_per_s": len(ok) / wall, "out_tok_per_s": out_tokens / wall,
        "ttft_p50": percentile([o.ttft for o in ok if o.ttft is not None], 50),
        "ttft_p99": percentile([o.ttft for o in ok if o.ttft is not None], 99),
        "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
        "e2e_p50": percentile([o.e2e for o in ok], 50), "e2e_p99": percentile([o.e2e for o in ok], 99),
        "goodput_req_per_s": len(good) / wall, "slo_attained": len(good) / max(1, len(r.outcomes)),
        "errors": sorted({o.error for o in r.outcomes if o.error})[:5],
    }


def start_server(model: str, broker_url: str, workdir: Path, dtype: str, max_num_seqs: int, kv_cache_mb: int,
                 threads: int | None, log):
    """``apiary cloud serve`` as a subprocess; returns (process, url, api key) once it listens."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "APIARY__CLOUD__MAX_NUM_SEQS": str(max_num_seqs), "APIARY__CLOUD__KV_CACHE_MB": str(kv_cache_mb),
           "APIARY__CLOUD__MAX_WAITING": "4096", "APIARY__CLOUD__WORKER_CONCURRENCY": str(max(64, max_num_seqs)),
           "APIARY__CLOUD__MAX_BODY_BYTES": str(1 << 20), "APIARY_LOG_LEVEL": "WARNING"}
    if threads:
        env["APIARY__CLOUD__NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-c", "from apiary.cli import app; app()", "cloud", "serve", "--port", "0",
           "--model", model, "--broker", broker_url, "--db", str(workdir / "cloud.db"), "--api-key-file",
           str(workdir / "keys.jsonl"), "--images", str(workdir / "images"), "--dtype", dtype,
           "--worker-id", f"bench-cloud-{os.getpid()}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    url = key = None
    deadline = time.monotonic() + 300
    while (url is None or key is None) and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("cloud service listening on "):
            url = line.split()[4]
        elif line.startswith("API key for this process"):
            key = line.rsplit(" ", 1)[1].strip()
    if url is None or key is None:
        proc.kill()
        raise RuntimeError(f"cloud serve did not start; see {workdir / 'server.log'}")
    return proc, url, key


def command(
    rate: float = typer.Option(1.0, help="mean arrival rate, requests/s (Poisson); 0 = all at once"),
    requests: int = typer.Option(48, help="requests per path"),
    concurrency: int = typer.Option(16, help="most requests in flight per path"),
    prompt_words: str = typer.Option("32-256", help="prompt length range, words"),
    max_tokens: str = typer.Option("16-128", help="max_tokens range"),
    paths: str = typer.Option("rest,mqtt", help="which paths to drive: rest, mqtt or both"),
    model: str = typer.Option("smollm2-135m-q4", help="model path or registry name"),
    dtype: str = typer.Option("float32", help="engine dtype: float32 | bfloat16"),
    max_num_seqs: int = typer.Option(32, help="engine batch size"),
    kv_cache_mb: int = typer.Option(1024, help="engine KV pool"),
    threads: Optional[int] = typer.Option(None, help="torch threads in the server"),
    slo_ttft: float = typer.Option(5.0, help="SLO: time to first token, s (REST)"),
    slo_tpot: float = typer.Option(0.5, help="SLO: time per output token, s (REST)"),
    slo_e2e: float = typer.Option(30.0, help="SLO: end-to-end, s (MQTT)"),
    seed: int = typer.Option(0, help="workload seed"),
) -> None:
    """Serving load test: Poisson arrivals on the REST API (SSE) and the MQTT escalation path."""
    import asyncio
    import tempfile

    from apiary.bench.common import report
    from apiary.shared.brokers import MosquittoBroker

    chosen = [p.strip() for p in paths.split(",") if p.strip()]
    if not chosen or any(p not in ("rest", "mqtt") for p in chosen):
        raise typer.BadParameter(f"--paths takes rest, mqtt or rest,mqtt; got {paths!r}")
    samples = workload(requests, rate, parse_range(prompt_words), parse_range(max_tokens), seed)
    with tempfile.TemporaryDirectory(prefix="apiary-bench-serve-") as td:
        workdir = Path(td)
        broker = MosquittoBroker(data_dir=workdir / "mosquitto")
        mqtt_config = broker.start()
        proc = None
        log = open(workdir / "server.log", "wb")
        try:
            proc, url, key = start_server(model, mqtt_config.url, workdir, dtype, max_num_seqs, kv_cache_mb, threads,
                                          log)
            import httpx

            served = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"][0]["id"]
            warm = workload(2, 0, (8, 8), (4, 4), seed + 1)  # load kernels and caches before measuring
            asyncio.run(run_rest(url, key, served, warm, 2))
            results = []
            for p in chosen:
                # Same lengths and arrivals on both paths, but prompts that differ from the first token, so the
                # second path gets no prefix-cache hits from the first one's prompts.
                own = [Sample(f"[{p}] {s.prompt}", s.max_tokens, s.arrival) for s in samples]
                r = asyncio.run(run_rest(url, key, served, own, concurrency)) if p == "rest" \
                    else run_mqtt(mqtt_config, own, concurrency)
                results.append(summarise(r, slo_ttft, slo_tpot, slo_e2e))
            server_metrics = httpx.get(f"{url}/healthz").json()["engine"]
        finally:
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(30)
                except Exception:
                    proc.kill()
            log.close()
            broker.stop()
    columns = ["path", "ok/requests", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
               "e2e p50", "e2e p99", "goodput req/s", "SLO met"]
    rows = [[r["path"], f"{r['ok']}/{r['requests']}", r["req_per_s"], r["out_tok_per_s"], r["ttft_p50"],
             r["ttft_p99"], r["tpot_p50"], r["tpot_p99"], r["e2e_p50"], r["e2e_p99"], r["goodput_req_per_s"],
             f"{100 * r['slo_attained']:.0f}%"] for r in results]
    report("serve", f"cloud serve: {requests} req/path, rate {rate}/s, concurrency {concurrency}, {dtype}, "
           f"max_num_seqs {max_num_seqs}", columns, rows,
           {"results": results, "config": {"rate": rate, "requests": requests, "concurrency": concurrency,
                                           "prompt_words": prompt_words, "max_tokens": max_tokens, "model": model,
                                           "dtype": dtype, "max_num_seqs": max_num_seqs, "kv_cache_mb": kv_cache_mb,
                                           "slo": {"ttft": slo_ttft, "tpot": slo_tpot, "e2e": slo_e2e},
                                           "seed": seed},
            "engine_after": server_metrics})
    for r in results:
        if r["errors"]:
            typer.echo(f"{r['path']} errors: {r['errors']}", err=True)
