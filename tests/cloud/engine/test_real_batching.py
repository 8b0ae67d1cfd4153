"""On the real SmolLM2 weights: greedy tokens of a request do not depend on how it was served.

Each of 16 mixed-length requests is run alone (the reference), then all 16 together, again with
prefix-cache hits, and again under KV pressure that forces preemption (recompute and swap).
Tokens must match; where fp32 rounding of a different batch shape flips a choice, the test
shows it was a near-tie of the reference logits.
"""
from __future__ import annotations

import random

import pytest

from apiary.cloud.engine import LLMEngine, SamplingParams
from apiary.cloud.engine.sequence import Sequence
from tests.cloud.engine.conftest import prompt_logits

SYSTEM = ("You are the assistant of a beekeeper. Hive sensors report temperature, humidity and weight every "
          "ten minutes; answer briefly and mention the hive number. ")
TOPICS = ["swarming", "varroa mites", "winter stores", "queen failure", "robbing", "heat stress", "a sudden weight drop",
          "high humidity", "brood pattern", "a noisy hive", "wax moths", "an empty super", "nectar flow", "a new queen",
          "low temperature", "entrance traffic"]
WORD_COUNTS = [1, 60, 3, 45, 8, 70, 12, 2, 30, 5, 50, 20, 65, 4, 15, 40]
NEAR_TIE = 0.05  # logits; fp32 batch-shape rounding moves logits by ~1e-4


def make_prompts(engine: LLMEngine) -> list[list[int]]:
    rng = random.Random(7)
    out = []
    for i, topic in enumerate(TOPICS):
        detail = " ".join(rng.choice(["Hive", "weight", "rose", "fell", "by", "0.4kg", "today,", "and", "the",
                                      "bees", "are", "calm", "busy"]) for _ in range(WORD_COUNTS[i]))
        text = f"Hive {i + 1}: {detail}. What does {topic} mean here?"
        if i % 2 == 0:  # half share a long system prompt: prefix-cache hits in the warm run
            text = SYSTEM + text
        out.append(engine.tokenizer.encode(text))
    return out


def check_same_or_near_tie(engine: LLMEngine, prompt: list[int], reference: list[int], got: list[int]) -> None:
    if got == reference:
        return
    j = next(i for i, (a, b) in enumerate(zip(reference, got)) if a != b)
    _, logits = prompt_logits(engine, prompt + reference[:j], use_prefix_cache=False)
    last = logits[-1]
    gap = (last[reference[j]] - last[got[j]]).abs().item()
    assert gap < NEAR_TIE, f"token {j}: {reference[j]} vs {got[j]} differ by {gap:.4f} logits: not a near-tie"


def generate_all(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.output_token_ids for o in engine.generate(prompts, params)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_greedy_tokens_do_not_depend_on_batching_caching_or_preemption(real_engine: LLMEngine) -> None:
    engine = real_engine
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = make_prompts(engine)
    assert min(map(len, prompts)) < 25 and max(map(len, prompts)) > 100  # mixed lengths
    engine.reset_prefix_cache()
    alone = []
    for p in prompts:
        engine.reset_prefix_cache()
        alone.append(generate_all(engine, [p], params)[0])

    engine.reset_prefix_cache()
    batched = generate_all(engine, prompts, params)
    hits_before = engine.stats.cached_prompt_tokens
    warm = generate_all(engine, prompts, params)  # every prompt now hits the cache
    assert engine.stats.cached_prompt_tokens - hits_before > 0.8 * sum(map(len, prompts)) - 16 * 16

    # KV pressure: a ballast sequence pins all but 24 blocks (384 slots for ~1,300 tokens of work).
    ballast = Sequence(request_id="ballast", seq_no=-1, token_ids=[0], num_prompt_tokens=1, params=params,
                       priority=0, metrics=None)  # type: ignore[arg-type]
    engine.block_manager.append(ballast, (engine.block_manager.num_free_blocks - 24) * engine.config.block_size)
    results = {}
    try:
        for mode, swap_blocks in (("recompute", 0), ("swap", 10_000)):
            engine.reset_prefix_cache()
            engine.scheduler.swap_capacity_blocks = swap_blocks
            before = engine.scheduler.num_preemptions
            results[mode] = generate_all(engine, prompts, params)
            assert engine.scheduler.num_preemptions > before, f"{mode}: no preemption happened"
    finally:
        engine.scheduler.swap_capacity_blocks = 0
        engine.block_manager.free(ballast)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

    for runs in (batched, warm, results["recompute"], results["swap"]):
        for p, ref, got in zip(prompts, alone, runs):
            check_same_or_near_tie(engine, p, ref, got)
    exact = sum(ref == got for runs in (batched, warm, results["recompute"], results["swap"])
                for ref, got in zip(alone, runs))
    assert exact >= 60, f"only {exact}/64 runs matched exactly"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_burst_beyond_the_slots_ages_into_them_without_evictions(real_engine: LLMEngine) -> None:
    """16 requests of one priority into 4 sequence slots, waiting ones aging every 2 steps: they take the slots
    that free up and push no running request out, and the tokens are the unconstrained engine's."""
    engine = real_engine
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = make_prompts(engine)
    engine.reset_prefix_cache()
    free = generate_all(engine, prompts, params)
    config = engine.config
    slots, aging = config.max_num_seqs, config.aging_steps
    config.max_num_seqs, config.aging_steps = 4, 2
    try:
        engine.reset_prefix_cache()
        before = engine.scheduler.num_preemptions
        squeezed = generate_all(engine, prompts, params)
        assert engine.scheduler.num_preemptions == before
    finally:
        config.max_num_seqs, config.aging_steps = slots, aging
    for p, ref, got in zip(prompts, free, squeezed):
        check_same_or_near_tie(engine, p, ref, got)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_steps_stopped_for_urgent_arrivals_change_no_token(real_engine: LLMEngine) -> None:
    """On SmolLM2: low-priority requests whose steps are stopped twice for urgent newcomers (mid
    prefill, then later) produce the tokens of an undisturbed run (or differ at near-ties, as the
    urgent steps move later chunk boundaries); no block leaks."""
    engine = real_engine
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = make_prompts(engine)[:6]
    engine.config.max_num_batched_tokens, saved = 64, engine.config.max_num_batched_tokens  # several prefill steps
    try:
        engine.reset_prefix_cache()
        undisturbed = generate_all(engine, prompts, params)
        engine.reset_prefix_cache()
        ids = [engine.add_request(p, params=params, priority=5) for p in prompts]
        interrupted = engine.metrics()["interrupted_steps"]
        outs: dict[str, list[int]] = {}

        def run(steps: int | None = None) -> None:
            while engine.has_unfinished() and (steps is None or steps > 0):
                for out in engine.step():
                    if out.finished:
                        outs[out.request_id] = out.output_token_ids
                steps = None if steps is None else steps - 1

        for steps_before in (1, 5):  # during the prompts' prefill, then later in the run
            run(steps_before)
            assert engine.has_unfinished()
            engine.announce_arrival(0)
            assert engine.step() == []
            engine.add_request(engine.tokenizer.encode("Hive 9 is swarming."), priority=0,
                               params=SamplingParams(max_tokens=2, ignore_eos=True))
            engine.withdraw_arrival(0)
        run()
    finally:
        engine.config.max_num_batched_tokens = saved
    assert engine.metrics()["interrupted_steps"] - interrupted == 2
    for p, ref, i in zip(prompts, undisturbed, ids):  # the urgent steps shift later chunk boundaries
        check_same_or_near_tie(engine, p, ref, outs[i])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
