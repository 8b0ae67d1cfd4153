"""What the bridge must not forget across restarts, in one SQLite file (WAL).

* **devices** - each device's sequence window and boot counter
  (:class:`apiary.firmware_bridge.sequence.SequenceTracker` rows), written in the same transaction
  as the frames they let in, so a frame replayed after a restart is still a replay.
* **spill** - frames past the bridge's memory buffer, oldest first. A row leaves only once its
  event was handed to MQTT, so frames spilled while the broker was away survive a crash or a
  restart. The table is bounded by a disk budget (bytes of stored frames); past it the oldest
  spilled frames are dropped and counted, as they would be from memory.

``synchronous=NORMAL``: a power cut may lose the last commits, never corrupt the file, and a
burst of thousands of frames a second stays cheap.
"""
from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import msgpack

from apiary.firmware_bridge.errors import BridgeError
from apiary.firmware_bridge.frames import Frame
from apiary.firmware_bridge.sequence import DeviceRow

SCHEMA = """
CREATE TABLE IF NOT EXISTS devices (
    device_id INTEGER PRIMARY KEY, boot INTEGER, last INTEGER NOT NULL, window BLOB NOT NULL,
    newest_ts INTEGER NOT NULL, epoch_ts INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS spill (id INTEGER PRIMARY KEY, received REAL NOT NULL, frame BLOB NOT NULL);
"""
SCHEMA_VERSION = 1  # PRAGMA user_version; a file of another version is refused, never guessed at


@dataclass(frozen=True, slots=True)
class Spilled:
    """A frame read back from the spill table; ``row`` is deleted once its event is published."""

    row: int
    frame: Frame
    received: float  # wall-clock seconds


def _pack(frame: Frame) -> bytes:
    return msgpack.packb([frame.device_id, frame.seq, frame.timestamp, frame.readings, list(frame.missing),
                          frame.unknown, frame.version, frame.boot])


def _unpack(data: bytes) -> Frame:
    device_id, seq, timestamp, readings, missing, unknown, version, boot = msgpack.unpackb(data)
    return Frame(device_id, seq, timestamp, readings, tuple(missing), unknown, version, boot)


