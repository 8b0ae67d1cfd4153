"""Per-device sequence tracking: gaps, duplicates, late frames and device restarts.

Each device numbers its frames with a u32 that wraps. The tracker keeps the highest
sequence seen and a 64-frame window of which recent numbers arrived (the anti-replay
window of IPsec), which is enough to tell a retransmitted frame (duplicate, dropped)
from a late one that fills an earlier gap (accepted) from a device that rebooted and
started counting again (accepted, counted as a restart).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum

SEQ_MOD = 1 << 32
WINDOW = 64
_WINDOW_MASK = (1 << WINDOW) - 1


class Verdict(Enum):
    NEW = "new"  # next in order (possibly after a gap)
    LATE = "late"  # older than the newest, not seen before: fills a gap
    DUPLICATE = "duplicate"  # seen already: drop it
    RESTART = "restart"  # far behind the newest: the device restarted its counter


@dataclass(slots=True)
class _Device:
    last: int
    window: int = 1  # bit k set: seq last-k has been seen


@dataclass(slots=True)
class SequenceCounters:
    gaps: int = 0  # frames missing (sum of jump sizes), minus late arrivals that filled them
    duplicates: int = 0
    late: int = 0
    restarts: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class SequenceTracker:
    def __init__(self) -> None:
        self._devices: dict[int, _Device] = {}
        self.counters = SequenceCounters()

    def check(self, device_id: int, seq: int) -> Verdict:
        """Classify (and record) one arriving frame."""
        d = self._devices.get(device_id)
        if d is None:
            self._devices[device_id] = _Device(seq)
            return Verdict.NEW
        ahead = (seq - d.last) % SEQ_MOD
        if ahead == 0:
            self.counters.duplicates += 1
            return Verdict.DUPLICATE
        if ahead < SEQ_MOD // 2:
            self.counters.gaps += ahead - 1
            d.window = ((d.window << ahead) | 1) & _WINDOW_MASK if ahead < WINDOW else 1
            d.last = seq
            return Verdict.NEW
        behind = SEQ_MOD - ahead
        if behind < WINDOW:
            if d.window >> behind & 1:
                self.counters.duplicates += 1
                return Verdict.DUPLICATE
            d.window |= 1 << behind
            self.counters.late += 1
            self.counters.gaps -= 1
            return Verdict.LATE
        self.counters.restarts += 1
        self._devices[device_id] = _Device(seq)
        return Verdict.RESTART
