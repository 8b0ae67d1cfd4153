"""The re-send schedule of unanswered escalations: at once on a new link, then after a doubling interval."""
from __future__ import annotations

from apiary.edge.resend import MAX_BACKOFF, ResendSchedule


def test_first_send_and_every_new_link_are_due_at_once() -> None:
    s = ResendSchedule(10.0)
    assert s.due("e1", link_gen=1, now=0.0)
    s.sent("e1", 1, 0.0)
    assert not s.due("e1", 1, 0.1)
    assert s.due("e1", 2, 0.1)  # the link came back: send again now


def test_the_interval_doubles_after_each_unanswered_send_up_to_the_cap() -> None:
    s, now, gaps = ResendSchedule(10.0), 0.0, []
    s.sent("e1", 1, now)
    for _ in range(6):
        gap = s.wait(["e1"], now)
        assert not s.due("e1", 1, now + gap - 0.01) and s.due("e1", 1, now + gap)
        gaps.append(gap)
        now += gap
        s.sent("e1", 1, now)
    assert gaps == [10.0, 20.0, 40.0, 80.0, 10.0 * MAX_BACKOFF, 10.0 * MAX_BACKOFF]


def test_answered_or_vanished_escalations_are_forgotten() -> None:
    s = ResendSchedule(10.0)
    s.sent("e1", 1, 0.0)
    s.sent("e2", 1, 5.0)
    assert s.wait(["e1", "e2"], 5.0) == 5.0
    s.forget("e1")
    assert s.wait(["e1", "e2"], 5.0) == 10.0
    assert s.wait([], 5.0) is None and s.due("e2", 1, 5.0)  # dropped from the outbox: a fresh start
