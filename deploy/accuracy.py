"""Task accuracy of a model through the real engine: the check both tuning and distillation report.

The model answers as the cloud answers: greedy, the ``Action`` JSON Schema enforced by the
grammar, batched in one engine. An answer counts when it parses and names the label.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence


def engine_accuracy(model: Path, prompts: Sequence[str | list[dict[str, str]]], labels: Sequence[str], *,
                    adapter: Path | None = None, max_tokens: int = 96) -> dict[str, Any]:
    """Accuracy, valid-answer share and per-label counts of ``model`` (+ ``adapter``) on ``prompts`` (chat
    messages, rendered with the model's template, or text already rendered) whose true assessments are
    ``labels``."""
    from apiary.cloud.engine import EngineConfig, LLMEngine, SamplingParams
    from apiary.cloud.engine.sampling_params import StructuredOutput
    from apiary.shared.prompting import ACTION_JSON_SCHEMA, parse_action

    if len(prompts) != len(labels):
        raise ValueError(f"{len(prompts)} prompts for {len(labels)} labels")
    engine = LLMEngine(EngineConfig(model_path=model, adapter_path=adapter, kv_cache_bytes=256 << 20,
                                    max_num_batched_tokens=2048))
    params = SamplingParams(max_tokens=max_tokens,
                            structured=StructuredOutput("json_schema", json.dumps(ACTION_JSON_SCHEMA)))
    tok = engine.tokenizer
    ids = [tok.encode(p if isinstance(p, str) else tok.apply_chat_template(p)) for p in prompts]
    outs = engine.generate(ids, params) if ids else []
    per_label: dict[str, list[int]] = {}
    right = valid = 0
    for label, out in zip(labels, outs):
        action = parse_action(out.text)
        valid += action is not None
        ok = action is not None and action.assessment == label
        right += ok
        counts = per_label.setdefault(label, [0, 0])
        counts[0] += ok
        counts[1] += 1
    n = max(1, len(prompts))
    return {"accuracy": right / n, "valid": valid / n, "n": len(prompts),
            "per_label": {k: f"{a}/{b}" for k, (a, b) in sorted(per_label.items())}}
