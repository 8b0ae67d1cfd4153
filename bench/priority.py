"""Priority scheduling: high-priority TTFT under a saturating low-priority load, vs an idle engine and FCFS.

A stream of long low-priority requests keeps the engine saturated (every sequence slot busy and
more waiting: each one that finishes is replaced). Short high-priority requests arrive at fixed
wall-clock intervals through ``AsyncEngine``, so they land in the middle of running steps, as
they would from the REST/MQTT tiers; their TTFT is measured at the client, from submission to
the first streamed token. Conditions, in one run on one engine: the same high-priority
requests on an idle engine; under load with priorities (low = 10, high = 0); under the same
load first-come-first-served (everyone priority 0). Also reported: low-priority output tokens/s
and preemptions. Noisy shared machine: compare the rows of one run.
"""
from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path
from typing import Any

import typer


async def _high(engine: Any, prompt: list[int], params: Any, priority: int) -> float:
    start = time.perf_counter()
    ttft = None
    async for out in engine.stream(prompt, params=params, priority=priority):
        if ttft is None and out.new_token_ids:
            ttft = time.perf_counter() - start
    assert ttft is not None
    return ttft


async def _run_loaded(engine: Any, high: list[list[int]], low: list[list[int]], interval: float, concurrency: int,
                      slots: int, high_params: Any, low_params_for: Any, low_priority: int) -> dict[str, Any]:
    low_iter = iter(low)
    stop = asyncio.Event()
    low_tokens = 0

    async def low_worker() -> None:
        nonlocal low_tokens
        while not stop.is_set():
            prompt = next(low_iter)
            try:
                async for out in engine.stream(prompt, params=low_params_for(prompt), priority=low_priority):
                    low_tokens += len(out.new_token_ids)
                    if stop.is_set():
                        break
            except Exception:
                if not stop.is_set():
                    raise

    before = await asyncio.to_thread(engine.metrics)
    workers = [asyncio.create_task(low_worker()) for _ in range(concurrency)]
    while True:  # saturated: every slot busy with a low-priority request past its prefill, more waiting
        m = await asyncio.to_thread(engine.metrics)
        if m["requests_running"] >= slots and m["requests_waiting"] > 0 and m["generated_tokens"] - before["generated_tokens"] > 2 * slots:
            break
        await asyncio.sleep(0.2)
    start, tokens_at_start = time.perf_counter(), low_tokens
    tasks = []
    for prompt in high:
        tasks.append(asyncio.create_task(_high(engine, prompt, high_params, 0)))
        await asyncio.sleep(interval)
    ttfts = await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    low_rate = (low_tokens - tokens_at_start) / wall
    stop.set()
    for w in workers:
        w.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    after = await asyncio.to_thread(engine.metrics)
    return {"ttft": ttfts, "low_tok_s": low_rate, "preemptions": after["preemptions"] - before["preemptions"],
            "interrupted": after["interrupted_steps"] - before["interrupted_steps"]}


