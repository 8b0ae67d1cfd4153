"""Store throughput: sensor events recorded per second into SQLite and PostgreSQL through the recorder's path.

Each event is a real envelope handed to ``Recorder.handle`` (identity check, decode, the store's
idempotent insert), as the MQTT thread does; no broker, so the number is the store's. ``--recorders N``
runs N recorders on one database, each recording every event (what N replicas do: each subscribes
plainly and all but one insert find the row there), in N threads of one process. PostgreSQL is a fresh
cluster with its default durability (``--db temp-postgresql``) or a database you name (migrated first).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer


def _envelopes(n: int, devices: int) -> list[tuple[str, object]]:
    from apiary.shared import topics
    from apiary.shared.protocol import SensorEvent, make

    out = []
    for i in range(n):
        device = f"hive-{i % devices}"
        ev = SensorEvent(site="bench", device=device, seq=i, timestamp=1_700_000_000.0 + i,
                         readings={"hive_temp_c": 34.5, "hum_hz": 240.0, "weight_kg": 41.2})
        out.append((topics.event("bench", device), make(ev, sender=device)))
    return out


def _measure(url: str, envelopes: list, recorders: int) -> dict:
    import threading

    from apiary.bench.common import percentile
    from apiary.cloud.metrics import Metrics
    from apiary.cloud.recorder import Recorder
    from apiary.cloud.store import open_store

    stores = [open_store(url) for _ in range(recorders)]
    metrics = Metrics()
    latencies: list[list[float]] = [[] for _ in stores]
    barrier = threading.Barrier(recorders + 1)

    def run(k: int) -> None:
        recorder = Recorder(stores[k], metrics)
        barrier.wait()
        for topic, env in envelopes:
            t = time.perf_counter()
            recorder.handle(topic, env)
            latencies[k].append(time.perf_counter() - t)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(recorders)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    stored = metrics.registry.get_sample_value("apiary_recorded_messages_total", {"kind": "sensor_event"}) or 0.0
    ignored = metrics.registry.get_sample_value("apiary_recorded_messages_total",
                                                {"kind": "sensor_event_ignored"}) or 0.0
    for s in stores:
        s.close()
    every = [x for lat in latencies for x in lat]
    return {"recorders": recorders, "events": len(envelopes), "stored": int(stored), "duplicates": int(ignored),
            "wall_s": wall, "events_per_s": len(envelopes) / wall, "writes_per_s": len(every) / wall,
            "write_p50_ms": 1000 * percentile(every, 50), "write_p99_ms": 1000 * percentile(every, 99)}


def command(
    events: int = typer.Option(3000, help="events per run"),
    devices: int = typer.Option(20, help="devices the events come from"),
    recorders: str = typer.Option("1,3", help="recorders per run (comma list): N replicas record every event"),
    backends: str = typer.Option("sqlite,postgresql", help="sqlite, postgresql or both"),
    db: str = typer.Option("temp-postgresql", help="PostgreSQL: temp-postgresql (a fresh cluster, default "
                                                   "durability) or a postgresql:// URL"),
) -> None:
    """Store throughput: sensor events recorded per second into SQLite and PostgreSQL through the recorder's path."""
    import tempfile

    from apiary.bench.common import report
    from apiary.cloud.db import migrate

    chosen = [b.strip() for b in backends.split(",") if b.strip()]
    if not chosen or any(b not in ("sqlite", "postgresql") for b in chosen):
        raise typer.BadParameter(f"--backends takes sqlite, postgresql or both; got {backends!r}")
    counts = [int(x) for x in recorders.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise typer.BadParameter(f"--recorders takes a comma list of counts >= 1; got {recorders!r}")
    envelopes = _envelopes(events, devices)
    results, server = [], None
    with tempfile.TemporaryDirectory(prefix="apiary-bench-store-") as td:
        try:
            for backend in chosen:
                for n in counts:
                    if backend == "sqlite":
                        url = f"sqlite:///{Path(td) / f'store-{n}.db'}"
                    elif db == "temp-postgresql":
                        server = server or _temp_postgres()
                        url = server.create_database()
                    else:
                        url = db
                    migrate.upgrade(url)
                    results.append({"backend": backend, **_measure(url, envelopes, n)})
        finally:
            if server is not None:
                server.stop()
    columns = ["backend", "recorders", "events", "stored", "events/s", "writes/s", "write p50 ms", "write p99 ms"]
    rows = [[r["backend"], r["recorders"], r["events"], r["stored"], r["events_per_s"], r["writes_per_s"],
             r["write_p50_ms"], r["write_p99_ms"]] for r in results]
    report("store", f"store: {events} events from {devices} devices through Recorder.handle", columns, rows,
           {"results": results, "config": {"events": events, "devices": devices, "recorders": counts,
                                           "db": db if "postgresql" in chosen else None}})
    if any(r["stored"] != r["events"] for r in results):
        raise typer.Exit(1)  # an event lost or stored twice is a failure, not a number


def _temp_postgres():
    from apiary.bench.pgserver import PostgresServer, find_bin_dir

    bin_dir = find_bin_dir()
    if bin_dir is None:
        raise typer.BadParameter("no PostgreSQL server binaries (initdb, pg_ctl): install Debian's postgresql or "
                                 "pass --db postgresql://…")
    return PostgresServer(bin_dir, durable=True).start()
