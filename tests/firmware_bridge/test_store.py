"""The bridge's SQLite file: windows and spilled frames survive a reopen, the disk budget, versions."""
from __future__ import annotations

import sqlite3

import pytest

from apiary.firmware_bridge.errors import BridgeError
from apiary.firmware_bridge.frames import Frame
from apiary.firmware_bridge.store import BridgeStore, _pack


def frame(seq: int, device_id: int = 1) -> Frame:
    return Frame(device_id, seq, 1_750_000_000 + seq, {"hive_temp_c": 34.5}, ("solar_w",), 1, 1, 7)


def test_spilled_frames_come_back_in_order_and_leave_when_done(tmp_path):
    store = BridgeStore(tmp_path / "b.db", spill_budget_bytes=1 << 20)
    store.record([(1, 7, 10, 0b101, 5, 0)], [(frame(s), 100.0 + s) for s in range(5)])
    first = store.take(3)
    assert [s.frame for s in first] == [frame(s) for s in range(3)] and first[0].received == 100.0
    assert store.unread == 2 and store.spilled == 5
    store.done([s.row for s in first])
    store.close()
    again = BridgeStore(tmp_path / "b.db", spill_budget_bytes=1 << 20)
    assert again.devices() == [(1, 7, 10, 0b101, 5, 0)]
    assert [s.frame.seq for s in again.take(10)] == [3, 4] and again.spilled == 2


def test_frames_in_memory_at_stop_keep_their_place(tmp_path):
    store = BridgeStore(tmp_path / "b.db", spill_budget_bytes=1 << 20)
    store.record([], [(frame(s), 0.0) for s in (10, 11)])
    store.keep_unsent([(frame(s), 0.0) for s in (8, 9)], [(frame(12), 0.0)])
    store.close()
    again = BridgeStore(tmp_path / "b.db", spill_budget_bytes=1 << 20)
    assert [s.frame.seq for s in again.take(10)] == [8, 9, 10, 11, 12]


def test_budget_drops_the_oldest_unread_frames_and_says_how_many(tmp_path):
    one = len(_pack(frame(0)))
    store = BridgeStore(tmp_path / "b.db", spill_budget_bytes=4 * one)
    assert store.record([], [(frame(s), 0.0) for s in range(3)]) == 0
    in_memory = store.take(1)  # read back: no longer the budget's to drop
    assert store.record([], [(frame(s), 0.0) for s in range(3, 6)]) == 2
    assert [s.frame.seq for s in store.take(10)] == [3, 4, 5] and in_memory[0].frame.seq == 0
    assert store.spilled_bytes <= 4 * one


def test_a_file_of_another_schema_version_is_refused(tmp_path):
    db = sqlite3.connect(tmp_path / "b.db")
    db.execute("PRAGMA user_version = 99")
    db.close()
    with pytest.raises(BridgeError, match="schema version 99"):
        BridgeStore(tmp_path / "b.db", spill_budget_bytes=1 << 20)


def test_a_file_that_is_not_sqlite_is_a_clear_error(tmp_path):
    (tmp_path / "b.db").write_bytes(b"not a database" * 100)
    with pytest.raises(BridgeError, match="not usable"):
        BridgeStore(tmp_path / "b.db", spill_budget_bytes=1 << 20)
