"""Which events need an answer at all: routine readings are logged, never shown to a model.

Most of a hive's day is routine; running even a small model on every reading would
spend the battery on saying "normal". The bridge already computes severity and flags
from thresholds, so the edge trusts them: a reading with severity ``info`` and no
flags is routine; anything flagged, warning/critical, or an operator question needs
an answer.
"""
from __future__ import annotations

from shared.protocol import SensorEvent, Severity


def needs_answer(event: SensorEvent) -> bool:
    """True for anomalies (flags, warning/critical severity) and operator questions."""
    return event.kind == "question" or bool(event.flags) or event.severity != Severity.INFO


def why(event: SensorEvent) -> str:
    """A short reason for logs: what made the event worth an answer (or that it was routine)."""
    if event.kind == "question":
        return "operator question"
    if event.flags:
        return f"flags {', '.join(event.flags)}"
    if event.severity != Severity.INFO:
        return f"severity {event.severity.value}"
    return "routine reading"
