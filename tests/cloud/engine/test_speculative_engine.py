"""Speculative decoding inside the engine, on tiny random checkpoints (fast, exact, statistical).

* Sampling: the joint distribution of tokens emitted by verification equals the target's exact
  distribution (chi-square over many seeded requests) for draft-model and n-gram proposals,
  and the same test fails when the verifier skips the residual resampling.
* Greedy: token-for-token identical to plain decoding, alone, batched, with prefix caching,
  under preemption, with a draft of another architecture; stops, aborts and KV accounting.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import random
from pathlib import Path

import pytest
import torch

from apiary.cloud.engine import AsyncEngine, EngineConfig, EngineError, LLMEngine, SamplingParams, SpeculativeConfig
from apiary.cloud.engine.spec import rejection
from apiary.cloud.engine.spec.batching import Entry, build_inputs
from apiary.cloud.engine.sampling import sampling_probs
from tests.cloud.engine.test_speculative_units import chi_square_pvalue, tiny_weights
from apiary.cloud.engine.config import ModelConfig
from apiary.cloud.engine.kv_cache import KVPool

VOCAB = 8
PROMPT = [1, 2, 3, 1, 2]
SAMPLED = dict(temperature=0.9, top_k=6, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama with an 8-token vocabulary (word-level tokenizer t0..t7), logits far from uniform."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("tiny_vocab")
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position=64, tie_word_embeddings=True)
    weights = tiny_weights(config, seed=3)
    for i in range(2):  # a strong second layer: a 1-layer draft then differs clearly from the target
        weights[f"model.layers.{i}.mlp.down_proj.weight"] *= 3.0
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True}))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t7", "bos_token": None}))
    return folder


def tiny_engine(path: Path, spec: SpeculativeConfig | None, **kw) -> LLMEngine:
    cfg = dict(model_path=path, dtype="float32", kv_cache_bytes=8 << 20, max_num_seqs=512, max_num_batched_tokens=4096,
               block_size=4, speculative=spec)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


@torch.inference_mode()
def exact_pair_distribution(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """P(t2, t3) of the target, t1 marginalised: every continuation enumerated through the model."""
    model = engine.runner.model
    prefixes = [prompt] + [prompt + [a] for a in range(VOCAB)] + [prompt + [a, b] for a in range(VOCAB)
                                                                   for b in range(VOCAB)]
    width = -(-(len(prompt) + 2) // 4)
    caches = KVPool(model.config.num_layers, len(prefixes) * width, 4, 2, 8, torch.float32, torch.device("cpu")).layers
    entries = [Entry(p, 0, list(range(i * width, (i + 1) * width))) for i, p in enumerate(prefixes)]
    inputs = build_inputs(entries, 4, torch.device("cpu"))
    hidden = model.forward(inputs.input_ids, inputs.positions, inputs.meta, caches)
    probs = sampling_probs(model.logits(hidden[inputs.last_rows]), [params] * len(prefixes)).double()
    p1, p2, p3 = probs[0], probs[1:1 + VOCAB], probs[1 + VOCAB:].view(VOCAB, VOCAB, VOCAB)
    joint = (p1[:, None, None] * p2[:, :, None] * p3).sum(0)  # [t2, t3]
    return joint.flatten()


def sample_pairs(engine: LLMEngine, n: int, seed0: int, seeded: bool = True) -> torch.Tensor:
    """(t2, t3) counts of ``n`` requests: seeded ``seed0 + i``, or unseeded (the engine's own generator)."""
    params = [SamplingParams(**SAMPLED, seed=seed0 + i if seeded else None) for i in range(n)]
    outs = engine.generate([PROMPT] * n, params)
    pairs = torch.tensor([o.output_token_ids[1] * VOCAB + o.output_token_ids[2] for o in outs])
    return torch.bincount(pairs, minlength=VOCAB * VOCAB)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method,seeded", [("draft", True), ("draft", False), ("ngram", True)])
def test_sampled_tokens_follow_the_target_distribution(tiny_vocab: Path, method: str, seeded: bool,
                                                       monkeypatch) -> None:
    """Seeded rows replay plain decoding; unseeded draft-model rows go through rejection sampling."""
    spec = SpeculativeConfig(method=method, k=2, adaptive=False, max_batch=4096, ngram_min=1, ngram_max=2,
                             draft_num_layers=1 if method == "draft" else None)
    engine = tiny_engine(tiny_vocab, spec)
    exact = exact_pair_distribution(engine, PROMPT, SamplingParams(**SAMPLED))
    counts = sample_pairs(engine, 3000, 0, seeded)
    m = engine.metrics()
    assert m[f"spec_{method}_proposed"] > 2000 and 0 < m[f"spec_{method}_accepted"] < m[f"spec_{method}_proposed"]
    assert chi_square_pvalue(counts, exact) > 1e-3
    if not seeded:  # the same test must catch a verifier that resamples from p instead of max(0, p - q)
        monkeypatch.setattr(rejection, "residual_probs", lambda p, q: p)
        assert chi_square_pvalue(sample_pairs(engine, 3000, 10_000, seeded), exact) < 1e-6


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_sampling_gives_the_same_tokens_with_speculation_on_or_off_in_any_batch(tiny_vocab: Path,
                                                                                      method: str) -> None:
    """Temperature 0.7 and 1.0, two seeds each: plain decoding's tokens alone, with speculation at two k,
    and in a batch among unseeded, greedy and other seeded requests (in another order)."""
    sampled = [SamplingParams(temperature=t, seed=s, max_tokens=16, ignore_eos=True)
               for t in (0.7, 1.0) for s in (11, 12)]
    plain = tiny_engine(tiny_vocab, None)
    reference = [plain.generate([PROMPT], [p])[0].output_token_ids for p in sampled]
    assert len({tuple(r) for r in reference}) == len(reference)  # the seeds (and temperatures) matter
    others = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True), SamplingParams(max_tokens=9),
              SamplingParams(temperature=0.7, seed=99, max_tokens=5, ignore_eos=True)]
    for k in (2, 4):
        spec = SpeculativeConfig(method=method, k=k, adaptive=False, max_batch=4096, ngram_min=1, ngram_max=2,
                                 draft_num_layers=1 if method == "draft" else None)
        engine = tiny_engine(tiny_vocab, spec)
        assert [run(engine, [PROMPT], p, True)[0] for p in sampled] == reference
        m = engine.metrics()
        assert 0 < m[f"spec_{method}_accepted"] < m[f"spec_{method}_proposed"]  # drafts kept and drafts refused
        assert [run(engine, [PROMPT], p, False)[0] for p in sampled] == reference
        mixed = others[:2] + sampled[::-1] + others[2:]
        outs = engine.generate([[1, 2, 1, 2], PROMPT] + [PROMPT] * len(sampled) + [[3, 4]], mixed)
        assert [o.output_token_ids for o in outs[2:2 + len(sampled)]] == reference[::-1]


