"""Replicas in separate processes on one database: racing for the same escalations (PostgreSQL), opening one
fresh SQLite file together."""
from __future__ import annotations

import multiprocessing as mp

from apiary.cloud.store import open_store

REQUESTS = 40


def _race(url: str, worker: str, barrier, out) -> None:
    """One replica: claim every request, each under its own envelope id (a re-send), as fast as it can."""
    store = open_store(url)
    try:
        barrier.wait(60)
        won = [r for r in range(REQUESTS)
               if store.claim_escalation(f"{worker}-env-{r}", request_id=f"req-{r}", site="s", device="d",
                                         priority=1, reason="", worker=worker, lease_s=60).state == "claimed"]
        out.put((worker, won))
    finally:
        store.close()


def test_concurrent_claims_from_separate_processes_exactly_one_wins(postgres):
    from apiary.cloud.db import migrate

    url = postgres.create_database()
    migrate.upgrade(url)
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(url, f"w{i}", barrier, out)) for i in range(4)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    winners = sorted(r for won in results.values() for r in won)
    assert winners == list(range(REQUESTS))  # every request claimed once, by exactly one process
    store = open_store(url)
    try:
        rows = store.escalations(limit=1000)
        assert len(rows) == REQUESTS and all(r["state"] == "pending" for r in rows)
        assert {r["request_id"]: r["worker"] for r in rows} == {
            f"req-{r}": w for w, won in results.items() for r in won}
    finally:
        store.close()


def _open(path: str, out) -> None:
    from apiary.cloud.store import SqliteStore

    try:
        SqliteStore(path).close()
        out.put("ok")
    except Exception as e:  # reported to the test, not lost in a child's stderr
        out.put(repr(e))


def test_replicas_opening_one_fresh_sqlite_file_at_once_all_start(tmp_path):
    """SQLite is upgraded at start: four processes opening a new file together migrate it once and all run."""
    from apiary.cloud.db import migrate
    from tests.cloud.test_migrations import revision

    ctx = mp.get_context("spawn")
    path = str(tmp_path / "fresh.db")
    out = ctx.Queue()
    procs = [ctx.Process(target=_open, args=(path, out)) for _ in range(4)]
    for p in procs:
        p.start()
    assert sorted(out.get(timeout=120) for _ in procs) == ["ok"] * 4
    for p in procs:
        p.join(30)
    assert revision(f"sqlite:///{path}") == migrate.head()