def command(
    high: int = typer.Option(16, help="high-priority requests per condition"),
    interval: float = typer.Option(1.0, help="seconds between high-priority arrivals"),
    max_num_seqs: int = typer.Option(16, help="engine sequence slots"),
    budget: int = typer.Option(128, help="engine max tokens per step (shorter steps: lower urgent TTFT)"),
    low_waiting: int = typer.Option(8, help="low-priority requests kept waiting beyond the running ones"),
    dtype: str = typer.Option("bfloat16", help="engine dtype"),
    threads: int = typer.Option(2, help="torch threads"),
    quick: bool = typer.Option(False, help="6 high-priority requests"),
    model: str = typer.Option("", help="GGUF or HF folder; default: the smollm2-135m-q4 asset"),
) -> None:
    from apiary.bench.common import percentile, report
    from apiary.bench.engine import WORDS
    from apiary.cloud.engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
    from apiary.shared import assets

    if quick:
        high = 6
    path = Path(model) if model else assets.ensure("smollm2-135m-q4")
    llm = LLMEngine(EngineConfig(model_path=path, dtype=dtype, num_threads=threads, kv_cache_bytes=1 << 30,
                                 max_num_batched_tokens=budget, max_num_seqs=max_num_seqs))
    tok = llm.tokenizer
    rng = random.Random(0)

    def prompt(n_tokens: int, tag: str) -> list[int]:
        ids: list[int] = []
        while len(ids) < n_tokens:
            ids += tok.encode(f"{tag}: " + " ".join(rng.choice(WORDS) for _ in range(n_tokens)))
        return ids[:n_tokens]

    high_prompts = [prompt(rng.randint(32, 64), f"urgent {i}") for i in range(high)]
    low_prompts = [prompt(rng.randint(256, 512), f"report {i}") for i in range(2000)]
    low_lengths = {id(p): rng.randint(128, 256) for p in low_prompts}
    high_params = SamplingParams(max_tokens=16, ignore_eos=True)

    def low_params_for(p: list[int]) -> Any:
        return SamplingParams(max_tokens=low_lengths[id(p)], ignore_eos=True)

    engine = AsyncEngine(llm)
    results: dict[str, dict[str, Any]] = {}
    loads: dict[str, tuple[float, float]] = {}
    concurrency = max_num_seqs + low_waiting
    try:
        async def idle() -> dict[str, Any]:
            ttfts = []
            for p in high_prompts:
                ttfts.append(await _high(engine, p, high_params, 0))
                await asyncio.sleep(0.05)
            return {"ttft": ttfts, "low_tok_s": 0.0, "preemptions": 0, "interrupted": 0}

        for name, runner in (
            ("idle engine", idle),
            ("loaded, priority", lambda: _run_loaded(engine, high_prompts, low_prompts[:1000], interval, concurrency,
                                                     max_num_seqs, high_params, low_params_for, low_priority=10)),
            ("loaded, FCFS", lambda: _run_loaded(engine, high_prompts, low_prompts[1000:], interval, concurrency,
                                                 max_num_seqs, high_params, low_params_for, low_priority=0)),
        ):
            llm_load = os.getloadavg()[0]
            typer.echo(f"{name} ... (load average {llm_load:.1f})")
            results[name] = asyncio.run(runner())
            loads[name] = (llm_load, os.getloadavg()[0])
            r = results[name]
            typer.echo(f"  TTFT p50 {percentile(r['ttft'], 50):.3f}s p99 {percentile(r['ttft'], 99):.3f}s")
    finally:
        engine.shutdown()
    idle_p50, idle_p99 = percentile(results["idle engine"]["ttft"], 50), percentile(results["idle engine"]["ttft"], 99)
    rows = []
    for name, r in results.items():
        p50, p99 = percentile(r["ttft"], 50), percentile(r["ttft"], 99)
        rows.append([name, len(r["ttft"]), p50, p99, p50 / idle_p50, p99 / idle_p99, round(r["low_tok_s"], 1),
                     r["preemptions"], r["interrupted"]])
    ratio = results["loaded, priority"]["ttft"]
    typer.echo(f"high-priority TTFT p99 under load / idle: {percentile(ratio, 99) / idle_p99:.2f}x (target <= 2x)")
    report("priority", f"High-priority TTFT under saturating low-priority load ({dtype}, budget {budget}, "
                       f"{max_num_seqs} slots, {threads} threads)",
           ["condition", "high req", "TTFT p50 s", "TTFT p99 s", "p50 / idle", "p99 / idle", "low-prio tok/s",
            "preemptions", "interrupted steps"], rows,
           {"ttfts": {k: v["ttft"] for k, v in results.items()}, "interval_s": interval, "budget": budget,
            "max_num_seqs": max_num_seqs, "low_concurrency": concurrency, "load_average_before_after": loads,
            "high": {"prompt_tokens": "32-64", "max_tokens": 16}, "low": {"prompt_tokens": "256-512",
                                                                          "max_tokens": "128-256"}})
