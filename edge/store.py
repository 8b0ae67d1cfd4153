"""Everything the device must not lose across kill -9 or a power cut, in one SQLite file (WAL).

* **inbox** - each received event is written (and committed) by the MQTT handler before
  the broker gets its PUBACK; a crash after that loses nothing, a crash before makes the
  broker redeliver. Redeliveries are dropped by envelope id. Answered events stay a while
  as the device's rolling context.
* **outbox** - every answer and escalation is written *before* it is sent, in the same
  transaction that marks its event handled, so an event produces its outgoing message
  exactly once. Answers leave on the broker's PUBACK; escalations leave when the
  cloud's reply is turned into the final answer (one transaction again), so a repeated
  reply finds nothing and is ignored. Payloads are stored encoded: a resend is the
  byte-identical envelope, which the cloud de-duplicates by id.
* **bounded** - both queues hold at most ``*_max`` items. Over the limit the lowest
  priority (largest number), oldest first, is dropped, counted in ``meta`` and reported
  in the device's state counters.
* **meta** - counters and the birth/death session number.

``synchronous=FULL``: a solar device loses power for real, so each commit is fsynced.
"""
from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from apiary.edge.errors import EdgeError

SCHEMA = """
CREATE TABLE IF NOT EXISTS inbox (
    id TEXT PRIMARY KEY, device TEXT NOT NULL, seq INTEGER NOT NULL, ts REAL NOT NULL,
    priority INTEGER NOT NULL, received REAL NOT NULL, state TEXT NOT NULL, payload BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS inbox_pending ON inbox(state, priority, received);
CREATE INDEX IF NOT EXISTS inbox_context ON inbox(device, ts);
CREATE TABLE IF NOT EXISTS outbox (
    id TEXT PRIMARY KEY, kind TEXT NOT NULL, topic TEXT NOT NULL, payload BLOB NOT NULL,
    priority INTEGER NOT NULL, created REAL NOT NULL, deadline REAL, event_id TEXT NOT NULL,
    fallback BLOB, attempts INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS outbox_order ON outbox(priority, created);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""

KEEP_DONE = 200  # answered events kept per device as context and for duplicate detection


@dataclass(slots=True)
class OutboxItem:
    """One message waiting to leave: an ``answer`` (until PUBACK) or an ``escalation`` (until the reply)."""

    id: str  # the envelope id; also the escalation's correlation id
    kind: str  # "answer" | "escalation"
    topic: str
    payload: bytes  # the encoded envelope, resent byte for byte
    priority: int
    event_id: str
    created: float = 0.0
    deadline: float | None = None  # escalations: fall back to the local answer after this (unix s)
    fallback: bytes | None = None  # escalations: the encoded local answer (InferenceResult body envelope)
    attempts: int = 0


class DeviceStore:
    """The device's durable inbox, outbox and counters. Thread-safe (one connection, one lock)."""

    def __init__(self, path: str | Path, *, outbox_max: int = 1000, inbox_max: int = 1000,
                 keep_done: int = KEEP_DONE) -> None:
        self.path = Path(path)
        self.outbox_max, self.inbox_max, self.keep_done = outbox_max, inbox_max, keep_done
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)
        except sqlite3.DatabaseError as e:
            raise EdgeError(f"state file {self.path} is not a usable SQLite database: {e}") from None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------ transactions

    def _tx(self):
        return _Transaction(self)

    # ------------------------------------------------------------------ inbox

    def receive(self, event_id: str, *, device: str, seq: int, ts: float, priority: int, payload: bytes) -> bool:
        """Persist a received event; False if it was seen before (a redelivery)."""
        with self._tx() as db:
            cur = db.execute("INSERT OR IGNORE INTO inbox VALUES (?, ?, ?, ?, ?, ?, 'pending', ?)",
                             (event_id, device, seq, ts, priority, time.time(), payload))
            if cur.rowcount == 0:
                return False
            self._bound(db, "inbox", "state = 'pending'", self.inbox_max, "inbox_dropped")
            return True

    def next_event(self) -> tuple[str, bytes] | None:
        """The most urgent pending event (priority, then arrival)."""
        with self._lock:
            row = self._db.execute("SELECT id, payload FROM inbox WHERE state = 'pending' "
                                   "ORDER BY priority, received, rowid LIMIT 1").fetchone()
        return (row[0], row[1]) if row else None

    def pending_events(self) -> int:
        with self._lock:
            return self._db.execute("SELECT count(*) FROM inbox WHERE state = 'pending'").fetchone()[0]

    def context(self, device: str, before_ts: float, limit: int) -> list[bytes]:
        """The device's last ``limit`` events before ``before_ts`` (any state), oldest first."""
        if limit <= 0:
            return []
        with self._lock:
            rows = self._db.execute("SELECT payload FROM inbox WHERE device = ? AND ts < ? "
                                    "ORDER BY ts DESC, seq DESC LIMIT ?", (device, before_ts, limit)).fetchall()
        return [r[0] for r in reversed(rows)]

    def finish(self, event_id: str, outgoing: Iterable[OutboxItem] = (), *, counter: str | None = None) -> list[str]:
        """Mark an event handled and queue its outgoing messages, atomically; returns ids dropped by the bound."""
        with self._tx() as db:
            db.execute("UPDATE inbox SET state = 'done' WHERE id = ?", (event_id,))
            for item in outgoing:
                self._insert(db, item)
            if counter:
                self._bump(db, counter)
            dropped = self._bound(db, "outbox", "1", self.outbox_max, "outbox_dropped")
            db.execute("DELETE FROM inbox WHERE state = 'done' AND id IN (SELECT id FROM inbox WHERE state = 'done' "
                       "AND device = (SELECT device FROM inbox WHERE id = ?) ORDER BY ts DESC LIMIT -1 OFFSET ?)",
                       (event_id, self.keep_done))
            return dropped

    # ------------------------------------------------------------------ outbox

    def _insert(self, db: sqlite3.Connection, item: OutboxItem) -> None:
        db.execute("INSERT OR IGNORE INTO outbox VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   (item.id, item.kind, item.topic, item.payload, item.priority, item.created or time.time(),
                    item.deadline, item.event_id, item.fallback, item.attempts))

    def add(self, item: OutboxItem) -> list[str]:
        """Queue one message outside an event's transaction (e.g. a state update)."""
        with self._tx() as db:
            self._insert(db, item)
            return self._bound(db, "outbox", "1", self.outbox_max, "outbox_dropped")

    def pending(self, kind: str | None = None) -> list[OutboxItem]:
        """Everything waiting to leave, most urgent first."""
        sql = "SELECT * FROM outbox" + (" WHERE kind = ?" if kind else "") + " ORDER BY priority, created, rowid"
        with self._lock:
            rows = self._db.execute(sql, (kind,) if kind else ()).fetchall()
        return [_item(r) for r in rows]

    def get(self, item_id: str) -> OutboxItem | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM outbox WHERE id = ?", (item_id,)).fetchone()
        return _item(row) if row else None

    def sent(self, item_id: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE outbox SET attempts = attempts + 1 WHERE id = ?", (item_id,))

    def ack(self, item_id: str) -> bool:
        """Remove an acknowledged message; False if it was already gone."""
        with self._tx() as db:
            return db.execute("DELETE FROM outbox WHERE id = ?", (item_id,)).rowcount > 0

    def resolve(self, escalation_id: str, answer: OutboxItem, *, counter: str | None = None) -> bool:
        """Replace a pending escalation by its final answer, atomically. False when the escalation is
        unknown (already resolved: a repeated reply, or the deadline fallback won) - nothing changes."""
        with self._tx() as db:
            if db.execute("DELETE FROM outbox WHERE id = ? AND kind = 'escalation'", (escalation_id,)).rowcount == 0:
                return False
            self._insert(db, answer)
            if counter:
                self._bump(db, counter)
            return True

    def next_deadline(self) -> float | None:
        with self._lock:
            row = self._db.execute("SELECT min(deadline) FROM outbox WHERE kind = 'escalation'").fetchone()
        return row[0]

    def count(self, kind: str | None = None) -> int:
        sql = "SELECT count(*) FROM outbox" + (" WHERE kind = ?" if kind else "")
        with self._lock:
            return self._db.execute(sql, (kind,) if kind else ()).fetchone()[0]

    # ------------------------------------------------------------------ bounds and counters

    def _bound(self, db: sqlite3.Connection, table: str, where: str, limit: int, counter: str) -> list[str]:
        excess = db.execute(f"SELECT count(*) FROM {table} WHERE {where}").fetchone()[0] - limit
        if excess <= 0:
            return []
        order = "priority DESC, received ASC, rowid ASC" if table == "inbox" else "priority DESC, created ASC, rowid ASC"
        victims = [r[0] for r in db.execute(f"SELECT id FROM {table} WHERE {where} ORDER BY {order} LIMIT ?",
                                            (excess,))]
        db.executemany(f"DELETE FROM {table} WHERE id = ?", [(v,) for v in victims])
        self._bump(db, counter, len(victims))
        return victims

    def _bump(self, db: sqlite3.Connection, key: str, n: int = 1) -> None:
        db.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = value + excluded.value",
                   (key, n))

    def bump(self, key: str, n: int = 1) -> None:
        with self._tx() as db:
            self._bump(db, key, n)

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in self._db.execute("SELECT key, value FROM meta WHERE key != 'session'")}

    def next_session(self) -> int:
        """The birth/death sequence number for this process: one more than the last run's."""
        with self._tx() as db:
            self._bump(db, "session")
            return db.execute("SELECT value FROM meta WHERE key = 'session'").fetchone()[0]


def _item(r: tuple) -> OutboxItem:
    return OutboxItem(id=r[0], kind=r[1], topic=r[2], payload=r[3], priority=r[4], created=r[5], deadline=r[6],
                      event_id=r[7], fallback=r[8], attempts=r[9])


class _Transaction:
    """``with store._tx() as db``: one IMMEDIATE transaction under the store's lock."""

    __slots__ = ("store",)

    def __init__(self, store: DeviceStore) -> None:
        self.store = store

    def __enter__(self) -> sqlite3.Connection:
        self.store._lock.acquire()
        try:
            self.store._db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.store._lock.release()
            raise
        return self.store._db

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.store._db.execute("COMMIT" if exc_type is None else "ROLLBACK")
        finally:
            self.store._lock.release()