class BridgeStore:
    """Sequence windows and spilled frames. Thread-safe (one connection, one lock)."""

    def __init__(self, path: str | Path, *, spill_budget_bytes: int) -> None:
        self.path = Path(path)
        self.spill_budget_bytes = spill_budget_bytes
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                self._db.close()
                raise BridgeError(f"bridge state file {self.path} has schema version {version}, this bridge knows "
                                  f"{SCHEMA_VERSION}: move it away to start afresh")
            self._db.executescript(SCHEMA)
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            self._devices = self._read_devices()
            count, size = self._db.execute("SELECT count(*), coalesce(sum(length(frame)), 0) FROM spill").fetchone()
        except (sqlite3.DatabaseError, OSError) as e:
            raise BridgeError(f"bridge state file {self.path} is not usable: {e}") from None
        self.spilled = count  # rows in the spill table
        self.spilled_bytes = size
        self.unread = count  # rows not handed out by take() yet
        self._loaded_up_to: int | None = None  # the highest row handed out by take(); None: nothing yet

    # -- sequence windows -----------------------------------------------------------------------
    def devices(self) -> list[DeviceRow]:
        """The windows saved by earlier runs (read when the file was opened)."""
        return list(self._devices)

    def _read_devices(self) -> list[DeviceRow]:
        rows = self._db.execute("SELECT device_id, boot, last, window, newest_ts, epoch_ts FROM devices").fetchall()
        return [(d, boot, last, int.from_bytes(window, "little"), ts, epoch) for d, boot, last, window, ts, epoch in rows]

    def record(self, devices: list[DeviceRow], spill: Iterable[tuple[Frame, float]] = ()) -> int:
        """Save changed device windows and append frames to the spill table, in one transaction.

        Returns how many spilled frames the disk budget pushed out (the oldest not yet read back).
        Raises sqlite3.Error (e.g. the disk is full): the caller counts those frames as dropped.
        """
        packed = [(wall, _pack(f)) for f, wall in spill]
        with self._lock:
            self._db.execute("BEGIN")
            try:
                if devices:
                    self._db.executemany(
                        "INSERT OR REPLACE INTO devices VALUES (?, ?, ?, ?, ?, ?)",
                        [(d, boot, last, window.to_bytes(8, "little"), ts, epoch)
                         for d, boot, last, window, ts, epoch in devices])
                if packed:
                    self._db.executemany("INSERT INTO spill (received, frame) VALUES (?, ?)", packed)
                pushed_out = self._enforce_budget(sum(len(p) for _, p in packed)) if packed else (0, 0)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self.spilled += len(packed) - pushed_out[0]
            self.unread += len(packed) - pushed_out[0]
            self.spilled_bytes += sum(len(p) for _, p in packed) - pushed_out[1]
        return pushed_out[0]

    def _enforce_budget(self, added: int) -> tuple[int, int]:
        over = self.spilled_bytes + added - self.spill_budget_bytes
        if over <= 0:
            return 0, 0
        floor = self._loaded_up_to or 0  # rows already read back are in memory: not ours to drop
        victims, freed = [], 0
        for row, size in self._db.execute("SELECT id, length(frame) FROM spill WHERE id > ? ORDER BY id", (floor,)):
            if freed >= over:
                break
            victims.append((row,))
            freed += size
        self._db.executemany("DELETE FROM spill WHERE id = ?", victims)
        return len(victims), freed

    # -- spill ----------------------------------------------------------------------------------
    def take(self, limit: int) -> list[Spilled]:
        """The next spilled frames in order, not yet handed out (they stay on disk until :meth:`done`)."""
        with self._lock:
            if self._loaded_up_to is None:
                rows = self._db.execute("SELECT id, received, frame FROM spill ORDER BY id LIMIT ?", (limit,))
            else:
                rows = self._db.execute("SELECT id, received, frame FROM spill WHERE id > ? ORDER BY id LIMIT ?",
                                        (self._loaded_up_to, limit))
            out = [Spilled(row, _unpack(frame), received) for row, received, frame in rows.fetchall()]
            if out:
                self._loaded_up_to = out[-1].row
            self.unread -= len(out)
        return out

    def done(self, rows: list[int]) -> None:
        """These spilled frames' events were published: forget them."""
        if not rows:
            return
        with self._lock:
            sizes = self._db.execute(f"SELECT coalesce(sum(length(frame)), 0) FROM spill WHERE id IN "
                                     f"({','.join('?' * len(rows))})", rows).fetchone()[0]
            self._db.execute(f"DELETE FROM spill WHERE id IN ({','.join('?' * len(rows))})", rows)
            self.spilled -= len(rows)
            self.spilled_bytes -= sizes

    def keep_unsent(self, older: list[tuple[Frame, float]], newer: list[tuple[Frame, float]]) -> None:
        """At stop: frames only in memory are kept for the next start, ``older`` (those ahead of every
        spilled frame) before the spill table's rows, ``newer`` after them."""
        if not older and not newer:
            return
        with self._lock:
            low = self._db.execute("SELECT coalesce(min(id), 1) FROM spill").fetchone()[0]
            rows = [(low - len(older) + i, wall, _pack(f)) for i, (f, wall) in enumerate(older)]
            self._db.execute("BEGIN")
            self._db.executemany("INSERT INTO spill (id, received, frame) VALUES (?, ?, ?)", rows)
            self._db.executemany("INSERT INTO spill (received, frame) VALUES (?, ?)",
                                 [(wall, _pack(f)) for f, wall in newer])
            self._db.execute("COMMIT")
            self.spilled += len(older) + len(newer)

    def close(self) -> None:
        with self._lock:
            self._db.close()
