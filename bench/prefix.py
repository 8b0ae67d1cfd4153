"""Prefix caching: time to first token for requests sharing a 1,024-token system prompt, cold vs cached.

Each request is the same long system prompt plus its own short question, served alone on an
otherwise idle engine. Cold: the prefix cache is emptied before every request, so the whole
prompt is computed. Cached: one earlier request left the system prompt's blocks in the cache,
so only the question's tokens are computed. Greedy outputs must be identical both ways (the
run fails otherwise). Cold and cached requests alternate, so machine noise hits both alike.

The engine's step budget is the part of the system prompt that fills whole KV blocks (all
1,024 tokens by default, also the engine's default budget): exactly what a cached request
finds in the cache. So a cold prompt is computed as that part and then the rest, over the
cache: the same computation the cached request does for its rest. The outputs are therefore
bit-identical, and any difference is a bug. (With a budget that takes the whole prompt in one chunk, the question's
attention runs through a different kernel call, and in bf16 that rounding flipped near-tie
tokens in 1-2 of 8 requests.)
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import typer


def command(
    requests: int = typer.Option(8, help="requests per condition"),
    system_tokens: int = typer.Option(1024, help="shared system prompt length (tokens)"),
    max_tokens: int = typer.Option(8, help="generated tokens per request"),
    dtype: str = typer.Option("bfloat16", help="engine dtype"),
    threads: int = typer.Option(2, help="torch threads"),
    model: str = typer.Option("", help="GGUF or HF folder; default: the smollm2-135m-q4 asset"),
) -> None:
    import random

    from apiary.bench.common import percentile, report
    from apiary.cloud.engine import EngineConfig, LLMEngine, SamplingParams
    from apiary.shared import assets

    from apiary.bench.engine import WORDS

    path = Path(model) if model else assets.ensure("smollm2-135m-q4")
    block_size = EngineConfig(model_path=path).block_size
    cached_part = max(block_size, system_tokens // block_size * block_size)  # what the prefix cache can hold
    engine = LLMEngine(EngineConfig(model_path=path, dtype=dtype, num_threads=threads, kv_cache_bytes=1 << 30,
                                    max_num_batched_tokens=cached_part))
    tok = engine.tokenizer
    rng = random.Random(0)
    system: list[int] = []
    while len(system) < system_tokens:
        system += tok.encode("You monitor beehives. " + " ".join(rng.choice(WORDS) for _ in range(200)))
    system = system[:system_tokens]
    questions = [tok.encode(f"\nQuestion {i}: is hive {i} " + " ".join(rng.choice(WORDS) for _ in range(20)) + "?")
                 for i in range(requests)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    def serve(prompt: list[int]) -> tuple[float, list[int], int]:
        before = engine.stats.computed_tokens
        out = engine.generate([prompt], params)[0]
        return out.metrics.ttft, out.output_token_ids, engine.stats.computed_tokens - before

    engine.reset_prefix_cache()
    serve(system + tok.encode("\nwarm-up"))  # leaves the system prompt's blocks in the cache
    cold, warm, computed = [], [], {"cold": 0, "cached": 0}
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    for q in questions:
        engine.reset_prefix_cache()
        t_cold, out_cold, n_cold = serve(system + q)
        # The cold run just filled the cache with this very prompt; make the cached run hit only the
        # shared system prompt: drop everything, then warm with a different question.
        engine.reset_prefix_cache()
        serve(system + tok.encode("\nanother question"))
        t_warm, out_warm, n_warm = serve(system + q)
        if out_cold != out_warm:
            raise typer.Exit(f"cached output differs from cold output for {q!r}")  # type: ignore[arg-type]
        cold.append(t_cold)
        warm.append(t_warm)
        computed["cold"] += n_cold
        computed["cached"] += n_warm
    wall = time.perf_counter() - start
    speedup = percentile(cold, 50) / percentile(warm, 50)
    rows = [["cold (cache emptied)", len(cold), percentile(cold, 50), percentile(cold, 99), computed["cold"] / len(cold)],
            ["cached system prompt", len(warm), percentile(warm, 50), percentile(warm, 99), computed["cached"] / len(warm)]]
    typer.echo(f"TTFT p50 speedup from the prefix cache: {speedup:.1f}x (target >= 5x)")
    report("prefix", f"TTFT with a shared {system_tokens}-token system prompt ({dtype}, {threads} threads)",
           ["condition", "requests", "TTFT p50 s", "TTFT p99 s", "tokens computed / request"], rows,
           {"ttft_p50_speedup": speedup, "ttft_cold_s": cold, "ttft_cached_s": warm, "wall_s": wall,
            "system_tokens": system_tokens, "question_tokens": [len(q) for q in questions],
            "load_average_before_after": [load_before, os.getloadavg()[0]], "dtype": dtype, "threads": threads,
            "prefix_hit_rate": engine.metrics()["prefix_hit_rate"]})
