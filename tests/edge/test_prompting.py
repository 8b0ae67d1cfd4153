"""apiary.shared.prompting: the prompt both tiers use and the one action parser (no model needed)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from apiary.shared.prompting import (ACTION_FIELDS, ACTION_JSON_SCHEMA, EXAMPLES, PREFIX, build_messages, describe_flag,
                              parse_action)
from apiary.shared.protocol import ASSESSMENTS, Action, Severity
from tests.edge.helpers import question, reading

GOOD = {"assessment": "heat_stress", "action": "Shade the hive", "urgency": "high", "explanation": "Hive at 40 C."}


def test_parse_plain_json() -> None:
    a = parse_action(json.dumps(GOOD))
    assert a == Action(**GOOD)


def test_parse_tolerates_wrapping_and_case() -> None:
    text = "Here you go:\n```json\n" + json.dumps({**GOOD, "assessment": "Heat stress", "urgency": " HIGH"}) + "\n```"
    a = parse_action(text)
    assert a is not None and a.assessment == "heat_stress" and a.urgency == "high"


def test_parse_rejects_what_does_not_validate() -> None:
    assert parse_action("") is None
    assert parse_action("no json here") is None
    assert parse_action('{"assessment": "normal"') is None  # cut off
    assert parse_action(json.dumps({**GOOD, "assessment": "on_fire"})) is None
    assert parse_action(json.dumps({**GOOD, "urgency": "whenever"})) is None
    assert parse_action(json.dumps({**GOOD, "action": ""})) is None
    assert parse_action(json.dumps({**GOOD, "action": "x" * 201})) is None
    assert parse_action("[1, 2]") is None
    assert parse_action("{" * 5000) is None
    assert parse_action(None) is None  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_parse_never_raises(text: str) -> None:
    result = parse_action(text)
    assert result is None or isinstance(result, Action)


def test_schema_matches_protocol() -> None:
    assert ACTION_FIELDS == ("explanation", "assessment", "urgency", "action")  # explanation first: see module
    assert ACTION_JSON_SCHEMA["properties"]["assessment"]["enum"] == list(ASSESSMENTS)
    assert set(ACTION_JSON_SCHEMA["required"]) == set(Action.model_fields)


def test_schema_is_derived_from_the_action() -> None:
    """One source: enums are Action's, string limits never exceed Action's, and the result is exactly the
    schema the edge grammar was built from (field order included, so the GBNF is unchanged)."""
    source = Action.model_json_schema()["properties"]
    for name, prop in ACTION_JSON_SCHEMA["properties"].items():
        if "enum" in source[name]:
            assert prop == {"enum": source[name]["enum"]}
        else:
            assert prop["maxLength"] <= source[name]["maxLength"] and prop["minLength"] == 1
    assert json.dumps(ACTION_JSON_SCHEMA) == json.dumps({
        "type": "object",
        "properties": {
            "explanation": {"type": "string", "minLength": 1, "maxLength": 120},
            "assessment": {"enum": list(ASSESSMENTS)},
            "urgency": {"enum": ["low", "medium", "high"]},
            "action": {"type": "string", "minLength": 1, "maxLength": 80},
        },
        "required": ["explanation", "assessment", "urgency", "action"],
        "additionalProperties": False,
    })


def test_messages_carry_event_flags_trend_and_question() -> None:
    ctx = [reading(i, hive_weight_kg=41.2) for i in range(1, 6)]
    ev = reading(6, severity=Severity.CRITICAL, flags=("hive_weight_drop",), hive_weight_kg=38.7)
    messages = build_messages(ev, ctx)
    system, user = messages[0], messages[-1]
    assert system.role == "system" and "swarming" in system.content
    assert [m.role for m in messages[1:-1]] == ["user", "assistant"] * len(EXAMPLES)
    assert all(parse_action(m.content) for m in messages[2:-1:2])  # worked examples are valid answers
    assert {parse_action(m.content).assessment for m in messages[2:-1:2]} == set(ASSESSMENTS)
    assert user.role == "user"
    assert "Severity: critical" in user.content and "hive_weight_drop" in user.content
    assert "Observed: the hive suddenly lost weight." in user.content
    assert "hive_weight_kg=38.7 kg" in user.content
    assert "hive_weight_kg -2.5" in user.content  # trend over the last 3 context events
    q = build_messages(question(7, "Is the colony queenless?"), ctx)[-1].content
    assert "Beekeeper asks: Is the colony queenless?" in q


def test_prefix_is_fixed() -> None:
    """The prefix cache on both tiers depends on everything before the event never varying."""
    a = build_messages(reading(1), [])[:-1]
    b = build_messages(question(2), [reading(1)])[:-1]
    assert a == b == list(PREFIX)


@pytest.mark.parametrize("flag, words", [
    ("battery_v_low", "the monitor battery is almost empty"),
    ("hive_weight_kg_implausible", "the hive_weight_kg sensor reads an impossible value"),
    ("hive_humidity_pct_missing", "the hive_humidity_pct sensor gives no reading"),
    ("some_new_rule", "some new rule"),
])
def test_flags_in_words(flag: str, words: str) -> None:
    assert describe_flag(flag) == words


def test_parse_takes_the_first_valid_object() -> None:
    text = 'first {"not": "it"} then ' + json.dumps(GOOD) + " and " + json.dumps({**GOOD, "urgency": "low"})
    a = parse_action(text)
    assert a is not None and a.urgency == "high"
