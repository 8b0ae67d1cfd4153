"""The prompt both tiers show the model, and the one parser for its JSON action.

The edge (llama.cpp) and the cloud (own engine) must ask the same question, decode under
the same JSON Schema and accept exactly the same answers, or a cascade would compare
apples with pears. So the chat messages for a sensor event, the schema (derived from
:class:`~shared.protocol.Action`) and the parsing of an Action live here, importable by
both without either importing the other.

The prompt is short on purpose: a 135M model reads a long prompt badly and prefill is
most of the edge's latency. The system message is identical for every event, so a
runtime with a prefix cache (llama.cpp's KV reuse, the cloud's prefix cache) pays for
it once.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

from pydantic import ValidationError

from apiary.shared.protocol import Action, ChatMessage, SensorEvent

# The one schema of an answer, derived from shared.protocol.Action (its fields, enums and limits),
# with what a generator needs on top: generation order and tighter lengths.
# Field order is generation order, and it matters: the explanation comes first so the model
# restates what it sees before it commits to an assessment. On the calibration split this took
# SmolLM2-135M from 10/20 to 14/20 correct anomaly assessments (assessment-first: 10/20).
ACTION_FIELDS: tuple[str, ...] = ("explanation", "assessment", "urgency", "action")
# A 135M model rambles: short strings keep answers fast and on point (Action itself allows more).
GENERATION_MAX_CHARS: dict[str, int] = {"explanation": 120, "action": 80}


def action_json_schema() -> dict[str, Any]:
    """The JSON Schema both tiers decode under: the edge's llama.cpp grammar is built from it, the
    cloud engine's llguidance matcher takes it as is. Built from ``Action.model_json_schema()``:
    enumerated fields keep their values; string fields get ``minLength`` 1 and the smaller of
    Action's ``max_length`` and :data:`GENERATION_MAX_CHARS`; every field is required, nothing else
    allowed, in :data:`ACTION_FIELDS` order."""
    source = Action.model_json_schema()["properties"]
    if set(source) != set(ACTION_FIELDS):
        raise ValueError(f"ACTION_FIELDS {ACTION_FIELDS} do not match Action's fields {sorted(source)}")
    properties: dict[str, Any] = {}
    for name in ACTION_FIELDS:
        field = source[name]
        if "enum" in field:
            properties[name] = {"enum": list(field["enum"])}
        else:
            limit = min(field.get("maxLength", GENERATION_MAX_CHARS[name]), GENERATION_MAX_CHARS[name])
            properties[name] = {"type": field["type"], "minLength": 1, "maxLength": limit}
    return {"type": "object", "properties": properties, "required": list(ACTION_FIELDS),
            "additionalProperties": False}


ACTION_JSON_SCHEMA: dict[str, Any] = action_json_schema()
_ACTION_PROPERTIES = Action.model_json_schema()["properties"]
ACTION_MAX_CHARS: int = _ACTION_PROPERTIES["action"]["maxLength"]  # what Action accepts (the grammar asks for less)
EXPLANATION_MAX_CHARS: int = _ACTION_PROPERTIES["explanation"]["maxLength"]

SYSTEM_PROMPT = (
    "You are the assistant of a solar-powered beehive monitor. Read the sensor report and answer "
    "with one JSON object: "
    '{"explanation": "...", "assessment": "...", "urgency": "...", "action": "..."}.\n'
    "assessment is one of:\n"
    "- normal: no flags, readings in range\n"
    "- heat_stress: hive_temp_c_high, the hive is too hot\n"
    "- swarming: acoustic_freq_hz_high piping or hive_weight_drop, a swarm is leaving\n"
    "- robbing: bee_traffic_high or a higher hum (acoustic_freq_hz_elevated) without piping, strangers robbing honey\n"
    "- sensor_fault: an _implausible or _missing flag, impossible readings\n"
    "- low_battery: battery_v_low, the monitor's battery is running out\n"
    "urgency is low, medium or high. action tells the beekeeper what to do in a few words. "
    "explanation is one short sentence."
)

# For models tuned on the task (``apiary finetune`` and their students): they know what each
# assessment means, so the system message only names the answer's shape and allowed values.
SHORT_SYSTEM_PROMPT = (
    "You are the assistant of a solar-powered beehive monitor. Read the sensor report and answer "
    'with one JSON object: {"explanation": "...", "assessment": "...", "urgency": "...", "action": "..."}. '
    "assessment is normal, heat_stress, swarming, robbing, sensor_fault or low_battery; "
    "urgency is low, medium or high."
)

# Worked examples shown as earlier turns of the chat, one per assessment: a 135M model
# follows examples far better than instructions. They never change, so a prefix cache
# serves them (and the system message) for free after the first request.
EXAMPLES: tuple[tuple[str, dict[str, str]], ...] = (
    ("Severity: info. Flags: none.\n"
     "Now: hive_temp_c=34.8 C, hive_humidity_pct=58.0 %, hive_weight_kg=44.0 kg, bee_traffic=1900.0 bees/min.\n"
     "Observed: nothing unusual.\n"
     "Beekeeper asks: Is the colony doing well?",
     {"assessment": "normal", "action": "No action needed, inspect as planned", "urgency": "low",
      "explanation": "All readings are in their usual range."}),
    ("Severity: critical. Flags: hive_temp_c_high, ambient_temp_c_high.\n"
     "Now: hive_temp_c=40.3 C, hive_humidity_pct=37.0 %, ambient_temp_c=40.9 C, bee_traffic=450.0 bees/min.\n"
     "Observed: the hive is too hot; the weather is hot.",
     {"assessment": "heat_stress", "action": "Shade the hive and open the entrance fully", "urgency": "high",
      "explanation": "The brood nest is at 40 C, above the 37 C limit."}),
    ("Severity: warning. Flags: bee_traffic_high.\n"
     "Now: hive_temp_c=35.3 C, hive_weight_kg=48.2 kg, acoustic_freq_hz=290.0 Hz, bee_traffic=6900.0 bees/min.\n"
     "Change over the last 15 min: hive_weight_kg -0.1, bee_traffic +4800.0.\n"
     "Observed: very many bees at the entrance.",
     {"assessment": "robbing", "action": "Reduce the entrance and look for fighting bees", "urgency": "medium",
      "explanation": "Traffic jumped while the hive gains no weight."}),
    ("Severity: warning. Flags: hive_humidity_pct_missing.\n"
     "Now: hive_temp_c=34.6 C, ambient_temp_c=18.0 C, hive_weight_kg=45.0 kg, battery_v=4.1 V.\n"
     "Observed: the hive_humidity_pct sensor gives no reading.",
     {"assessment": "sensor_fault", "action": "Check the humidity sensor and its cable", "urgency": "low",
      "explanation": "The humidity reading is missing."}),
    ("Severity: warning. Flags: acoustic_freq_hz_high, bee_traffic_high.\n"
     "Now: hive_temp_c=36.2 C, hive_weight_kg=47.5 kg, acoustic_db=65.0 dB, acoustic_freq_hz=430.0 Hz, "
     "bee_traffic=12500.0 bees/min.\n"
     "Observed: loud high-pitched piping; very many bees at the entrance.",
     {"assessment": "swarming", "action": "Look for queen cells and prepare a swarm box", "urgency": "high",
      "explanation": "Piping at 430 Hz and a surge of bees mean a swarm."}),
    ("Severity: critical. Flags: battery_v_low.\n"
     "Now: hive_temp_c=34.0 C, hive_weight_kg=50.1 kg, battery_v=3.1 V, solar_w=0.0 W.\n"
     "Observed: the monitor battery is almost empty.",
     {"assessment": "low_battery", "action": "Charge or replace the monitor battery", "urgency": "medium",
      "explanation": "The battery is at 3.1 V with no solar input."}),
    ("Severity: warning. Flags: hive_temp_c_implausible.\n"
     "Now: hive_temp_c=-127.0 C, hive_humidity_pct=60.0 %, hive_weight_kg=52.0 kg, battery_v=4.2 V.\n"
     "Observed: the hive_temp_c sensor reads an impossible value.",
     {"assessment": "sensor_fault", "action": "Replace the hive temperature probe", "urgency": "low",
      "explanation": "-127 C is not a possible hive temperature."}),
)

# Flags in words: a small model links "the battery is almost empty" to low_battery far more
# reliably than "battery_v_low".
FLAG_WORDS: dict[str, str] = {
    "hive_temp_c_high": "the hive is too hot", "hive_temp_c_low": "the hive is too cold",
    "ambient_temp_c_high": "the weather is hot", "ambient_temp_c_low": "the weather is freezing",
    "battery_v_low": "the monitor battery is almost empty", "bee_traffic_high": "very many bees at the entrance",
    "acoustic_freq_hz_high": "loud high-pitched piping", "acoustic_db_high": "the hive is loud",
    "hive_weight_drop": "the hive suddenly lost weight", "hive_humidity_pct_high": "the hive is very damp",
    "hive_humidity_pct_low": "the hive is very dry",
    "bee_traffic_elevated": "more bees at the entrance than usual",
    "acoustic_freq_hz_elevated": "the hive hums higher than usual",
}


def describe_flag(flag: str) -> str:
    if flag in FLAG_WORDS:
        return FLAG_WORDS[flag]
    for suffix, words in (("_implausible", "reads an impossible value"), ("_missing", "gives no reading")):
        if flag.endswith(suffix):
            return f"the {flag[: -len(suffix)]} sensor {words}"
    return flag.replace("_", " ")


READING_UNITS: dict[str, str] = {
    "hive_temp_c": "C", "hive_humidity_pct": "%", "ambient_temp_c": "C", "hive_weight_kg": "kg",
    "acoustic_db": "dB", "acoustic_freq_hz": "Hz", "bee_traffic": "bees/min", "battery_v": "V", "solar_w": "W",
}
# Readings whose change over the context window says most (a swarm drops weight, robbing spikes traffic).
TREND_READINGS = ("hive_weight_kg", "hive_temp_c", "bee_traffic", "acoustic_freq_hz")
MAX_CONTEXT_IN_PROMPT = 3


def _fmt(value: float) -> str:
    return f"{value:.1f}" if abs(value) < 1000 else f"{value:.0f}"


def describe_readings(readings: dict[str, float]) -> str:
    """``hive_temp_c=39.2 C, …`` in a fixed order, unknown readings last."""
    names = [n for n in READING_UNITS if n in readings] + sorted(n for n in readings if n not in READING_UNITS)
    return ", ".join(f"{n}={_fmt(readings[n])}{(' ' + READING_UNITS[n]) if n in READING_UNITS else ''}"
                     for n in names)


def describe_trend(event: SensorEvent, context: Sequence[SensorEvent]) -> str:
    """Change of the telling readings since the oldest context event, e.g. ``hive_weight_kg -2.1``."""
    if not context:
        return ""
    first = context[0]
    minutes = max(0.0, (event.timestamp - first.timestamp) / 60.0)
    parts = []
    for name in TREND_READINGS:
        if name in event.readings and name in first.readings:
            delta = event.readings[name] - first.readings[name]
            parts.append(f"{name} {delta:+.1f}")
    return f"change over the last {minutes:.0f} min: " + ", ".join(parts) if parts else ""


PREFIX: tuple[ChatMessage, ...] = (ChatMessage(role="system", content=SYSTEM_PROMPT),) + tuple(
    m for user, answer in EXAMPLES for m in (
        ChatMessage(role="user", content=user),
        ChatMessage(role="assistant", content=json.dumps({k: answer[k] for k in ACTION_FIELDS}))))


PROMPT_STYLES = ("examples", "short")
# GGUF metadata key (a string, one of PROMPT_STYLES): the prompt style a model was tuned for.
# `apiary quantize` writes it from the folder's config.json; the edge's LocalModel reads it.
PROMPT_STYLE_KEY = "apiary.prompt_style"


def build_messages(event: SensorEvent, context: Sequence[SensorEvent] = (), *,
                   style: str = "examples") -> list[ChatMessage]:
    """The chat for one event: the fixed prefix, then the event's severity and flags, its
    readings, a short trend, the flags in words and any operator question.

    ``style``: ``examples`` (system message and seven worked examples, ~1,400 tokens: what an
    untuned model needs) or ``short`` (a short system message alone, ~270 tokens: for models
    fine-tuned on the task, ``apiary finetune``, and students distilled from them).
    ``context`` is the device's recent events, oldest first; only the last few are shown.
    """
    if style not in PROMPT_STYLES:
        raise ValueError(f"prompt style must be one of {PROMPT_STYLES}, got {style!r}")
    context = [c for c in context if c.kind == "reading"][-MAX_CONTEXT_IN_PROMPT:]
    lines = [f"Severity: {event.severity.value}. Flags: {', '.join(event.flags) if event.flags else 'none'}."]
    if event.readings:
        lines.append(f"Now: {describe_readings(event.readings)}.")
    trend = describe_trend(event, context)
    if trend:
        lines.append(trend[0].upper() + trend[1:] + ".")
    lines.append(f"Observed: {'; '.join(describe_flag(f) for f in event.flags) or 'nothing unusual'}.")
    if event.kind == "question" and event.question:
        lines.append(f"Beekeeper asks: {event.question.strip()}")
    prefix = PREFIX if style == "examples" else (ChatMessage(role="system", content=SHORT_SYSTEM_PROMPT),)
    return [*prefix, ChatMessage(role="user", content="\n".join(lines))]


_DECODER = json.JSONDecoder()
MAX_OBJECT_STARTS = 16  # how many "{" to try before giving up (bounded work on hostile text)


def _normalise(value: Any) -> Any:
    return value.strip().lower().replace(" ", "_").replace("-", "_") if isinstance(value, str) else value


def _validate(doc: dict[str, Any]) -> Action | None:
    doc = {**doc, "assessment": _normalise(doc.get("assessment")), "urgency": _normalise(doc.get("urgency"))}
    for key in ("action", "explanation"):
        if isinstance(doc.get(key), str):
            doc[key] = doc[key].strip()
    if not doc.get("action"):
        return None
    try:
        return Action.model_validate(doc)
    except ValidationError:
        return None


def parse_action(text: str) -> Action | None:
    """The first :class:`Action` JSON object in a model's answer, or ``None`` when there is none.

    Tolerates what models wrap around JSON (prose, code fences) and case/space variants
    of the enumerated values ("Heat stress" -> ``heat_stress``); anything that does not
    validate is ``None``, never an exception.
    """
    if not isinstance(text, str):
        return None
    start = text.find("{")
    for _ in range(MAX_OBJECT_STARTS):
        if start < 0:
            return None
        try:
            doc, _end = _DECODER.raw_decode(text, start)
        except (json.JSONDecodeError, RecursionError):
            doc = None
        if isinstance(doc, dict):
            action = _validate(doc)
            if action is not None:
                return action
        start = text.find("{", start + 1)
    return None
