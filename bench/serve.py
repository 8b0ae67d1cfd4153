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

Replicas (issue 19): ``--replicas 1,2,3`` runs the workload once per count against that many
``apiary cloud serve`` processes on one broker and one database (``--db``: a fresh SQLite file, a
fresh database of a throwaway PostgreSQL cluster with ``temp-postgresql``, or a ``postgresql://`` URL):
MQTT escalations spread over the ``$share`` group, REST requests round-robin over the replicas. Each
row also reports the CPU seconds all replicas spent per answered request (on a small machine the
replicas share the cores: that, not throughput, says whether replicas cost more per request).
``--kill`` adds a run at the largest count in which one replica is killed with SIGKILL when half the
escalations are answered; the bench re-sends unanswered ones every ``--resend-s`` as the edge does, and
reports how many were lost (no answer) and computed twice.
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
    replies: list[int] = field(default_factory=list)  # MQTT: replies per request (repeats after re-sends)


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


async def run_rest(url: str | list[str], key: str, model: str, samples: list[Sample], concurrency: int) -> PathResult:
    """Drive ``samples`` through the REST API (SSE); several URLs (replicas) take the requests in turn."""
    import asyncio
    import json

    import httpx

    result = PathResult("rest")
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    urls = [url] if isinstance(url, str) else url
    clients = [httpx.AsyncClient(base_url=u, headers={"Authorization": f"Bearer {key}"}, timeout=600, limits=limits)
               for u in urls]
    try:
        t0 = time.perf_counter()

        async def one(i: int, s: Sample) -> Outcome:
            client = clients[i % len(clients)]
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

        result.outcomes = await asyncio.gather(*(one(i, s) for i, s in enumerate(samples)))
        result.wall = time.perf_counter() - t0
    finally:
        for client in clients:
            await client.aclose()
    return result


def run_mqtt(mqtt_config, samples: list[Sample], concurrency: int, timeout: float = 600.0, resend_s: float = 0.0,
             on_answered=None) -> PathResult:
    """Drive ``samples`` as escalations; only a request's first reply counts. ``resend_s`` > 0: re-send the
    unanswered ones (a new envelope, the same request id) that often, as the edge does. ``on_answered(n)`` is
    called on the MQTT thread after the n-th first reply (keep it quick)."""
    import threading

    from apiary.shared import topics
    from apiary.shared.protocol import InferenceRequest, make
    from apiary.shared.transport import MqttTransport

    result = PathResult("mqtt")
    outcomes = [Outcome(ok=False) for _ in samples]
    done = threading.Semaphore(0)
    gate = threading.Semaphore(concurrency)
    edge = MqttTransport(mqtt_config, f"bench-edge-{time.time_ns()}", persistent=False)
    answered: set[int] = set()
    sent: dict[int, tuple[InferenceRequest, float]] = {}  # in flight: the request and when it was last sent
    lock = threading.Lock()
    result.replies = [0] * len(samples)

    def publish(req: InferenceRequest) -> None:
        edge.publish(topics.escalate("bench", req.device),
                     make(req, sender="bench-edge", reply_to=topics.reply("bench", req.device)))

    def on_reply(topic: str, env) -> None:
        i = int(env.body.request_id.rsplit("-", 1)[1])
        with lock:
            result.replies[i] += 1
            if i in answered:
                return  # a repeat: the re-send's reply (the stored answer), not a new result
            answered.add(i)
            sent.pop(i, None)
            n = len(answered)
        o = outcomes[i]
        o.e2e = time.perf_counter() - o.start
        o.ok = env.body.status == "ok"
        o.output_tokens = env.body.completion_tokens
        o.error = env.body.error or ""
        gate.release()
        done.release()
        if on_answered is not None:
            on_answered(n)

    stop = threading.Event()

    def resend() -> None:
        while not stop.wait(min(1.0, resend_s)):
            now = time.perf_counter()
            with lock:
                due = [req for i, (req, at) in sent.items() if now - at >= resend_s]
                for req in due:
                    sent[int(req.request_id.rsplit("-", 1)[1])] = (req, now)
            for req in due:
                publish(req)

    edge.subscribe(topics.all_of("reply", "bench"), on_reply)
    edge.start()
    resender = threading.Thread(target=resend, daemon=True) if resend_s > 0 else None
    if resender is not None:
        resender.start()
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
            with lock:
                if i not in answered:
                    sent[i] = (req, outcomes[i].start)
            publish(req)
        deadline = time.monotonic() + timeout
        for _ in samples:
            if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
                break
        result.wall = time.perf_counter() - t0
    finally:
        stop.set()
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
                 threads: int | None, log, *, db: str | None = None, worker_id: str | None = None,
                 key: str | None = None, extra_env: dict[str, str] | None = None):
    """``apiary cloud serve`` as a subprocess; returns (process, url, api key) once it listens. ``key``: one
    already in the key file (replicas share it), else the process's generated key is read from its output."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "APIARY__CLOUD__MAX_NUM_SEQS": str(max_num_seqs), "APIARY__CLOUD__KV_CACHE_MB": str(kv_cache_mb),
           "APIARY__CLOUD__MAX_WAITING": "4096", "APIARY__CLOUD__WORKER_CONCURRENCY": str(max(64, max_num_seqs)),
           "APIARY__CLOUD__MAX_BODY_BYTES": str(1 << 20), "APIARY_LOG_LEVEL": "WARNING", **(extra_env or {})}
    if threads:
        env["APIARY__CLOUD__NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-c", "from apiary.cli import app; app()", "cloud", "serve", "--port", "0",
           "--model", model, "--broker", broker_url, "--db", db or str(workdir / "cloud.db"), "--api-key-file",
           str(workdir / "keys.jsonl"), "--images", str(workdir / "images"), "--dtype", dtype,
           "--worker-id", worker_id or f"bench-cloud-{os.getpid()}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    url = None
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


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its reaped children so far (0 once it is gone)."""
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system + t.children_user + t.children_system