# ---------------------------------------------------------------- greedy equality on the engine's tiny Llama

def greedy_prompts(n: int = 10) -> list[list[int]]:
    rng = random.Random(1)
    shared = [rng.randrange(3, 300) for _ in range(9)]
    out = []
    for i in range(n):
        body = [rng.randrange(3, 300) for _ in range(rng.choice([1, 4, 11, 23]))]
        if i % 3 == 0:
            body = body + body[:6]  # repeated text: n-gram hits
        out.append((shared if i % 2 else []) + body)
    return out


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, spec_on: bool) -> list[list[int]]:
    if engine.speculator is not None:
        engine.speculator.enabled = spec_on
    return [o.output_token_ids for o in engine.generate(prompts, params)]


def pools_are_free(engine: LLMEngine) -> bool:
    ok = engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    draft = engine.speculator.draft if engine.speculator else None
    return ok and (draft is None or (draft.bm.num_free_blocks == draft.bm.num_blocks and not draft.states))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_identical_alone_batched_and_preempted(tiny_llama: Path, method: str) -> None:
    spec = SpeculativeConfig(method=method, k=3, adaptive=False, draft_num_layers=1 if method == "draft" else None)
    engine = tiny_engine(tiny_llama, spec)
    prompts = greedy_prompts()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    reference = [run(engine, [p], params, False)[0] for p in prompts]
    assert [run(engine, [p], params, True)[0] for p in prompts] == reference  # alone
    assert run(engine, prompts, params, True) == reference  # one mixed batch (prefix-cache hits too)
    m = engine.metrics()
    assert m[f"spec_{method}_accepted"] > 0 and m[f"spec_{method}_proposed"] >= m[f"spec_{method}_accepted"]
    assert all(len(r) == 12 for r in reference)
    assert pools_are_free(engine)
    # A pool of 24 four-token blocks cannot hold ten ~30-token sequences: preemption (and draft rebuilds).
    small = tiny_engine(tiny_llama, spec, kv_cache_bytes=24 * engine.runner.bytes_per_block)
    assert run(small, prompts, params, True) == reference
    assert small.metrics()["preemptions"] > 0 and pools_are_free(small)


