"""LLMEngine on tiny random checkpoints: API contract, errors, stopping, sampling, preemption, metrics."""
from __future__ import annotations

from pathlib import Path

import pytest

from apiary.cloud.engine import (EngineConfig, EngineError, EngineOverloaded, LLMEngine, RequestOutput, RequestRejected,
                          SamplingParams)

WORDS = "hive bees queen brood honey sensor weight humidity nectar swarm comb wax frame entrance".split()


def prompts(n: int, seed: int = 0, max_words: int = 60) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, max_words))) for _ in range(n)]


def engine_for(folder: Path, **overrides) -> LLMEngine:
    config = dict(model_path=folder, dtype="float32", kv_cache_bytes=2 << 20, block_size=4, max_num_batched_tokens=64)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def run_all(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Step until idle; every output per request, in order."""
    seen: dict[str, list[RequestOutput]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            return seen
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish")


def test_generate_and_streamed_outputs_agree(tiny_llama: Path) -> None:
    engine = engine_for(tiny_llama)
    texts = prompts(6)
    finals = engine.generate(texts, SamplingParams(max_tokens=12))
    assert [len(o.output_token_ids) for o in finals] == [12] * 6
    assert all(o.finished and o.finish_reason == "length" for o in finals)
    ids = [engine.add_request(t, params=SamplingParams(max_tokens=12)) for t in texts]
    seen = run_all(engine)
    for rid, final in zip(ids, finals):
        outs = seen[rid]
        assert [t for o in outs for t in o.new_token_ids] == final.output_token_ids
        assert "".join(o.text_delta for o in outs) == outs[-1].text == final.text
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        m = outs[-1].metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
        assert m.queue_time is not None and m.ttft is not None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_chat_messages_use_the_template(tiny_llama: Path) -> None:
    engine = engine_for(tiny_llama)
    rid = engine.add_request(messages=[{"role": "user", "content": "hive weight?"}],
                             params=SamplingParams(max_tokens=2))
    expected = engine.tokenizer.encode("<|im_start|>user\nhive weight?<|im_end|>\n<|im_start|>assistant\n")
    assert engine.requests[rid].prompt_token_ids == expected


def test_bad_requests_are_rejected_clearly(tiny_llama: Path) -> None:
    engine = engine_for(tiny_llama, max_model_len=128, max_waiting=3)
    cases = [
        (dict(prompt=""), "empty"),
        (dict(prompt=None), "exactly one"),
        (dict(prompt="x", messages=[{"role": "user", "content": "y"}]), "exactly one"),
        (dict(prompt=[1, 2, 10**6]), "token ids"),
        (dict(prompt=[1, "2"]), "token ids"),
        (dict(prompt=3.5), "str or a list"),
        (dict(prompt="hive " * 200), "exceeds max_model_len"),
        (dict(prompt="hive", params=SamplingParams(max_tokens=200)), "exceeds max_model_len"),
        (dict(prompt="hive", params={"max_tokens": 3}), "SamplingParams"),
        (dict(prompt="hive", priority="high"), "priority"),
        (dict(prompt="hive", request_id=""), "request_id"),
        (dict(messages=[{"role": "user"}]), "messages"),
    ]
    for kwargs, message in cases:
        with pytest.raises(RequestRejected, match=message):
            engine.add_request(**kwargs)
    for bad in (dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2), dict(stop=[""]),
                dict(stop_token_ids=[-1]), dict(seed="x")):
        with pytest.raises(RequestRejected):
            SamplingParams(**bad)
    engine.add_request("hive", request_id="dup")
    with pytest.raises(RequestRejected, match="already in use"):
        engine.add_request("hive", request_id="dup")
    engine.add_request("hive")
    engine.add_request("hive")
    with pytest.raises(EngineOverloaded):
        engine.add_request("hive")
    assert issubclass(RequestRejected, EngineError) and issubclass(EngineOverloaded, EngineError)
    assert len(engine.requests) == 3  # nothing half-added


def test_request_that_can_never_fit_the_kv_pool_is_rejected(tiny_llama: Path) -> None:
    engine = engine_for(tiny_llama, kv_cache_bytes=16 * 1024)  # a handful of blocks
    capacity = engine.block_manager.num_blocks * engine.config.block_size
    with pytest.raises(RequestRejected, match="can never run"):
        engine.add_request([5] * capacity, params=SamplingParams(max_tokens=2))
    # The largest request that fits does run to completion, alone in the pool.
    out = engine.generate([[5] * (capacity - 4)], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 5


def test_abort_frees_blocks_and_reports(tiny_llama: Path) -> None:
    engine = engine_for(tiny_llama)
    keep = engine.add_request(prompts(1)[0], params=SamplingParams(max_tokens=30, ignore_eos=True))
    gone = engine.add_request(prompts(1, seed=1)[0], params=SamplingParams(max_tokens=30, ignore_eos=True))
    while engine.requests[gone].num_output_tokens < 2:
        engine.step()
    free_before = engine.block_manager.num_free_blocks
    held = len(engine.requests[gone].block_table)
    assert held > 0 and engine.abort(gone)
    assert engine.block_manager.num_free_blocks == free_before + held
    assert not engine.abort(gone) and not engine.abort("never-existed")
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == gone]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    assert any(o.request_id == keep for o in outs)
    run_all(engine)
    assert engine.metrics()["requests_aborted"] == 1


def test_stop_strings_and_stop_tokens(tiny_llama: Path) -> None:
    engine = engine_for(tiny_llama)
    prompt = prompts(1, seed=3)[0]
    free = engine.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    first = free.text.find(stop)
    rid = engine.add_request(prompt, params=SamplingParams(max_tokens=24, stop=[stop], ignore_eos=True))
    outs = run_all(engine)[rid]
    assert outs[-1].finish_reason == "stop" and outs[-1].text == free.text[:first]
    assert "".join(o.text_delta for o in outs) == outs[-1].text  # nothing released was taken back
    token = free.output_token_ids[4]
    out = engine.generate(prompt, SamplingParams(max_tokens=24, stop_token_ids=[token], ignore_eos=True))[0]
    cut = free.output_token_ids.index(token)
    assert out.finish_reason == "stop" and out.output_token_ids == free.output_token_ids[:cut + 1]
    assert out.text == engine.tokenizer.decode(free.output_token_ids[:cut])  # the stop token is not shown


def test_eos_stops_unless_ignored(tiny_llama: Path) -> None:
    engine = engine_for(tiny_llama)
    eos = engine.tokenizer.eos_token_id
    # Find a prompt position where the model's greedy choice is EOS by forcing it through stop ids.
    outs = engine.generate(prompts(40, seed=5), SamplingParams(max_tokens=40, ignore_eos=True))
    hits = [o for o in outs if eos in o.output_token_ids]
    assert hits, "no EOS in 40 greedy continuations of the tiny model"
    o = hits[0]
    again = engine.generate(o.prompt_token_ids, SamplingParams(max_tokens=40))[0]
    assert again.finish_reason == "stop" and again.output_token_ids[-1] == eos
    assert again.output_token_ids == o.output_token_ids[:o.output_token_ids.index(eos) + 1]


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_llama: Path) -> None:
    engine = engine_for(tiny_llama)
    p = prompts(1, seed=9)[0]
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=20, seed=1234)
    alone = engine.generate(p, params)[0].output_token_ids
    mixed = engine.generate([p, *prompts(5, seed=10)], [params] + [SamplingParams(max_tokens=9, temperature=0.7)] * 5)
    assert mixed[0].output_token_ids == alone
    other = engine.generate(p, SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=20, seed=99))[0]
    assert other.output_token_ids != alone
    greedy = engine.generate(p, SamplingParams(max_tokens=16))[0].output_token_ids
    top1 = engine.generate(p, SamplingParams(max_tokens=16, temperature=1.0, top_k=1, seed=5))[0].output_token_ids
    assert top1 == greedy  # top_k=1 sampling is greedy


def test_generate_keeps_other_requests_outputs(tiny_llama: Path) -> None:
    engine = engine_for(tiny_llama)
    other = engine.add_request("hive bees", params=SamplingParams(max_tokens=40, ignore_eos=True))
    engine.generate("queen brood", SamplingParams(max_tokens=5))
    seen = run_all(engine)[other]
    assert len([t for o in seen for t in o.new_token_ids]) == 40  # nothing was dropped while generate() ran


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bf16", "int8"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_same_greedy_tokens_alone_batched_cached_and_preempted(tiny_llama: Path, mode: str,
                                                               kv_cache_dtype: str) -> None:
    """Also with bf16 rows under this float32 engine, and int8 rows: their scales travel with them through the prefix
    cache and swap."""
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    texts = [("hive sensor report: " * 4) + t for t in prompts(16, seed=11, max_words=12)]  # shared prefix
    kv = dict(kv_cache_dtype=kv_cache_dtype)
    roomy = engine_for(tiny_llama, kv_cache_bytes=8 << 20, enable_prefix_caching=False, **kv)
    alone = [roomy.generate(t, params)[0].output_token_ids for t in texts]
    batched = roomy.generate(texts, params)
    assert [o.output_token_ids for o in batched] == alone
    cached = engine_for(tiny_llama, kv_cache_bytes=8 << 20, **kv)
    cached.generate(texts[:1], params)
    warm = cached.generate(texts, params)
    assert cached.metrics()["prefix_hit_rate"] > 0.2
    assert [o.output_token_ids for o in warm] == alone
    # as many blocks as 64 KiB of float32 rows hold, whatever the rows are stored as
    tight_blocks = 64 * 1024 // engine_for(tiny_llama).runner.bytes_per_block
    tight = engine_for(tiny_llama, kv_cache_bytes=tight_blocks * roomy.runner.bytes_per_block, preemption_mode=mode,
                       max_num_batched_tokens=48, **kv)
    squeezed = tight.generate(texts, params)
    metrics = tight.metrics()
    assert metrics["preemptions"] > 0
    assert [o.output_token_ids for o in squeezed] == alone
    assert sum(o.metrics.preemptions for o in squeezed) == metrics["preemptions"]
    assert tight.block_manager.num_free_blocks == tight.block_manager.num_blocks


def test_a_burst_beyond_max_num_seqs_runs_without_evictions(tiny_llama: Path) -> None:
    """More requests of one priority than sequence slots: those waiting age (here every 2 steps) but take the
    slots that free up, never a running one's; what runs matches each request alone."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    texts = prompts(12, seed=5, max_words=20)
    roomy = [o.output_token_ids for o in engine_for(tiny_llama).generate(texts, params)]
    engine = engine_for(tiny_llama, max_num_seqs=3, aging_steps=2)
    outs = engine.generate(texts, params)
    assert [o.output_token_ids for o in outs] == roomy
    assert engine.metrics()["preemptions"] == 0 and all(o.metrics.preemptions == 0 for o in outs)


def test_metrics_report_the_engine_state(tiny_llama: Path) -> None:
    engine = engine_for(tiny_llama)
    engine.generate(prompts(8, seed=2), SamplingParams(max_tokens=10, ignore_eos=True))
    m = engine.metrics()
    for key in ("ttft_mean", "ttft_p99", "tpot_mean", "queue_time_mean", "kv_blocks_used", "kv_blocks_free",
                "prefix_hit_rate", "preemptions", "kv_slot_waste", "kv_waste_contiguous_max_len"):
        assert key in m
    assert m["requests_finished"] == 8 and m["generated_tokens"] == 80
    assert m["kv_blocks_used"] == 0 and m["kv_blocks_free"] == m["kv_blocks_total"]
    assert 0 <= m["kv_slot_waste"] < m["kv_waste_contiguous_request"] < m["kv_waste_contiguous_max_len"] < 1


def test_metrics_split_steps_into_prompt_and_decode_steps(tiny_llama: Path) -> None:
    """Each step's wall time goes to its kind (``apiary bench engine``'s floor per kind): steps that run a prompt
    chunk and decode-only steps, with the rows each ran, the rows the LM head saw and, for decode steps, the cached
    tokens their attention read."""
    engine = engine_for(tiny_llama, max_num_batched_tokens=1024)
    texts = prompts(3, seed=4)
    lengths = [len(engine.tokenizer.encode(t)) for t in texts]
    engine.generate(texts, SamplingParams(max_tokens=5, ignore_eos=True))  # all three prompts in the first step
    m = engine.metrics()
    assert m["prompt_steps"] == 1 and m["decode_steps"] == 4 and m["steps"] == 5
    assert m["prompt_step_rows"] == sum(lengths) and m["prompt_step_sampled"] == 3
    assert m["decode_step_rows"] == m["decode_step_sampled"] == 12
    # decode step k (1-4) of a prompt of n tokens attends over n + k positions, its new token's included
    assert m["decode_step_context_tokens"] == sum(n + k for n in lengths for k in range(1, 5))
    assert m["prompt_step_seconds"] > 0 and m["decode_step_seconds"] > 0
    assert m["prompt_step_rows"] + m["decode_step_rows"] == m["computed_tokens"]


def test_an_announced_urgent_arrival_interrupts_a_less_urgent_step(tiny_llama: Path) -> None:
    """A step cut short for an urgent newcomer commits nothing: the interrupted work runs again
    later and every greedy token is the same as in an uninterrupted run."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    texts = prompts(6, seed=3)
    reference = engine_for(tiny_llama)
    expected = [o.output_token_ids for o in reference.generate(texts, params)]

    engine = engine_for(tiny_llama)
    ids = [engine.add_request(t, params=params, priority=0 if i == 0 else 5) for i, t in enumerate(texts)]
    engine.step()  # some work under way
    seqs = [engine.requests[i] for i in ids]

    engine.announce_arrival(5)  # nothing in the step is less urgent: no reason to stop it
    engine.step()
    assert engine.metrics()["interrupted_steps"] == 0
    engine.withdraw_arrival(5)
    before = [(s.num_computed_tokens, list(s.block_table), s.num_tokens) for s in seqs]

    engine.announce_arrival(0)  # more urgent than some of the step (priority 5): it stops early
    assert engine.step() == []
    assert engine.metrics()["interrupted_steps"] == 1
    after = [(s.num_computed_tokens, s.block_table[:len(b)], s.num_tokens) for s, (_, b, _) in zip(seqs, before)]
    assert after == before  # nothing committed, no block lost (the step may have grown the tables)
    urgent = engine.add_request("queen swarm", params=SamplingParams(max_tokens=3, ignore_eos=True), priority=0)
    engine.withdraw_arrival(0)
    outs = run_all(engine)
    assert outs[urgent][-1].finished
    assert [outs[i][-1].output_token_ids for i in ids] == expected
    assert engine.metrics()["interrupted_steps"] == 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_warm_up_loads_the_prompt_attention_kernels_before_serving(tiny_llama: Path) -> None:
    """In a fresh interpreter: creating the engine has already run (compiled or loaded) both CPU attention kernels
    for queries, the short-run one and the long-run one a first request's prompt takes (``long_runs_kernel``'s for
    the engine's cache: the bf16 one where ``vdpbf16ps`` compiles), so that request does not wait for them (a cold
    cache made a first prompt wait 5.9 s for the long-run kernel)."""
    import json
    import subprocess
    import sys

    code = ("import json; from apiary.cloud.engine import EngineConfig, LLMEngine; "
            "from apiary.kernels import cpu_attention as ca, ops; "
            f"e = LLMEngine(EngineConfig(model_path={str(tiny_llama)!r}, kv_cache_bytes=1 << 20)); "
            "long = ca.long_runs_kernel(ca._cache_array(e.runner.kv_caches[0].k)); "
            "print(json.dumps([ops.decode_backend(e.runner.device, e.runner.dtype), "
            "len(ca._varlen.signatures), len(long.signatures)]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    backend, short_runs, long_runs = json.loads(done.stdout.splitlines()[-1])
    if backend != "numba":
        pytest.skip(f"decode attention runs on {backend} here, not the numba kernels")
    assert short_runs >= 1 and long_runs >= 1
