"""The answer a beekeeper would want for a labelled situation: training targets for ``apiary finetune``.

A label gives only the assessment; the action, urgency and explanation are written from the
event itself (which flags it rests on), so the tuned model learns to say why, in the same few
words every time, and the urgency follows the bridge's severity. The
JSON has the edge grammar's field order (``apiary.shared.prompting.ACTION_FIELDS``) and its limits.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

from apiary.shared.prompting import ACTION_FIELDS, ACTION_JSON_SCHEMA
from apiary.shared.protocol import SensorEvent, Severity

ACTIONS: dict[str, str] = {
    "normal": "No action needed, inspect as planned",
    "heat_stress": "Shade the hive and open the entrance fully",
    "swarming": "Look for queen cells and prepare a swarm box",
    "robbing": "Reduce the entrance and look for fighting bees",
    "sensor_fault": "Check the sensor and its cable",
    "low_battery": "Charge or replace the monitor battery",
}
FAULT_WORDS = {"_missing": "gives no reading", "_implausible": "reads an impossible value"}


def explanation(label: str, event: SensorEvent, context: Sequence[SensorEvent] = ()) -> str:
    """One short sentence naming the evidence for ``label`` in ``event`` (the flags it rests on, in words).

    Deliberately few numbers: a 135M model copies digits badly, and the sentence is there to
    say why, not to restate the readings (the report carries them).
    """
    flags = set(event.flags)
    if label == "heat_stress":
        return "The brood nest is above the 37 C limit."
    if label == "swarming":
        parts = []
        if "acoustic_freq_hz_high" in flags:
            parts.append("loud piping")
        if "hive_weight_drop" in flags:
            parts.append("a sudden weight drop")
        if "bee_traffic_high" in flags:
            parts.append("a surge of bees")
        return (" and ".join(parts) or "the signs").capitalize() + " mean a swarm."
    if label == "robbing":
        return "Busy traffic and a higher hum without piping mean robbers."
    if label == "sensor_fault":
        for flag in sorted(flags):
            for suffix, words in FAULT_WORDS.items():
                if flag.endswith(suffix):
                    return f"The {flag[: -len(suffix)]} sensor {words}."
        return "A sensor reads wrong."
    if label == "low_battery":
        return "The monitor battery is almost empty."
    return "All readings are in their usual range."


def urgency(label: str, event: SensorEvent) -> str:
    if label in ("normal", "sensor_fault"):
        return "low"
    if label == "swarming":
        return "high"
    if label == "robbing":
        return "high" if "bee_traffic_high" in event.flags else "medium"
    return "high" if event.severity == Severity.CRITICAL else "medium"


def reference_action(label: str, event: SensorEvent, context: Sequence[SensorEvent] = ()) -> dict[str, Any]:
    """The training answer for a situation labelled ``label``, in the grammar's field order and limits."""
    if label not in ACTIONS:
        raise ValueError(f"unknown assessment {label!r}")
    props = ACTION_JSON_SCHEMA["properties"]
    doc = {"explanation": explanation(label, event, context)[: props["explanation"]["maxLength"]],
           "assessment": label, "urgency": urgency(label, event),
           "action": ACTIONS[label][: props["action"]["maxLength"]]}
    return {k: doc[k] for k in ACTION_FIELDS}


def answer_text(label: str, event: SensorEvent, context: Sequence[SensorEvent] = ()) -> str:
    """``reference_action`` as the JSON text the model is taught to write."""
    return json.dumps(reference_action(label, event, context))
