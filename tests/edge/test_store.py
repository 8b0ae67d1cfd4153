"""The SQLite inbox/outbox: exactly-once bookkeeping, bounds with the documented drop policy, durability."""
from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from apiary.edge.errors import EdgeError
from apiary.edge.store import DeviceStore, OutboxItem


def item(id_: str, *, kind: str = "answer", priority: int = 6, created: float = 0.0, event: str = "ev",
         deadline: float | None = None) -> OutboxItem:
    return OutboxItem(id=id_, kind=kind, topic="t/" + id_, payload=id_.encode(), priority=priority, event_id=event,
                      created=created or 1.0, deadline=deadline, fallback=b"fb" if kind == "escalation" else None)


def receive(store: DeviceStore, id_: str, *, seq: int = 0, priority: int = 6, ts: float | None = None) -> bool:
    return store.receive(id_, device="d", seq=seq, ts=ts if ts is not None else float(seq), priority=priority,
                         payload=id_.encode())


def test_inbox_dedups_and_orders_by_priority(tmp_path: Path) -> None:
    s = DeviceStore(tmp_path / "s.db")
    assert receive(s, "a", seq=1, priority=6)
    assert receive(s, "b", seq=2, priority=0)
    assert not receive(s, "a", seq=1, priority=6)  # redelivery
    assert s.next_event() == ("b", b"b")
    s.finish("b")
    assert s.next_event() == ("a", b"a")
    s.finish("a")
    assert s.next_event() is None and s.pending_events() == 0
    assert not receive(s, "a", seq=1)  # still known after being handled


def test_finish_queues_outgoing_atomically(tmp_path: Path) -> None:
    s = DeviceStore(tmp_path / "s.db")
    receive(s, "e1", seq=1)
    s.finish("e1", [item("x1")], counter="answered_edge")
    assert [i.id for i in s.pending()] == ["x1"]
    assert s.counters()["answered_edge"] == 1
    assert s.ack("x1") and not s.ack("x1")
    assert s.pending() == []


def test_context_is_recent_events_oldest_first(tmp_path: Path) -> None:
    s = DeviceStore(tmp_path / "s.db")
    for i in range(10):
        receive(s, f"e{i}", seq=i, ts=100.0 + i)
    assert s.context("d", before_ts=107.0, limit=3) == [b"e4", b"e5", b"e6"]
    assert s.context("other", before_ts=107.0, limit=3) == []
    assert s.context("d", before_ts=107.0, limit=0) == []


def test_outbox_bound_drops_lowest_priority_oldest_first(tmp_path: Path) -> None:
    s = DeviceStore(tmp_path / "s.db", outbox_max=3)
    s.add(item("crit", priority=0, created=1))
    s.add(item("info-old", priority=6, created=2))
    s.add(item("warn", priority=3, created=3))
    assert s.add(item("info-new", priority=6, created=4)) == ["info-old"]
    assert s.add(item("crit2", priority=0, created=5)) == ["info-new"]
    assert s.add(item("info-newest", priority=6, created=6)) == ["info-newest"]  # itself the least urgent
    assert [i.id for i in s.pending()] == ["crit", "crit2", "warn"]
    assert s.counters()["outbox_dropped"] == 3


def test_inbox_bound_counts_drops(tmp_path: Path) -> None:
    s = DeviceStore(tmp_path / "s.db", inbox_max=2)
    receive(s, "i1", seq=1, priority=6)
    receive(s, "c1", seq=2, priority=0)
    receive(s, "w1", seq=3, priority=3)
    assert s.pending_events() == 2 and s.counters()["inbox_dropped"] == 1
    assert s.next_event()[0] == "c1"


def test_resolve_is_exactly_once(tmp_path: Path) -> None:
    s = DeviceStore(tmp_path / "s.db")
    s.add(item("esc", kind="escalation", deadline=50.0))
    assert s.next_deadline() == 50.0
    assert s.resolve("esc", item("ans"), counter="answered_cloud")
    assert not s.resolve("esc", item("ans-again"))  # a repeated reply changes nothing
    assert [i.id for i in s.pending()] == ["ans"]
    assert s.counters()["answered_cloud"] == 1
    assert not s.resolve("ans", item("zzz"))  # only escalations resolve


def test_session_counter_persists(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    s = DeviceStore(path)
    assert s.next_session() == 1
    assert s.next_session() == 2
    s.close()
    assert DeviceStore(path).next_session() == 3


def test_wal_mode_and_not_a_database(tmp_path: Path) -> None:
    s = DeviceStore(tmp_path / "s.db")
    assert s._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(EdgeError, match="not a usable SQLite database"):
        DeviceStore(bad)


def test_committed_rows_survive_kill_9(tmp_path: Path) -> None:
    """A process that committed and is then SIGKILLed leaves every committed row behind."""
    path = tmp_path / "s.db"
    code = textwrap.dedent(f"""
        import os, signal
        from apiary.edge.store import DeviceStore, OutboxItem
        s = DeviceStore({str(path)!r})
        for i in range(50):
            s.receive(f"e{{i}}", device="d", seq=i, ts=float(i), priority=6, payload=b"x")
            s.finish(f"e{{i}}", [OutboxItem(id=f"o{{i}}", kind="answer", topic="t", payload=b"p", priority=6,
                                           event_id=f"e{{i}}")])
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    s = DeviceStore(path)
    assert len(s.pending()) == 50 and s.pending_events() == 0
    assert sqlite3.connect(path).execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_get_and_attempts(tmp_path: Path) -> None:
    s = DeviceStore(tmp_path / "s.db")
    s.add(item("esc", kind="escalation", deadline=9.0))
    s.sent("esc")
    s.sent("esc")
    got = s.get("esc")
    assert got is not None and got.attempts == 2 and got.fallback == b"fb" and got.deadline == 9.0
    assert s.get("nope") is None
