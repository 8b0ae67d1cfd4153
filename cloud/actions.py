"""Structured JSON actions from a small model, one field at a time.

A 135M model asked for JSON often drifts out of the format. Instead of hoping, the
cloud writes the JSON skeleton itself and lets the model fill one string field at a
time: the assistant turn is prefilled with ``{"assessment": "`` and generation stops at
the closing quote; then ``", "action": "`` is appended, and so on for ``urgency`` and
``explanation``. Every stage re-uses the previous prompt, so the engine's prefix cache
serves it and each stage costs only its new tokens.

The two enumerated fields are constrained after the fact: the model's words are
normalised (case, spaces, hyphens) and snapped to the one allowed value they name or
start (``"heat"`` -> ``heat_stress``). When the greedy answer names none, a few answers
are sampled at once (they share the cached prompt and run as one batch) and the value
named most often wins (self-consistency voting); when none names an allowed value, the
answer fails with a reason instead of inventing one. The engine exposes no logits, so
scoring each allowed value's tokens directly is not possible from here. The assembled JSON goes through
``shared.prompting.parse_action``, the same parser the edge uses, so both tiers accept
exactly the same actions.
"""
from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, get_args

from shared.protocol import ASSESSMENTS, Urgency

URGENCIES: tuple[str, ...] = get_args(Urgency)
VOTE_SAMPLES = 5  # sampled answers when the greedy one names no allowed value (one batched engine step each)
VOTE_TEMPERATURE = 0.8
ACTION_MAX_CHARS = 200
EXPLANATION_MAX_CHARS = 500


@dataclass(slots=True)
class ActionOutcome:
    text: str  # the JSON the model's fields assemble into
    action: dict[str, Any] | None  # the parsed Action, None when it could not be made
    error: str | None
    prompt_tokens: int
    completion_tokens: int
    first_token_time: float | None = None


def snap(raw: str, allowed: tuple[str, ...]) -> str | None:
    """The allowed value ``raw`` names: exact, a unique prefix of it, or it followed by extra words."""
    v = raw.strip().strip(".,;:").lower().replace("-", "_").replace(" ", "_")
    if v in allowed:
        return v
    if not v:
        return None
    starts = [a for a in allowed if a.startswith(v)]
    if len(starts) == 1:
        return starts[0]
    within = [a for a in allowed if v.startswith(a)]
    return max(within, key=len) if within else None


def budgets(max_tokens: int) -> dict[str, int]:
    """How ``max_tokens`` is split across the four fields (the explanation gets what is left)."""
    assessment, urgency = 8, 4
    action = max(1, min(48, (max_tokens - assessment - urgency) // 2))
    explanation = max(0, min(128, max_tokens - assessment - urgency - action))
    return {"assessment": assessment, "action": action, "urgency": urgency, "explanation": explanation}


async def generate_action(engine, chat_prompt: str, *, max_tokens: int, temperature: float = 0.0,
                          priority: int = 0, seed: int | None = None, vote_samples: int = VOTE_SAMPLES) -> ActionOutcome:
    """Fill the Action JSON on top of ``chat_prompt`` (already ending in the assistant header)."""
    from cloud.engine import EngineOverloaded, SamplingParams
    from shared.prompting import parse_action

    budget = budgets(max_tokens)
    fields: dict[str, str] = {}
    prompt = chat_prompt + '{"assessment": "'
    prompt_tokens = completion_tokens = 0
    first_token_time = None

    async def fill(name: str) -> str:
        nonlocal prompt_tokens, completion_tokens, first_token_time
        params = SamplingParams(max_tokens=budget[name], temperature=temperature, seed=seed, stop=['"', "\n"])
        out = await engine.generate(prompt=prompt, params=params, priority=priority)
        prompt_tokens = prompt_tokens or len(out.prompt_token_ids)
        completion_tokens += len(out.output_token_ids)
        if first_token_time is None:
            first_token_time = out.metrics.first_token_time
        return out.text

    async def vote(name: str, allowed: tuple[str, ...]) -> str | None:
        """Greedy named no allowed value: sample a few answers at once and take the most named one."""
        nonlocal completion_tokens
        base = 0 if seed is None else seed
        params = [SamplingParams(max_tokens=budget[name], temperature=VOTE_TEMPERATURE, seed=base + i,
                                 stop=['"', "\n"]) for i in range(vote_samples)]
        results = await asyncio.gather(*(engine.generate(prompt=prompt, params=p, priority=priority)
                                         for p in params), return_exceptions=True)
        outs = [r for r in results if not isinstance(r, BaseException)]
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures and (not outs or not all(isinstance(f, EngineOverloaded) for f in failures)):
            raise failures[0]  # samples refused by a full queue just don't vote; anything else is an error
        completion_tokens += sum(len(o.output_token_ids) for o in outs)
        named = [v for v in (snap(o.text, allowed) for o in outs) if v is not None]
        return Counter(named).most_common(1)[0][0] if named else None

    def outcome(error: str | None) -> ActionOutcome:
        text = json.dumps(fields)
        action = None
        if error is None:
            parsed = parse_action(text)
            if parsed is None:
                error = f"the assembled answer is not a valid action: {text[:200]}"
            else:
                action = parsed.model_dump(mode="json")
        return ActionOutcome(text, action, error, prompt_tokens, completion_tokens, first_token_time)

    raw = await fill("assessment")
    assessment = snap(raw, ASSESSMENTS)
    if assessment is None and vote_samples:
        assessment = await vote("assessment", ASSESSMENTS)
    fields["assessment"] = assessment or raw.strip()
    if assessment is None:
        return outcome(f"the model's assessment {raw.strip()[:60]!r} is none of {list(ASSESSMENTS)}")
    prompt += assessment + '", "action": "'

    action_text = (await fill("action")).strip()[:ACTION_MAX_CHARS]
    fields["action"] = action_text
    prompt += action_text.replace('"', "'") + '", "urgency": "'

    raw = await fill("urgency")
    urgency = snap(raw, URGENCIES)
    if urgency is None and vote_samples:
        urgency = await vote("urgency", URGENCIES)
    fields["urgency"] = urgency or raw.strip()
    if urgency is None:
        return outcome(f"the model's urgency {raw.strip()[:30]!r} is none of {list(URGENCIES)}")

    if budget["explanation"]:
        prompt += urgency + '", "explanation": "'
        fields["explanation"] = (await fill("explanation")).strip()[:EXPLANATION_MAX_CHARS]
    return outcome(None)
