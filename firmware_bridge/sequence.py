"""Per-device sequence tracking: gaps, duplicates, late frames, device restarts and replays.

Each device numbers its frames with a u32 that wraps. The tracker keeps the highest
sequence seen and a 64-frame window of which recent numbers arrived (the anti-replay
window of IPsec), which is enough to tell a retransmitted frame (duplicate, dropped)
from a late one that fills an earlier gap (accepted).

A frame far behind the newest is either a device that rebooted and counts again, or
someone replaying recorded frames. Only evidence from the device tells them apart: a
higher **boot counter** (docs/frames.md), or, from firmware without one, a device clock
later than any frame accepted so far (after which frames stamped before that restart are
replays, even with a higher sequence number). Without that evidence the frame is a replay and
is dropped. The state survives bridge restarts through :meth:`SequenceTracker.rows` /
:meth:`SequenceTracker.restore` (the bridge's SQLite file), so a replay after a restart
is caught too.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from typing import Iterable

SEQ_MOD = 1 << 32
WINDOW = 64
_WINDOW_MASK = (1 << WINDOW) - 1

# device_id, boot, last seq, window bits, newest timestamp, timestamp of the restart (no boot counter)
DeviceRow = tuple[int, "int | None", int, int, int, int]


class Verdict(Enum):
    NEW = "new"  # next in order (possibly after a gap)
    LATE = "late"  # older than the newest, not seen before: fills a gap
    DUPLICATE = "duplicate"  # seen already: drop it
    RESTART = "restart"  # the device rebooted (higher boot counter, or a later clock) and counts again
    REPLAYED = "replayed"  # far behind, or from an earlier boot, with no sign of a reboot: drop it

    @property
    def accepted(self) -> bool:
        return self in (Verdict.NEW, Verdict.LATE, Verdict.RESTART)


@dataclass(slots=True)
class _Device:
    last: int
    boot: int | None = None
    window: int = 1  # bit k set: seq last-k has been seen
    newest_ts: int = 0  # the latest device timestamp accepted (0: the device has no clock)
    epoch_ts: int = 0  # firmware without a boot counter: the clock at its last restart; older frames are replays


@dataclass(slots=True)
class SequenceCounters:
    gaps: int = 0  # frames missing (sum of jump sizes), minus late arrivals that filled them
    duplicates: int = 0
    late: int = 0
    restarts: int = 0
    replayed: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class SequenceTracker:
    def __init__(self) -> None:
        self._devices: dict[int, _Device] = {}
        self.counters = SequenceCounters()
        self.changed: set[int] = set()  # devices whose state changed since the caller last took rows()

    def check(self, device_id: int, seq: int, *, boot: int | None = None, timestamp: int = 0) -> Verdict:
        """Classify (and record) one arriving frame."""
        verdict = self._classify(device_id, seq, boot, timestamp)
        if verdict.accepted:
            d = self._devices[device_id]
            d.newest_ts = max(d.newest_ts, timestamp)
            self.changed.add(device_id)
        return verdict

    def _classify(self, device_id: int, seq: int, boot: int | None, timestamp: int) -> Verdict:
        d = self._devices.get(device_id)
        if d is None:
            self._devices[device_id] = _Device(seq, boot)
            return Verdict.NEW
        if boot is not None and d.boot != boot:
            if d.boot is None or boot > d.boot:  # a new boot (or firmware that now sends the counter)
                return self._restart(device_id, seq, boot, 0)
            self.counters.replayed += 1
            return Verdict.REPLAYED
        if boot is None and (d.boot is not None or (timestamp and timestamp < d.epoch_ts)):
            self.counters.replayed += 1  # no counter from firmware that sends one, or stamped before its restart
            return Verdict.REPLAYED
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
        if boot is None and d.boot is None and timestamp and d.newest_ts and timestamp > d.newest_ts:
            return self._restart(device_id, seq, None, timestamp)  # no boot counter, but its clock moved on
        self.counters.replayed += 1
        return Verdict.REPLAYED

    def _restart(self, device_id: int, seq: int, boot: int | None, epoch_ts: int) -> Verdict:
        newest_ts = self._devices[device_id].newest_ts
        self.counters.restarts += 1
        self._devices[device_id] = _Device(seq, boot, newest_ts=newest_ts, epoch_ts=epoch_ts)
        return Verdict.RESTART

    def rows(self, device_ids: Iterable[int] | None = None) -> list[DeviceRow]:
        """The state of these devices (default: all), to be kept across restarts."""
        ids = self._devices if device_ids is None else device_ids
        return [(i, d.boot, d.last, d.window, d.newest_ts, d.epoch_ts) for i in ids
                if (d := self._devices.get(i)) is not None]

    def take_changed(self) -> list[DeviceRow]:
        """Rows of the devices changed since the last call."""
        rows = self.rows(self.changed)
        self.changed.clear()
        return rows

    def restore(self, rows: Iterable[DeviceRow]) -> None:
        """Continue from state kept by an earlier run."""
        for device_id, boot, last, window, newest_ts, epoch_ts in rows:
            self._devices[device_id] = _Device(last, boot, window & _WINDOW_MASK, newest_ts, epoch_ts)