def test_draft_of_another_architecture_with_the_same_tokenizer(tiny_llama: Path, tiny_qwen2: Path,
                                                               tiny_vocab: Path) -> None:
    spec = SpeculativeConfig(method="draft", k=4, adaptive=False, draft_model_path=tiny_qwen2)
    engine = tiny_engine(tiny_llama, spec)
    prompts = greedy_prompts(4)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    assert run(engine, prompts, params, True) == run(engine, prompts, params, False)
    assert engine.metrics()["spec_draft_proposed"] > 0
    with pytest.raises(EngineError, match="tokenizer"):
        tiny_engine(tiny_llama, SpeculativeConfig(method="draft", draft_model_path=tiny_vocab))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_stops_inside_accepted_tokens_and_max_tokens(tiny_llama: Path, method: str) -> None:
    spec = SpeculativeConfig(method=method, k=4, adaptive=False, draft_num_layers=1 if method == "draft" else None)
    engine = tiny_engine(tiny_llama, spec)
    prompt = greedy_prompts()[0]
    full = run(engine, [prompt], SamplingParams(max_tokens=16, ignore_eos=True), False)[0]
    stop_at = next(i for i in range(3, 16) if full[i] not in full[:i])
    for on in (False, True):
        engine.speculator.enabled = on
        out = engine.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=[full[stop_at]]))[0]
        assert out.output_token_ids == full[:stop_at + 1] and out.finish_reason == "stop"
        out = engine.generate(prompt, SamplingParams(max_tokens=7, ignore_eos=True))[0]
        assert out.output_token_ids == full[:7] and out.finish_reason == "length"
    assert pools_are_free(engine)


def test_abort_and_streaming_with_speculation(tiny_llama: Path) -> None:
    spec = SpeculativeConfig(method="draft", k=4, adaptive=False, draft_num_layers=1)
    engine = tiny_engine(tiny_llama, spec)
    prompt = greedy_prompts()[3]
    rid = engine.add_request(prompt, params=SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.speculator.draft.states  # the draft holds state for the running request
    engine.abort(rid)
    engine.step()
    assert pools_are_free(engine)

    async def stream() -> tuple[list[int], str, str]:
        ae = AsyncEngine(engine)
        try:
            ids, text, final = [], "", None
            async for out in ae.stream(prompt, params=SamplingParams(max_tokens=20, ignore_eos=True)):
                ids += out.new_token_ids
                text += out.text_delta
                final = out
            return ids, text, final.text
        finally:
            ae.shutdown()

    ids, text, final_text = asyncio.run(stream())
    engine.speculator.enabled = False
    assert ids == engine.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True))[0].output_token_ids
    assert text == final_text
    m = engine.metrics()
    assert m["spec_draft_verifications"] > 0
    assert m["spec_draft_tokens_per_verification"] == pytest.approx(1 + m["spec_draft_mean_accepted_length"])


def test_policy_switches_speculation_off_for_large_batches(tiny_llama: Path) -> None:
    """Beyond max_batch decoding sequences nobody speculates; below it they do."""
    spec = SpeculativeConfig(method="ngram", k=4, adaptive=False, max_batch=3)
    engine = tiny_engine(tiny_llama, spec)
    prompts = [p + p for p in greedy_prompts(6)]  # self-repeating: n-gram always has a proposal
    engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    big = engine.metrics()
    assert big["spec_ngram_proposed"] == 0 and big["spec_ngram_steps_off"] > 0
    engine.generate(prompts[:3], SamplingParams(max_tokens=6, ignore_eos=True))
    assert engine.metrics()["spec_ngram_proposed"] > 0
