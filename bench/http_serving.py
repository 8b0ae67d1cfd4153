"""Servers through the door users meet them by: OpenAI HTTP, streaming, 16 concurrent clients.

``apiary bench engine --systems …,llama-server,cloud-http`` starts each server as its own
process on the same GGUF (llama.cpp's ``llama-server`` with 16 parallel slots, built by
deploy/build_llama_server.sh; our ``apiary cloud serve``, and as ``cloud-http-int8`` / ``cloud-http-kv8``
the same with ``--weights int8`` / ``--kv-cache-dtype int8``), waits until it is ready, and drives it
with one client: the workload's prompt token ids to ``/v1/completions`` (``stream``, greedy,
``ignore_eos``, ``max_tokens``), at most ``concurrency`` requests in flight. Per run: output
tokens/s over the wall time, TTFT of every request (send to first streamed token), the
server's peak RSS (``VmHWM``), and each request's token count (checked against ``max_tokens``,
so both servers generate exactly the same amount).

Before the timed run, a fresh server gets ten one-at-a-time probe requests (ten different prompts
of one length): the first one's TTFT against the tenth's says whether the server warmed up
before it said it was ready.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import httpx

ROOT = Path(__file__).resolve().parents[1]
LLAMA_SERVER = ROOT / ".venv" / "llama-server" / "llama-server"
WARMUP_PROBES = 10


@dataclass(slots=True)
class Server:
    url: str  # the OpenAI base URL (…/v1)
    pid: int
    headers: dict[str, str] = field(default_factory=dict)
    model: str = ""


@dataclass(slots=True)
class HttpRun:
    wall: float
    output_tokens: list[int]
    ttfts: list[float]
    peak_rss_mb: float
    cpu_s: float  # the server process's CPU seconds during the run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (``VmHWM``), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU seconds so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not ready in {timeout:.0f} s: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


@contextmanager
def _process(cmd: list[str], ready_url: str, env: dict[str, str] | None, timeout: float) -> Iterator[subprocess.Popen]:
    with tempfile.TemporaryDirectory(prefix="apiary-bench-http-") as tmp:
        log = Path(tmp) / "server.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp)
            try:
                _wait_ready(proc, ready_url, log, timeout)
                try:
                    yield proc
                except (httpx.HTTPError, RuntimeError) as e:
                    state = "running" if proc.poll() is None else f"exited with {proc.returncode}"
                    raise RuntimeError(f"{type(e).__name__}: {e}; the server is {state}, its log ends: "
                                       f"{log.read_text(errors='replace')[-3000:]}") from e
            finally:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@contextmanager
def llama_server(model: Path, threads: int, slots: int, ctx_per_slot: int, timeout: float = 300,
                 alias: str = "bench", options: Sequence[str] = (), binary: Path = LLAMA_SERVER) -> Iterator[Server]:
    """llama.cpp's own server: ``slots`` parallel slots of ``ctx_per_slot`` tokens each, continuous batching,
    serving ``model`` as ``alias``; ``options``: more of its command-line options; ``binary``: which build."""
    if not binary.is_file():
        raise RuntimeError(f"no llama-server at {binary}: run bash deploy/build_llama_server.sh"
                           + ("" if binary == LLAMA_SERVER else f" (or pass the path of a build; the default is {LLAMA_SERVER})"))
    port = free_port()
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "-c", str(slots * ctx_per_slot), "-t", str(threads), "-tb", str(threads), "-b", "1024",
           "--alias", alias, *options]
    with _process(cmd, f"http://127.0.0.1:{port}/health", None, timeout) as proc:
        yield Server(f"http://127.0.0.1:{port}/v1", proc.pid, model=alias)


@contextmanager
def cloud_server(model: Path, dtype: str, max_num_seqs: int, budget: int, env: dict[str, str],
                 timeout: float = 600, options: Sequence[str] = ()) -> Iterator[Server]:
    """``apiary cloud serve`` on the raw GGUF (no adapter, no broker), REST only, with a key of its own;
    ``options``: more of its command-line options."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="apiary-bench-cloud-") as tmp:
        key_file = Path(tmp) / "keys.jsonl"
        from apiary.cloud.auth import SCOPES, KeyRing

        key = KeyRing(key_file).create(SCOPES, name="bench")
        cmd = [sys.executable, "-m", "apiary", "cloud", "serve", "--port", str(port), "--model", str(model),
               "--adapter", "none", "--dtype", dtype, "--db", str(Path(tmp) / "c.db"), "--api-key-file",
               str(key_file), "--images", str(Path(tmp) / "img"), *options]
        server_env = {**env, "APIARY__CLOUD__MAX_NUM_SEQS": str(max_num_seqs),
                      "APIARY__CLOUD__MAX_NUM_BATCHED_TOKENS": str(budget),  # its default KV cache (512 MiB)
                      "APIARY__CLOUD__MAX_WAITING": "1024", "APIARY__CLOUD__SERVED_MODEL_NAME": "bench",
                      "APIARY_LOG_LEVEL": "WARNING"}
        with _process(cmd, f"http://127.0.0.1:{port}/ready", server_env, timeout) as proc:
            yield Server(f"http://127.0.0.1:{port}/v1", proc.pid, {"Authorization": f"Bearer {key}"}, "bench")


