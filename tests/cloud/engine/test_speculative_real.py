"""On the real SmolLM2 weights: greedy outputs with speculation (n-gram and a 4-layer draft) are
token-for-token those of plain decoding, for sensor-agent JSON and free-text prompts, each alone
and all in one mixed batch. Where fp32 rounding of a different batch shape flips a choice, the
test shows it was a near-tie of the reference logits (as tests/cloud/engine/test_real_batching.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from apiary.cloud.engine import EngineConfig, LLMEngine, SamplingParams, SpeculativeConfig
from tests.cloud.engine.conftest import attention_calls
from tests.cloud.engine.test_real_batching import check_same_or_near_tie

FREE = ["Why do bees dance? Answer in one sentence.", "List three things a beekeeper checks in spring."]


@pytest.fixture(scope="module")
def spec_engine(gguf_path: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model_path=gguf_path, dtype="float32", kv_cache_bytes=192 << 20, max_num_batched_tokens=2048,
        speculative=SpeculativeConfig(method="draft", draft_num_layers=4, k=4, adaptive=False)))


def prompts_for(engine: LLMEngine) -> list[list[int]]:
    from apiary.firmware_bridge.simulator import labelled_situations
    from apiary.shared.prompting import build_messages

    tok = engine.tokenizer
    out = []
    for s in labelled_situations(4, seed=5):
        messages = [m.model_dump() for m in build_messages(s.event, s.context)]
        out.append(tok.encode(tok.apply_chat_template(messages) + '{"assessment": "'))
    out += [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in FREE]
    return out


def generate(engine: LLMEngine, variant: str, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    spec = engine.speculator
    spec.enabled = variant != "plain"
    if variant != "plain":
        spec.method = variant
    try:
        return [o.output_token_ids for o in engine.generate(prompts, params)]
    finally:
        spec.enabled = False


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_greedy_outputs_identical_with_and_without_speculation(spec_engine: LLMEngine,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """...and the verifications' attention (each sequence's last token and its drafts) comes from the numba
    varlen kernel, which reads each cached row once for all of them."""
    served = attention_calls(monkeypatch, "_varlen")
    engine = spec_engine
    prompts = prompts_for(engine)
    alone = prompts[::2]  # 2 structured + 1 free, each run by itself
    params = SamplingParams(max_tokens=16)
    ref_alone = [generate(engine, "plain", [p], params)[0] for p in alone]
    ref_batch = generate(engine, "plain", prompts, params)  # all six in one mixed batch
    assert any(len(r) == 16 for r in ref_batch)
    exact = 0
    for variant in ("ngram", "draft"):
        before = engine.metrics()
        got_alone = [generate(engine, variant, [p], params)[0] for p in alone]
        got_batch = generate(engine, variant, prompts, params)
        m = engine.metrics()
        assert m[f"spec_{variant}_accepted"] > before[f"spec_{variant}_accepted"]  # speculation really ran
        for prompt, ref, got in [*zip(alone, ref_alone, got_alone), *zip(prompts, ref_batch, got_batch)]:
            check_same_or_near_tie(engine, prompt, ref, got)
            exact += got == ref
    assert exact >= 16  # of 2 x 9 comparisons, nearly all exactly equal
    assert len(served) >= 30 and max(served) >= 2  # every layer of the verifying steps, whole batches of them
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
