"""Per-device sequence tracking: gaps, duplicates, late arrivals, restarts, u32 wrap-around."""
from __future__ import annotations

from firmware_bridge.sequence import SequenceTracker, Verdict


def run(tracker, pairs):
    return [tracker.check(dev, seq) for dev, seq in pairs]


def test_in_order_devices_are_independent():
    t = SequenceTracker()
    assert run(t, [(1, 10), (2, 500), (1, 11), (2, 501)]) == [Verdict.NEW] * 4
    assert t.counters.as_dict() == {"gaps": 0, "duplicates": 0, "late": 0, "restarts": 0}


def test_gap_is_counted_by_missing_frames():
    t = SequenceTracker()
    run(t, [(1, 10), (1, 11), (1, 15)])
    assert t.counters.gaps == 3


def test_duplicates_of_newest_and_of_recent_frames():
    t = SequenceTracker()
    assert run(t, [(1, 10), (1, 11), (1, 12), (1, 12), (1, 10)]) == [
        Verdict.NEW, Verdict.NEW, Verdict.NEW, Verdict.DUPLICATE, Verdict.DUPLICATE]
    assert t.counters.duplicates == 2


def test_late_frame_fills_its_gap_once():
    t = SequenceTracker()
    assert run(t, [(1, 10), (1, 13), (1, 11), (1, 11)]) == [Verdict.NEW, Verdict.NEW, Verdict.LATE, Verdict.DUPLICATE]
    assert t.counters.gaps == 1 and t.counters.late == 1 and t.counters.duplicates == 1


def test_far_behind_is_a_restart():
    t = SequenceTracker()
    assert run(t, [(1, 5000), (1, 0), (1, 1)]) == [Verdict.NEW, Verdict.RESTART, Verdict.NEW]
    assert t.counters.restarts == 1 and t.counters.gaps == 0


def test_wraps_around_u32():
    t = SequenceTracker()
    assert run(t, [(1, 0xFFFFFFFE), (1, 0xFFFFFFFF), (1, 0), (1, 2), (1, 0xFFFFFFFF)]) == [
        Verdict.NEW, Verdict.NEW, Verdict.NEW, Verdict.NEW, Verdict.DUPLICATE]
    assert t.counters.gaps == 1


def test_big_jump_forgets_the_window():
    t = SequenceTracker()
    run(t, [(1, 1), (1, 1000)])
    assert t.counters.gaps == 998
    assert t.check(1, 999) is Verdict.LATE
