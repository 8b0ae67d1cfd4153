"""Per-device sequence tracking: gaps, duplicates, late arrivals, restarts, u32 wrap-around."""
from __future__ import annotations

from apiary.firmware_bridge.sequence import SequenceTracker, Verdict


def run(tracker, pairs):
    return [tracker.check(dev, seq) for dev, seq in pairs]


def test_in_order_devices_are_independent():
    t = SequenceTracker()
    assert run(t, [(1, 10), (2, 500), (1, 11), (2, 501)]) == [Verdict.NEW] * 4
    assert t.counters.as_dict() == {"gaps": 0, "duplicates": 0, "late": 0, "restarts": 0,
                                      "replayed": 0}


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


def test_far_behind_without_evidence_of_a_reboot_is_a_replay():
    """Replaying seq 1-50 after seq 500 used to re-publish all 50 as a 'restart' (#15, observation 6)."""
    t = SequenceTracker()
    run(t, [(1, s) for s in range(451, 501)])
    assert run(t, [(1, s) for s in range(1, 51)]) == [Verdict.REPLAYED] * 50
    assert t.counters.replayed == 50 and t.counters.restarts == 0


def test_a_higher_boot_counter_is_a_restart_and_an_older_boot_a_replay():
    t = SequenceTracker()
    assert t.check(1, 5000, boot=3) is Verdict.NEW
    assert t.check(1, 0, boot=4) is Verdict.RESTART
    assert t.check(1, 1, boot=4) is Verdict.NEW
    assert t.check(1, 5001, boot=3) is Verdict.REPLAYED  # ahead in seq, but from the boot before
    assert t.check(1, 2, boot=4) is Verdict.NEW
    assert t.counters.restarts == 1 and t.counters.replayed == 1 and t.counters.gaps == 0


def test_firmware_without_a_boot_counter_restarts_when_its_clock_moved_on():
    t = SequenceTracker()
    assert t.check(1, 5000, timestamp=1_000_000) is Verdict.NEW
    assert t.check(1, 0, timestamp=1_000_300) is Verdict.RESTART
    assert t.check(1, 4990, timestamp=999_000) is Verdict.REPLAYED  # far behind again, older clock
    assert t.check(1, 7, timestamp=0) is Verdict.NEW  # ahead: no clock needed
    assert t.check(1, (7 - 1000) % 2**32, timestamp=0) is Verdict.REPLAYED  # far behind, no clock: no evidence


def test_state_carries_over_to_a_new_tracker():
    """What the bridge keeps in SQLite: a replay after the bridge restarted is still a replay."""
    t = SequenceTracker()
    run(t, [(1, 10), (1, 12), (2, 7)])
    t.check(3, 99, boot=2, timestamp=5)
    assert sorted(r[0] for r in t.take_changed()) == [1, 2, 3] and t.take_changed() == []
    again = SequenceTracker()
    again.restore(t.rows())
    assert again.check(1, 12) is Verdict.DUPLICATE and again.check(1, 11) is Verdict.LATE
    assert again.check(3, 98, boot=1) is Verdict.REPLAYED and again.check(3, 0, boot=3) is Verdict.RESTART


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