async def _one(client: httpx.AsyncClient, server: Server, prompt: Sequence[int], max_tokens: int) -> tuple[float, int]:
    """Stream one completion; (TTFT, output tokens as the server counted them)."""
    body = {"model": server.model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    for attempt in range(3):  # llama-server at times closed a connection unanswered (2 of 8 runs of 64)
        try:
            return await _stream(client, server, body, start, len(prompt))
        except httpx.RemoteProtocolError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


async def _stream(client: httpx.AsyncClient, server: Server, body: dict[str, Any], start: float,
                  prompt_len: int) -> tuple[float, int]:
    ttft, chunks, usage = None, 0, None
    async with client.stream("POST", f"{server.url}/completions", json=body, headers=server.headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{server.url} answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            if doc.get("usage"):
                usage = doc["usage"]
            for choice in doc.get("choices") or []:
                if choice.get("text"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - start
    tokens = int(usage["completion_tokens"]) if usage and usage.get("completion_tokens") else chunks
    if ttft is None:
        raise RuntimeError(f"{server.url} streamed no text for a {prompt_len}-token prompt")
    return ttft, tokens


async def _drive(server: Server, work: Sequence[Any], concurrency: int) -> tuple[float, list[float], list[int]]:
    # A new connection per request: llama-server (cpp-httplib) closes an idle keep-alive connection after 5 s,
    # and a request a client sends on it just then fails with "Server disconnected" (seen mid-run).
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def run(r: Any) -> tuple[float, int]:
            async with gate:
                return await _one(client, server, r.prompt, r.max_tokens)

        start = time.perf_counter()
        done = await asyncio.gather(*(run(r) for r in work))
        wall = time.perf_counter() - start
    return wall, [t for t, _ in done], [n for _, n in done]


def probe_prompts(work: Sequence[Any], n: int = WARMUP_PROBES) -> list[list[int]]:
    """``n`` different prompts of one length (the workload's first ones, cut to the shortest of them): alike in
    cost, and none a prefix of another, so neither server's prompt cache makes a later one cheaper."""
    first = [list(r.prompt) for r in work[:n]]
    # a workload of fewer than n requests: its prompts again, rotated (another first token, so no shared prefix)
    prompts = [first[i % len(first)][i // len(first):] + first[i % len(first)][:i // len(first)] for i in range(n)]
    length = min(len(p) for p in prompts)
    return [p[:length] for p in prompts]


def warmup_ttfts(server: Server, prompts: Sequence[Sequence[int]]) -> list[float]:
    """TTFTs of one-at-a-time requests (4 tokens each) to a server that just said ready."""
    async def probes() -> list[float]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
            return [(await _one(client, server, prompt, 4))[0] for prompt in prompts]

    return asyncio.run(probes())


def run_http(server: Server, work: Sequence[Any], concurrency: int) -> HttpRun:
    """The workload against a running server, ``concurrency`` streams at a time; token counts checked."""
    cpu_start = cpu_seconds(server.pid)
    wall, ttfts, counts = asyncio.run(_drive(server, work, concurrency))
    cpu = cpu_seconds(server.pid) - cpu_start
    wrong = [(i, n, r.max_tokens) for i, (n, r) in enumerate(zip(counts, work)) if n != r.max_tokens]
    if wrong:
        raise RuntimeError(f"{server.url}: requests generated other token counts than max_tokens "
                           f"(index, got, asked): {wrong[:5]}")
    return HttpRun(wall, counts, ttfts, peak_rss_mb(server.pid), cpu)


# the cloud-http systems: `apiary cloud serve` as operators start it; with KV rows in its dtype (where `auto` keeps
# bf16 rows under float32: the A/B for them); with bf16-held or int8 weights or int8 KV cache
CLOUD_OPTIONS: dict[str, tuple[str, ...]] = {"cloud-http": (), "cloud-http-dtype-kv": ("--kv-cache-dtype", "dtype"),
                                             "cloud-http-bf16w": ("--weights", "bf16"),
                                             "cloud-http-int8": ("--weights", "int8"),
                                             "cloud-http-kv8": ("--kv-cache-dtype", "int8"),
                                             "cloud-http-ngram": ("--speculative", "ngram")}
# llama.cpp's prompt-lookup speculation, set to our n-gram proposer's lengths (SpeculativeConfig: suffixes of
# up to 4 tokens, up to 8 drafts); its defaults (12 and 48) are tuned for long repeated passages.
LLAMA_OPTIONS: dict[str, tuple[str, ...]] = {"llama-server": (), "llama-server-ngram": (
    "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4", "--spec-ngram-simple-size-m", "8")}


def run_server_system(system: str, model: Path, work: Sequence[Any], *, threads: int, clients: int, dtype: str,
                      max_num_seqs: int, budget: int, drop_env: Sequence[str] = (),
                      llama_server_binary: Path = LLAMA_SERVER) -> Any:
    """One round of an HTTP system (``llama-server`` or ``cloud-http``) on a freshly started server, as a
    ``bench.engine.Result``. ``drop_env``: variables this process set for its own engine, which the server
    must not inherit (it runs with the operator's environment). ``llama_server_binary``: which llama.cpp build
    (e.g. one built for AVX2 only, to rehearse such a host)."""
    from apiary.bench.engine import Result

    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    if system in LLAMA_OPTIONS:
        ctx = max(len(r.prompt) + r.max_tokens for r in work) + 16
        options = LLAMA_OPTIONS[system]
        server = llama_server(model, threads, clients, ctx, options=options, binary=llama_server_binary)
        build = "" if llama_server_binary == LLAMA_SERVER else f" ({llama_server_binary})"
        detail = (f"llama.cpp's llama-server{build}{''.join(f' {o}' for o in options)}, {clients} slots, {threads} "
                  f"threads, over HTTP, {clients} clients")
    elif system in CLOUD_OPTIONS:
        options = CLOUD_OPTIONS[system]
        server = cloud_server(model, dtype, max_num_seqs, budget, env, options=options)
        detail = (f"apiary cloud serve (dtype {dtype}{''.join(f' {o}' for o in options)}, max_num_seqs={max_num_seqs}), "
                  f"over HTTP, {clients} clients")
    else:
        raise ValueError(f"not an HTTP system: {system}")
    with server as s:
        warmup = warmup_ttfts(s, probe_prompts(work))
        before = engine_steps(s) if system in CLOUD_OPTIONS else None
        run = run_http(s, work, clients)
        after = engine_steps(s) if before is not None else None
    extra: dict[str, Any] = {"peak_rss_mb": run.peak_rss_mb, "warmup_ttfts": warmup}
    if before and after:  # our server's steps by kind during the run, for the floor per kind (bench.engine.step_floors)
        from apiary.bench.engine import STEP_FIELDS

        extra["steps_by_kind"] = {k: after[k] - before[k] for k in STEP_FIELDS}
        extra["kv_bytes_per_token"] = after["kv_cache_bytes_per_token"]
    return Result(system, detail, run.wall, sum(run.output_tokens), run.ttfts, extra, run.cpu_s)


def engine_steps(server: Server) -> dict[str, Any] | None:
    """Our server's engine counters (``GET /healthz``'s ``engine``: ``LLMEngine.metrics()``' numbers), None where it
    does not report the steps by kind."""
    from apiary.bench.engine import STEP_FIELDS

    engine = httpx.get(server.url.removesuffix("/v1") + "/healthz", timeout=30).json().get("engine", {})
    return engine if all(k in engine for k in (*STEP_FIELDS, "kv_cache_bytes_per_token")) else None
