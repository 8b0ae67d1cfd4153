"""When an unanswered escalation goes out again: at once on every new link, then on a timer.

The cloud can lose an escalation the broker delivered while the edge's own link never drops
(a worker killed before it claimed it; a broker restart with the cloud back after the edge, so
the broker had no subscriber). Re-sending only after the edge's reconnect left such an
escalation to the deadline fallback. A re-send is the byte-identical envelope (same id, same
request id): the cloud answers a repeat from its store or joins the computation in flight, and
the edge turns the first reply into the final answer. The interval doubles after each send
that got no answer, up to ``MAX_BACKOFF`` times the base, so a long cloud outage is no flood.
The caller stops re-sending at the escalation's deadline.
"""
from __future__ import annotations

from typing import Iterable

MAX_BACKOFF = 8  # the longest wait between two sends, in multiples of the base interval


class ResendSchedule:
    """Per escalation id: the link it was last sent on, when, and how often in a row (in memory: a restarted
    agent sends everything once at its first connect anyway)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._sent: dict[str, tuple[int, float, int]] = {}  # id -> (link generation, monotonic time, sends)

    def due(self, item_id: str, link_gen: int, now: float) -> bool:
        """Send ``item_id`` now? Yes when never sent on this link, or its interval has passed."""
        last = self._sent.get(item_id)
        return last is None or last[0] != link_gen or now >= self._next(last)

    def sent(self, item_id: str, link_gen: int, now: float) -> None:
        _, _, sends = self._sent.get(item_id, (link_gen, now, 0))
        self._sent[item_id] = (link_gen, now, sends + 1)

    def forget(self, item_id: str) -> None:
        """It was answered (or given up): no more sends."""
        self._sent.pop(item_id, None)

    def wait(self, item_ids: Iterable[str], now: float) -> float | None:
        """Seconds until the first of ``item_ids`` (the escalations still waiting) is due again; None when
        none was sent yet (those go out with the next flush anyway). Forgets ids no longer waiting."""
        waiting = set(item_ids)
        self._sent = {k: v for k, v in self._sent.items() if k in waiting}
        return min((self._next(v) - now for v in self._sent.values()), default=None)

    def _next(self, last: tuple[int, float, int]) -> float:
        _, at, sends = last
        return at + self.interval_s * min(2 ** (sends - 1), MAX_BACKOFF)
