"""A decoded frame to the mesh's sensor event: names, site, timestamp, severity and flags.

This is the single mapping both the live bridge and the simulator's labelled
situations use, so what the edge model is evaluated on is exactly what it will see.
"""
from __future__ import annotations

import time
from typing import Mapping

from apiary.shared.protocol import SensorEvent

from apiary.firmware_bridge.frames import Frame
from apiary.firmware_bridge.thresholds import DEFAULT_THRESHOLDS, Thresholds, assess


def frame_to_event(frame: Frame, *, site: str, node: str, previous: tuple[float, Mapping[str, float]] | None = None,
                   thresholds: Thresholds = DEFAULT_THRESHOLDS, received_at: float | None = None,
                   truth: str | None = None) -> SensorEvent:
    """``previous`` is this device's last ``(timestamp, readings)``; a frame with timestamp 0
    (device without a clock) gets the bridge's receive time."""
    timestamp = float(frame.timestamp) if frame.timestamp else (received_at if received_at is not None else time.time())
    severity, flags = assess(frame.readings, missing=frame.missing, previous=previous, timestamp=timestamp,
                             thresholds=thresholds)
    return SensorEvent(site=site, device=node, seq=frame.seq, timestamp=timestamp, readings=dict(frame.readings),
                       severity=severity, flags=flags, truth=truth)