def _ok_counter(url: str) -> float:
    """A replica's ``apiary_escalations_total{outcome="ok"}``: the escalations it computed."""
    import re

    import httpx

    found = re.search(r'^apiary_escalations_total\{outcome="ok"\} (\S+)$', httpx.get(f"{url}/metrics", timeout=30).text,
                      re.M)
    return float(found.group(1)) if found else 0.0


@dataclass(slots=True)
class Fleet:
    """What one run needs to know about its replicas."""

    procs: list = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    killed: int | None = None  # index of the replica killed mid-run
    cpu_at_kill: float = 0.0


def _run_fleet(n: int, tag: str, chosen: list[str], samples: list[Sample], o: dict, workdir: Path, db: str,
               kill: bool, pg) -> list[dict]:
    """One run: a fresh broker and database, ``n`` replicas, the workload on each chosen path."""
    import asyncio
    import os
    import threading

    import httpx

    from apiary.cloud.auth import KeyRing
    from apiary.cloud.db import migrate
    from apiary.cloud.store import open_store
    from apiary.shared.brokers import MosquittoBroker

    run_dir = workdir / tag
    run_dir.mkdir()
    url = (f"sqlite:///{run_dir / 'cloud.db'}" if db == "sqlite" else pg.create_database() if db == "temp-postgresql"
           else db)
    migrate.upgrade(url)  # PostgreSQL is migrated once, before the replicas start (they refuse an old schema)
    key = KeyRing(run_dir / "keys.jsonl").create(["inference", "operator"], name="bench")
    broker = MosquittoBroker(data_dir=run_dir / "mosquitto")  # fresh: no member sessions left from another run
    mqtt_config = broker.start()
    threads = o["threads"] or max(1, (os.cpu_count() or 1) // n)
    fleet = Fleet()
    log = open(run_dir / "server.log", "wb")
    rows = []
    try:
        for j in range(n):
            name = f"bench-{tag}-r{j + 1}"
            proc, u, _ = start_server(o["model"], mqtt_config.url, run_dir, o["dtype"], o["max_num_seqs"],
                                      o["kv_cache_mb"], threads, log, db=url, worker_id=name, key=key,
                                      extra_env={"APIARY__CLOUD__CLAIM_LEASE_S": str(o["claim_lease_s"])})
            fleet.procs.append(proc)
            fleet.urls.append(u)
            fleet.names.append(name)
        served = httpx.get(f"{fleet.urls[0]}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"][0]["id"]
        warm = workload(2, 0, (8, 8), (4, 4), o["seed"] + 1)  # load kernels and caches before measuring
        for u in fleet.urls:
            asyncio.run(run_rest(u, key, served, warm, 2))
        for p in chosen:
            own = [Sample(f"[{p}] {s.prompt}", s.max_tokens, s.arrival) for s in samples]
            cpu0 = sum(_cpu_seconds(proc.pid) for proc in fleet.procs)
            ok0 = [_ok_counter(u) for u in fleet.urls]

            def kill_one(answered: int) -> None:
                if kill and fleet.killed is None and answered >= len(own) // 2:
                    fleet.killed = len(fleet.procs) - 1  # the one started last
                    victim = fleet.procs[fleet.killed]
                    fleet.cpu_at_kill = _cpu_seconds(victim.pid)
                    threading.Thread(target=victim.kill, daemon=True).start()  # SIGKILL

            if p == "rest":
                r = asyncio.run(run_rest(fleet.urls, key, served, own, o["concurrency"]))
            else:
                r = run_mqtt(mqtt_config, own, o["concurrency"], resend_s=o["resend_s"] if kill else 0.0,
                             on_answered=kill_one)
            alive = [j for j in range(n) if j != fleet.killed]
            cpu = sum(_cpu_seconds(fleet.procs[j].pid) for j in alive) + fleet.cpu_at_kill - cpu0
            row = summarise(r, o["slo_ttft"], o["slo_tpot"], o["slo_e2e"])
            row.update(replicas=n, killed=fleet.killed is not None, threads_per_replica=threads, cpu_s=cpu,
                       cpu_s_per_answer=cpu / max(1, row["ok"]), lost=sum(1 for x in r.outcomes if not x.ok))
            if p == "mqtt":
                store = open_store(url)
                try:
                    mine = [e for e in store.escalations(limit=100_000) if e["request_id"].startswith("bench-")]
                finally:
                    store.close()
                survivors = {fleet.names[j] for j in alive}
                # the killed replica's counter died with it: compare the survivors' with the rows they finished
                computed = sum(_ok_counter(fleet.urls[j]) - ok0[j] for j in alive)
                rows_by_survivors = sum(1 for e in mine if e["worker"] in survivors and e["state"] == "done")
                row.update(stored=len(mine), distinct=len({e["request_id"] for e in mine}),
                           computed_twice=int(computed - rows_by_survivors),
                           repeats=sum(max(0, c - 1) for c in r.replies))
            rows.append(row)
    finally:
        for proc in fleet.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in fleet.procs:
            try:
                proc.wait(60)
            except Exception:
                proc.kill()
        log.close()
        broker.stop()
    return rows


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
    threads: Optional[int] = typer.Option(None, help="torch threads per server [all cores / replicas]"),
    slo_ttft: float = typer.Option(5.0, help="SLO: time to first token, s (REST)"),
    slo_tpot: float = typer.Option(0.5, help="SLO: time per output token, s (REST)"),
    slo_e2e: float = typer.Option(30.0, help="SLO: end-to-end, s (MQTT)"),
    seed: int = typer.Option(0, help="workload seed"),
    replicas: str = typer.Option("1", help="replica counts to run, comma list (e.g. 1,2,3)"),
    db: str = typer.Option("sqlite", help="the replicas' database: sqlite (a fresh file), temp-postgresql (a fresh "
                                          "throwaway cluster) or a postgresql:// URL"),
    kill: bool = typer.Option(False, help="add a run at the largest replica count (at least 2) with one replica "
                                          "killed (SIGKILL) when half the escalations are answered (MQTT path)"),
    resend_s: float = typer.Option(5.0, help="kill run: re-send unanswered escalations this often, as the edge does"),
    claim_lease_s: float = typer.Option(10.0, help="the replicas' claim lease: a dead replica's claims are taken "
                                                   "over after it"),
    scale: bool = typer.Option(False, help="--requests and --concurrency are per replica: n replicas get n times "
                                           "the workload, so each keeps the batch one replica had (CPU per request "
                                           "then compares replicas, not batch sizes)"),
) -> None:
    """Serving load test: Poisson arrivals on the REST API (SSE) and the MQTT escalation path."""
    import tempfile

    from apiary.bench.common import report

    chosen = [p.strip() for p in paths.split(",") if p.strip()]
    if not chosen or any(p not in ("rest", "mqtt") for p in chosen):
        raise typer.BadParameter(f"--paths takes rest, mqtt or rest,mqtt; got {paths!r}")
    try:
        counts = [int(x) for x in replicas.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise typer.BadParameter(f"--replicas takes a comma list of counts >= 1; got {replicas!r}")
    if db not in ("sqlite", "temp-postgresql") and not db.startswith(("postgresql://", "postgres://")):
        raise typer.BadParameter(f"--db takes sqlite, temp-postgresql or a postgresql:// URL; got {db!r}")
    def samples_for(n: int) -> list[Sample]:
        k = n if scale else 1
        return workload(requests * k, rate * k, parse_range(prompt_words), parse_range(max_tokens), seed)

    o = dict(model=model, dtype=dtype, max_num_seqs=max_num_seqs, kv_cache_mb=kv_cache_mb, threads=threads,
             concurrency=concurrency, slo_ttft=slo_ttft, slo_tpot=slo_tpot, slo_e2e=slo_e2e, seed=seed,
             resend_s=resend_s, claim_lease_s=claim_lease_s)
    results: list[dict] = []
    pg = None
    with tempfile.TemporaryDirectory(prefix="apiary-bench-serve-") as td:
        try:
            if db == "temp-postgresql":
                from apiary.bench.pgserver import PostgresServer, find_bin_dir

                bin_dir = find_bin_dir()
                if bin_dir is None:
                    raise typer.BadParameter("no PostgreSQL server binaries (initdb, pg_ctl): install Debian's "
                                             "postgresql or pass --db postgresql://…")
                pg = PostgresServer(bin_dir, durable=True).start()
            for n in counts:
                results += _run_fleet(n, f"x{n}", chosen, samples_for(n), {**o, "concurrency": concurrency * (
                    n if scale else 1)}, Path(td), db, False, pg)
            if kill:
                n = max(2, max(counts))
                results += _run_fleet(n, f"x{n}-kill", ["mqtt"], samples_for(n), {**o, "concurrency": concurrency * (
                    n if scale else 1)}, Path(td), db, True, pg)
        finally:
            if pg is not None:
                pg.stop()
    columns = ["replicas", "path", "ok/requests", "req/s", "out tok/s", "TTFT p99", "e2e p50", "e2e p99",
               "goodput req/s", "CPU s/answer", "lost", "computed twice"]
    rows = [[f"{r['replicas']}{' (1 killed)' if r['killed'] else ''}", r["path"], f"{r['ok']}/{r['requests']}",
             r["req_per_s"], r["out_tok_per_s"], r["ttft_p99"], r["e2e_p50"], r["e2e_p99"], r["goodput_req_per_s"],
             r["cpu_s_per_answer"], r["lost"], r.get("computed_twice", "")] for r in results]
    report("serve", f"cloud serve: {requests} req/path{' per replica' if scale else ''}, rate {rate}/s, "
           f"concurrency {concurrency}{' per replica' if scale else ''}, {dtype}, "
           f"max_num_seqs {max_num_seqs}, db {db.split('@')[-1]}", columns, rows,
           {"results": results, "config": {"rate": rate, "requests": requests, "concurrency": concurrency,
                                           "prompt_words": prompt_words, "max_tokens": max_tokens, "model": model,
                                           "dtype": dtype, "max_num_seqs": max_num_seqs, "kv_cache_mb": kv_cache_mb,
                                           "slo": {"ttft": slo_ttft, "tpot": slo_tpot, "e2e": slo_e2e},
                                           "seed": seed, "replicas": counts, "db": db.split("@")[-1], "kill": kill,
                                           "resend_s": resend_s, "claim_lease_s": claim_lease_s, "scale": scale}})
    for r in results:
        if r["errors"]:
            typer.echo(f"{r['replicas']} replicas, {r['path']} errors: {r['errors']}", err=True)
