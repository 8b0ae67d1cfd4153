"""The field-by-field JSON action fill: snapping enumerated fields and splitting the token budget."""
from __future__ import annotations

import asyncio

import pytest

from cloud.actions import URGENCIES, budgets, generate_action, snap
from shared.protocol import ASSESSMENTS


def test_snap_to_allowed_values():
    assert snap("heat_stress", ASSESSMENTS) == "heat_stress"
    assert snap(" Heat stress.", ASSESSMENTS) == "heat_stress"
    assert snap("heat", ASSESSMENTS) == "heat_stress"  # a unique prefix
    assert snap("low-battery warning", ASSESSMENTS) == "low_battery"  # the value followed by more words
    assert snap("s", ASSESSMENTS) is None  # swarming or sensor_fault: ambiguous
    assert snap("Severity: critical", ASSESSMENTS) is None
    assert snap("", ASSESSMENTS) is None
    assert snap("HIGH", URGENCIES) == "high" and snap("med", URGENCIES) == "medium"


def test_budgets_never_exceed_max_tokens():
    for max_tokens in (1, 8, 12, 13, 20, 48, 128, 4096):
        b = budgets(max_tokens)
        assert all(v >= 0 for v in b.values())
        assert b["assessment"] >= 1 and b["urgency"] >= 1 and b["action"] >= 1
        if max_tokens >= 13:
            assert sum(b.values()) <= max_tokens
    assert budgets(128)["explanation"] > 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_unusable_answer_is_reported_not_invented(cloud_engine):
    """On the real model: an off-topic chat names no assessment; without voting that is an error, never a guess."""
    from shared.prompting import SYSTEM_PROMPT

    chat = cloud_engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Say hello to the beekeeper."}])
    out = asyncio.run(generate_action(cloud_engine, chat, max_tokens=32, vote_samples=0))
    assert out.action is None and "none of" in out.error and "heat_stress" in out.error
    assert out.prompt_tokens > 50 and 1 <= out.completion_tokens <= 8
    assert out.text.startswith('{"assessment": ')
