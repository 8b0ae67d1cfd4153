"""Speculative decoding: batch-1 tokens/s (plain / n-gram / draft) on sensor JSON and free text; batch-32 on vs off.

One fp32 engine serves every variant (speculation is switched per run), so plain, n-gram and
draft-model decoding see the same weights, caches and machine; runs are interleaved prompt by
prompt (rotating which variant goes first) so background load on a shared machine hits all of
them alike. Every prompt is prefilled once before timing, so the prefix cache serves all
variants equally and the numbers are about decoding. Greedy outputs are compared with plain
decoding token for token.

Structured prompts: ``apiary.shared.prompting.build_messages`` for simulator situations
(``apiary.firmware_bridge.simulator.labelled_situations``), with the assistant turn opened by
``{"assessment": "`` so the model writes the JSON action. Free text: open questions. The n-gram
history first holds the answers to ``--history`` other sensor events (as on a server that has
been answering for a while) and is then frozen, so timed runs cannot feed each other.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any

FREE_QUESTIONS = [
    "Write a short story about a beekeeper who finds a strange hive.",
    "Explain how solar panels work to a child.",
    "What are the main causes of colony collapse disorder?",
    "Describe the life cycle of a honey bee.",
    "Give me three tips for keeping bees in a hot climate.",
    "Why do bees dance?",
    "Compare wooden and plastic beehives.",
    "What should a beginner buy for their first hive?",
]
JSON_OPENING = '{"assessment": "'


def structured_prompts(tokenizer: Any, n: int, seed: int) -> list[list[int]]:
    from apiary.firmware_bridge.simulator import labelled_situations
    from apiary.shared.prompting import build_messages

    out = []
    for s in labelled_situations(n, seed=seed):
        messages = [m.model_dump() for m in build_messages(s.event, s.context)]
        out.append(tokenizer.encode(tokenizer.apply_chat_template(messages) + JSON_OPENING))
    return out


def free_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
            for q in (FREE_QUESTIONS * (n // len(FREE_QUESTIONS) + 1))[:n]]


def command(prompts: int = 6, max_tokens: int = 64, k: int = 8, draft_layers: int = 8, draft_path: str = "",
            history: int = 16, batch: int = 32, batch_rounds: int = 2, threads: int = 0, seed: int = 0,
            model: str = "") -> None:
    import torch

    from apiary.bench.common import report
    from apiary.cloud.engine import EngineConfig, LLMEngine, SamplingParams
    from apiary.cloud.engine.spec import SpeculativeConfig
    from apiary.shared import assets

    path = model or str(assets.ensure("smollm2-135m-q4"))
    engine = LLMEngine(EngineConfig(
        model_path=path, dtype="float32", kv_cache_bytes=1 << 30, max_num_seqs=max(batch, 8),
        max_num_batched_tokens=2048, num_threads=threads or None,
        speculative=SpeculativeConfig(method="draft", k=k, draft_model_path=draft_path or None,
                                      draft_num_layers=None if draft_path else draft_layers)))
    spec = engine.speculator
    assert spec is not None
    tok = engine.tokenizer
    greedy = SamplingParams(max_tokens=max_tokens)

    def use(variant: str) -> None:
        """plain, ngram, draft (the adaptive policy decides), draft-forced (always k proposals), or
        ngram-uncapped (no max_batch cap: the measured step times alone decide)."""
        spec.enabled = variant != "plain"
        spec.config.adaptive = variant != "draft-forced"
        for policy in spec.policies.values():
            policy.max_batch = 1 << 30 if variant == "ngram-uncapped" else spec.config.max_batch
        if variant != "plain":
            spec.method = variant.removesuffix("-forced").removesuffix("-uncapped")

    def run_one(prompt: list[int], variant: str) -> dict[str, Any]:
        use(variant)
        before = engine.metrics()
        start = time.perf_counter()
        out = engine.generate(prompt, greedy)[0]
        wall = time.perf_counter() - start
        after = engine.metrics()
        m = out.metrics
        decode_s = m.finish_time - m.first_token_time
        row: dict[str, Any] = {"variant": variant, "latency_s": wall, "tokens": len(out.output_token_ids),
                               "decode_s": decode_s, "ids": out.output_token_ids}
        if variant != "plain":
            method = spec.method
            for key in ("proposed", "accepted", "verifications"):
                row[key] = after[f"spec_{method}_{key}"] - before[f"spec_{method}_{key}"]
        return row

    variants = ["plain", "ngram", "draft", "draft-forced"]
    workloads = {"structured": structured_prompts(tok, prompts, seed), "free": free_prompts(tok, prompts)}
    warm = SamplingParams(max_tokens=1)
    for plist in workloads.values():  # prefill once: every variant then finds the prompt in the prefix cache
        engine.generate(plist, [warm] * len(plist))
    for variant in variants:  # one untimed decode per variant: first-call overheads, step-time table
        run_one(workloads["free"][0], variant)
    # The n-gram history: the server has answered `history` other sensor events before; then it is frozen,
    # so timed runs of one prompt (plain, draft, n-gram) cannot feed each other's outputs to the lookup.
    spec.ngram.history.clear()
    engine.generate(structured_prompts(tok, history, seed + 1000), [greedy] * history)
    spec.ngram.history.frozen = True

    rows, raw = [], {}
    for name, plist in workloads.items():
        results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        for i, prompt in enumerate(plist):
            # draft-forced (k proposals every step, whatever they cost) only shows the truncated draft's
            # acceptance and cost; two prompts per workload are enough for that and it is slow.
            here = variants if i < 2 else variants[:3]
            shift = i % len(here)
            for variant in here[shift:] + here[:shift]:
                results[variant].append(run_one(prompt, variant))
            print(f"{name} {i + 1}/{len(plist)}: " + ", ".join(
                f"{v} {results[v][-1]['tokens'] / results[v][-1]['latency_s']:.1f} tok/s" for v in here), flush=True)
        for variant in variants:
            rs = results[variant]
            plain = results["plain"][:len(rs)]  # the same prompts
            plain_tps = sum(r["tokens"] for r in plain) / sum(r["latency_s"] for r in plain)
            tps = sum(r["tokens"] for r in rs) / sum(r["latency_s"] for r in rs)
            same = sum(r["ids"] == p["ids"] for r, p in zip(rs, results["plain"]))
            proposed = sum(r.get("proposed", 0) for r in rs)
            accepted = sum(r.get("accepted", 0) for r in rs)
            verifs = sum(r.get("verifications", 0) for r in rs)
            rows.append([name, variant, len(rs), statistics.mean(r["latency_s"] for r in rs), tps, tps / plain_tps,
                         accepted / proposed if proposed else "-",
                         (accepted + verifs) / verifs if verifs else "-", f"{same}/{len(rs)}"])
        raw[name] = {v: [{k2: v2 for k2, v2 in r.items() if k2 != "ids"} for r in rs] for v, rs in results.items()}

    # Batch throughput: `batch` structured requests at once, speculation off vs on (n-gram, draft).
    bprompts = structured_prompts(tok, batch, seed + 1)
    engine.generate(bprompts, [warm] * len(bprompts))
    batch_variants = [*variants[:3], "ngram-uncapped"]
    for variant in batch_variants:  # untimed: step times of the batch sizes get measured, the draft caches fill
        use(variant)
        engine.generate(bprompts, [SamplingParams(max_tokens=max(8, max_tokens // 4))] * len(bprompts))
    batch_tps: dict[str, list[float]] = {v: [] for v in batch_variants}
    batch_steps: dict[str, list[int]] = {v: [] for v in batch_variants[1:]}
    batch_same: dict[str, int] = {v: 0 for v in batch_variants}
    for _ in range(batch_rounds):
        plain_ids: list[list[int]] = []
        for variant in batch_variants:
            use(variant)
            before = engine.metrics()
            start = time.perf_counter()
            outs = engine.generate(bprompts, [greedy] * len(bprompts))
            wall = time.perf_counter() - start
            batch_tps[variant].append(sum(len(o.output_token_ids) for o in outs) / wall)
            ids = [o.output_token_ids for o in outs]
            plain_ids = plain_ids or ids  # plain runs first in each round
            batch_same[variant] += sum(a == b for a, b in zip(ids, plain_ids))
            if variant != "plain":
                key = f"spec_{spec.method}_steps_on"
                batch_steps[variant].append(engine.metrics()[key] - before[key])
            print(f"batch {batch} {variant}: {batch_tps[variant][-1]:.1f} tok/s", flush=True)
    off = statistics.mean(batch_tps["plain"])
    for variant in batch_variants:
        on = statistics.mean(batch_tps[variant])
        rows.append([f"batch {batch}", variant, batch, "-", on, on / off, "-",
                     f"spec steps {sum(batch_steps.get(variant, [0]))}" if variant != "plain" else "-",
                     f"{batch_same[variant]}/{batch * batch_rounds}"])
    use("plain")
    history_tokens = spec.ngram.history.num_tokens
    columns = ["workload", "variant", "requests", "mean latency s", "tok/s", "vs plain", "acceptance",
               "tokens/verify", "same as plain"]
    report("spec", f"Speculative decoding (max_tokens={max_tokens}, k<={k}, draft = first {draft_layers} layers, "
           f"threads={torch.get_num_threads()})", columns, rows,
           {"raw": raw, "batch_tokens_per_s": batch_tps, "load_average_at_end": os.getloadavg(),
            "config": {"prompts": prompts, "max_tokens": max_tokens, "k": k, "draft_layers": draft_layers,
                       "draft_path": draft_path or None, "history_requests": history, "history_tokens": history_tokens,
                       "batch": batch, "batch_rounds": batch_rounds, "threads": torch.get_num_threads(),
                       "model": path},
            "metrics": {key: v for key, v in engine.metrics().items() if key.startswith("spec_")}})
