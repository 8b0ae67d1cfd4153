"""Which events need an answer at all: routine readings are logged, never shown to a model.

Most of a hive's day is routine; running even a small model on every reading would
spend the battery on saying "normal". The bridge already computes severity and flags
from thresholds (including watch levels: ``<name>_elevated``), so the edge trusts them:
a reading with severity ``info`` and no flags, after ``WATCH_CONTEXT`` quiet readings, is
routine; anything flagged, warning/critical, an operator question, or a quiet reading
right after flagged ones (an anomaly in progress dips below its limits now and then) needs
an answer. Skipping the model is only safe where the answer is surely "normal": measured
on labelled situations in tests/edge/test_triage.py and by ``apiary bench edge``.
"""
from __future__ import annotations

from typing import Sequence

from apiary.shared.protocol import SensorEvent, Severity

WATCH_CONTEXT = 2  # earlier readings of the device that keep it watched when they were flagged


def needs_answer(event: SensorEvent, context: Sequence[SensorEvent] = ()) -> bool:
    """True for anomalies (flags, warning/critical severity), operator questions, and readings whose
    device was flagged within its last ``WATCH_CONTEXT`` readings (``context``: oldest first)."""
    return why(event, context) != "routine reading"


def why(event: SensorEvent, context: Sequence[SensorEvent] = ()) -> str:
    """A short reason for logs: what made the event worth an answer (or that it was routine)."""
    if event.kind == "question":
        return "operator question"
    if event.flags:
        return f"flags {', '.join(event.flags)}"
    if event.severity != Severity.INFO:
        return f"severity {event.severity.value}"
    recent = [e for e in list(context)[-WATCH_CONTEXT:] if e.kind != "question" and e.device == event.device]
    flagged = sorted({f for e in recent for f in e.flags})
    if flagged:
        return f"recently flagged {', '.join(flagged)}"
    return "routine reading"
