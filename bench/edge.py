"""Edge cascade: edge-only vs cloud-only vs cascade accuracy on labelled situations; edge tok/s, latency, RSS, J/answer.

The evaluation set is ``bench/data/edge_eval_{calibration,test}.jsonl`` (simulator
situations with ground truth, made by ``python -m bench.make_edge_eval``). Every
situation goes through the edge exactly as the agent handles it (triage, then the
llama.cpp INT4 model with the JSON grammar, confidence from logprob quantiles);
every situation that needs an answer also goes to the cloud tier exactly as the cloud
worker answers an escalation (``cloud.actions.generate_action`` on the cloud engine, same
GGUF dequantized, fp32 by default: one request decoded under the same JSON Schema, its
confidence scored by the edge's rule). Both answers are kept, so the cascade can be replayed
for any threshold without re-running a model:

* the confidence threshold is chosen on the **calibration** split (best accuracy with at
  most ``--max-escalated`` of answered events escalated; ties: fewer escalations) and
  scored on the **test** split;
* "cascade" escalates on confidence and invalid answers only; "cascade + policy" also
  applies the default policy's rule that critical-severity events always go to the cloud.

Routine readings (severity info, no flags) are triaged as "normal" with no model call
in every strategy, as the agent does. The energy budget is disabled for the evaluation
(every event may use the model); joules per answered event use the configured power
profile's watts per busy core. The machine is shared and noisy (2 cores, other
engineers' jobs): the thread comparison runs its two settings interleaved on the same
prompts, and wall-clock numbers should be compared within one run only.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import typer


@dataclass(slots=True)
class Case:
    """One situation and what each tier said about it."""

    id: str
    split: str
    label: str
    event: Any  # SensorEvent
    context: list[Any]
    needs_answer: bool
    edge_pred: str = "normal"
    edge_valid: bool = True
    score: float | None = None
    critical: bool = False
    cloud_pred: str | None = None
    cloud_error: str | None = None
    cloud_score: float | None = None  # the cloud answer's confidence, by the edge's rule (p10 choice logprob)
    cloud_prompt_tokens: int = 0
    cloud_completion_tokens: int = 0
    edge: dict[str, float] = field(default_factory=dict)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _load_cases(limit: int) -> list[Case]:
    from bench.make_edge_eval import load
    from edge.triage import needs_answer
    from shared.protocol import SensorEvent

    cases = []
    for split in ("calibration", "test"):
        rows = load(split)
        if limit:
            rows = rows[:limit]
        for r in rows:
            ev = SensorEvent.model_validate(r["event"])
            cases.append(Case(id=r["id"], split=split, label=r["label"], event=ev,
                              context=[SensorEvent.model_validate(c) for c in r["context"]],
                              needs_answer=needs_answer(ev)))
    return cases


def _run_edge(cases: list[Case], settings: Any, model: Any) -> None:
    """Each case through the agent's Responder, always answering locally (the cascade is replayed later)."""
    from edge.policy import EscalationPolicy, Situation
    from edge.responder import Responder

    responder = Responder(settings, model)
    default = EscalationPolicy()
    for i, c in enumerate(cases):
        out = responder.respond(c.event, c.context, request_id=c.id)
        if out.route == "logged":
            continue
        g, a = out.generation, out.answer
        c.edge_valid = a.action is not None
        c.edge_pred = a.action["assessment"] if a.action else "invalid"
        c.score = out.confidence.score if out.confidence else None
        c.critical = bool(default.critical(Situation.of(c.event, link_up=True)))
        c.edge = {"latency_ms": a.latency_ms, "wall_s": g.wall_s, "prefill_s": g.prefill_s, "cpu_s": g.cpu_s,
                  "tokens": g.completion_tokens,
                  "prompt_tokens": g.prompt_tokens, "cached_tokens": g.cached_tokens, "energy_j": a.energy_j or 0.0}
        if (i + 1) % 20 == 0:
            print(f"  edge: {i + 1}/{len(cases)} situations")


def _run_cloud(cases: list[Case], model_path: str, dtype: str, max_tokens: int) -> str | None:
    """Cloud-tier answers for every case that needs one; returns why it was skipped, or None."""
    try:
        import asyncio

        from cloud.actions import generate_action
        from cloud.engine import AsyncEngine, EngineConfig, LLMEngine
    except ImportError as e:
        return f"cloud engine not importable ({e}); cloud-only and cascade rows skipped"
    from shared.prompting import build_messages

    llm = LLMEngine(EngineConfig(model_path=model_path, dtype=dtype))
    engine = AsyncEngine(llm)
    todo = [c for c in cases if c.needs_answer]

    async def one(c: Case) -> None:
        messages = [m.model_dump() for m in build_messages(c.event, c.context)]
        out = await generate_action(engine, messages=messages, max_tokens=max_tokens)
        c.cloud_pred = out.action["assessment"] if out.action else "invalid"
        c.cloud_error = out.error
        c.cloud_score = out.score
        c.cloud_prompt_tokens, c.cloud_completion_tokens = out.prompt_tokens, out.completion_tokens

    async def run_all() -> None:
        await asyncio.gather(*(one(c) for c in todo))

    try:
        asyncio.run(run_all())
    finally:
        engine.shutdown()
    for c in cases:
        if not c.needs_answer:
            c.cloud_pred = "normal"
    return None


def _escalates(c: Case, threshold: float, with_policy: bool) -> bool:
    if not c.needs_answer:
        return False
    if with_policy and c.critical:
        return True
    return not c.edge_valid or c.score is None or c.score < threshold


def _final(c: Case, draft: bool) -> str | None:
    """The escalated event's final assessment, as the agent decides it (``edge.agent.final_from_reply``):
    the cloud's answer when it is valid, else the local draft when there is one."""
    if c.cloud_pred == "invalid" and draft and c.edge_valid:
        return c.edge_pred
    return c.cloud_pred


def _score(cases: list[Case], threshold: float | None, with_policy: bool = False,
           draft: bool = True) -> dict[str, float]:
    """Accuracy, share escalated (of answered events) and cloud tokens of one strategy.

    ``threshold=None`` means edge-only; ``-inf`` with no policy never escalates, ``+inf`` always
    does. ``draft``: the edge answered first, so a failed cloud answer falls back to it.
    """
    answered = [c for c in cases if c.needs_answer]
    correct = esc = prompt_tok = completion_tok = agree = 0
    for c in cases:
        e = threshold is not None and _escalates(c, threshold, with_policy)
        pred = _final(c, draft) if e else c.edge_pred
        correct += pred == c.label
        agree += pred == c.cloud_pred
        if e:
            esc += 1
            prompt_tok += c.cloud_prompt_tokens
            completion_tok += c.cloud_completion_tokens
    return {"accuracy": correct / len(cases), "escalated": esc / max(1, len(answered)),
            "cloud_prompt_tokens": prompt_tok, "cloud_completion_tokens": completion_tok,
            "agree_with_cloud": agree / len(cases)}


def _choose_threshold(cases: list[Case], max_escalated: float) -> float:
    """Best calibration accuracy with at most ``max_escalated`` escalated; ties go to fewer escalations."""
    candidates = sorted({c.score for c in cases if c.score is not None} | {-math.inf})
    best, best_key = -math.inf, None
    for t in candidates:
        s = _score(cases, t)
        if s["escalated"] > max_escalated + 1e-9:
            continue
        key = (s["accuracy"], -s["escalated"])
        if best_key is None or key > best_key:
            best, best_key = t, key
    return best


def _thread_comparison(model: Any, cases: list[Case], n: int) -> list[list[Any]]:
    """Same prompts at 1 and 2 llama.cpp threads, interleaved, for a side-by-side tok/s ratio."""
    from shared.prompting import build_messages

    prompts = [build_messages(c.event, c.context) for c in cases if c.needs_answer][:n]
    stats = {1: [0, 0.0, 0.0], 2: [0, 0.0, 0.0]}  # tokens, wall, cpu
    for msgs in prompts:
        for threads in (1, 2):
            model.set_threads(threads)
            g = model.generate(msgs, max_tokens=96)
            s = stats[threads]
            s[0] += g.completion_tokens
            s[1] += g.wall_s
            s[2] += g.cpu_s
    model.set_threads(1)
    return [[t, s[0] / s[1], s[2] / max(1, s[0]) * 1000.0] for t, s in stats.items()]


def _chain_decode(model: Any, messages: list[Any], max_tokens: int) -> tuple[bytes, int, float]:
    """The obvious alternative to LocalModel's loop: llama.cpp's sampler chain with the grammar first,
    which applies the grammar to all 49k candidates every step. Returns (text, tokens, decode seconds)."""
    import llama_cpp

    llm = model.llm
    tokens = model.tokenize(model.prompt_text(messages))
    llm.reset()
    llm.eval(tokens)  # prefill is not timed: only decoding is compared
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_grammar(
        llm._model.vocab, model.grammar_text.encode(), b"root"))
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    out: list[int] = []
    t0 = time.perf_counter()
    try:
        for _ in range(max_tokens):
            tok = llama_cpp.llama_sampler_sample(chain, llm._ctx.ctx, -1)  # applies the chain and accepts
            if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok):
                break
            out.append(tok)
            llm.eval([tok])
    finally:
        llama_cpp.llama_sampler_free(chain)
    return b"".join(llm.detokenize([t]) for t in out), len(out), time.perf_counter() - t0


def _highlevel_decode(llm: Any, grammar: Any, messages: list[Any], max_tokens: int) -> tuple[str, int, float]:
    """llama-cpp-python's high-level path with logprobs (needs ``logits_all=True``) and the same grammar.
    Called twice; the second call finds the whole prompt in the KV cache, so it times decoding."""
    msgs = [m.model_dump() for m in messages]
    kwargs = dict(max_tokens=max_tokens, temperature=0.0, grammar=grammar, logprobs=True, top_logprobs=1)
    llm.create_chat_completion(msgs, **kwargs)
    t0 = time.perf_counter()
    r = llm.create_chat_completion(msgs, **kwargs)
    return r["choices"][0]["message"]["content"], r["usage"]["completion_tokens"], time.perf_counter() - t0


def _grammar_comparison(model: Any, cases: list[Case], n: int) -> list[list[Any]]:
    """Three ways to get grammar-constrained greedy answers, same prompts, decode tok/s side by side:
    LocalModel's loop (top-k grammar check + per-token logprobs), llama.cpp's grammar-first sampler
    chain (no logprobs), and llama-cpp-python's high-level chat completion with logprobs."""
    from llama_cpp import Llama, LlamaGrammar

    from shared.prompting import build_messages

    prompts = [build_messages(c.event, c.context) for c in cases if c.needs_answer][:n]
    high = Llama(str(model.path), n_ctx=model.n_ctx, n_threads=model.threads, n_threads_batch=model.threads,
                 logits_all=True, verbose=False)
    grammar = LlamaGrammar.from_string(model.grammar_text, verbose=False)
    stats = {k: [0, 0.0, 0] for k in ("lazy", "chain", "high")}  # tokens, seconds, identical to LocalModel
    for msgs in prompts:
        g = model.generate(msgs, max_tokens=96)
        stats["lazy"][0] += g.completion_tokens
        stats["lazy"][1] += g.wall_s - g.prefill_s
        stats["lazy"][2] += 1
        text, count, seconds = _chain_decode(model, msgs, 96)
        stats["chain"][0] += count
        stats["chain"][1] += seconds
        stats["chain"][2] += text.decode("utf-8", errors="replace") == g.text
        text, count, seconds = _highlevel_decode(high, grammar, msgs, 96)
        stats["high"][0] += count
        stats["high"][1] += seconds
        stats["high"][2] += text == g.text
    high.close()
    names = {"lazy": "LocalModel loop, logprobs", "chain": "grammar-first sampler chain, no logprobs",
             "high": "create_chat_completion(logprobs=True)"}
    return [[names[k], t / s, f"{same}/{len(prompts)} same text"] for k, (t, s, same) in stats.items()]


def command(
    limit: int = typer.Option(0, help="use only the first N situations of each split (0: all)"),
    threads: int = typer.Option(1, help="llama.cpp threads for the evaluation (1 is robust on a shared machine)"),
    max_escalated: float = typer.Option(0.5, help="most of the answered events the cascade may escalate"),
    cloud_dtype: str = typer.Option("float32", help="cloud engine dtype (float32 | bfloat16)"),
    cloud_max_tokens: int = typer.Option(128, help="max tokens per cloud answer"),
    skip_cloud: bool = typer.Option(False, help="edge only (no cloud engine)"),
    thread_prompts: int = typer.Option(6, help="prompts for the 1-vs-2 thread comparison (0: skip)"),
    grammar_prompts: int = typer.Option(3, help="prompts for the grammar-strategy comparison (0: skip)"),
) -> None:
    """Evaluate edge-only, cloud-only and the cascade; measure the edge's speed, latency, memory and energy."""
    import numpy as np

    from bench.common import percentile, report
    from edge.model import LocalModel
    from edge.settings import EdgeSettings, PolicySettings, PowerProfile
    from shared import assets

    rss0 = _rss_mib()
    gguf = str(assets.ensure("smollm2-135m-q4"))
    settings = EdgeSettings(threads=threads, power=PowerProfile(enabled=False),
                            policy=PolicySettings(min_confidence=-math.inf, critical_severities=[]))
    cases = _load_cases(limit)
    print(f"{len(cases)} situations ({sum(c.needs_answer for c in cases)} need an answer); edge pass ...")
    load_t = time.perf_counter()
    model = LocalModel(gguf, n_ctx=settings.n_ctx, threads=threads, top_k=settings.top_k)
    load_s = time.perf_counter() - load_t
    t0 = time.perf_counter()
    _run_edge(cases, settings, model)
    edge_s = time.perf_counter() - t0
    rss_edge = _rss_mib()
    speed_rows = _thread_comparison(model, cases, thread_prompts) if thread_prompts else []
    grammar_rows = _grammar_comparison(model, cases, grammar_prompts) if grammar_prompts else []
    model.close()

    skipped = "cloud pass skipped (--skip-cloud)" if skip_cloud else None
    if not skip_cloud:
        print("cloud pass ...")
        t0 = time.perf_counter()
        skipped = _run_cloud(cases, gguf, cloud_dtype, cloud_max_tokens)
        cloud_s = time.perf_counter() - t0
    if skipped:
        print(skipped)

    cal = [c for c in cases if c.split == "calibration"]
    test = [c for c in cases if c.split == "test"]
    columns = ["strategy (test split)", "accuracy", "escalated", "cloud prompt tok", "cloud completion tok",
               "agree w/ cloud-only"]
    rows: list[list[Any]] = []
    threshold = None
    edge_only = _score(test, None)
    rows.append(["edge only", edge_only["accuracy"], 0.0, 0, 0,
                 edge_only["agree_with_cloud"] if not skipped else "-"])
    if not skipped:
        threshold = _choose_threshold(cal, max_escalated)
        for name, t, pol, draft in (("cloud only", math.inf, False, False),
                                    (f"cascade (p10 logprob < {threshold:.2f})", threshold, False, True),
                                    ("cascade + policy (critical -> cloud)", threshold, True, True)):
            s = _score(test, t, pol, draft)
            rows.append([name, s["accuracy"], s["escalated"], s["cloud_prompt_tokens"], s["cloud_completion_tokens"],
                         s["agree_with_cloud"]])

    answered = [c for c in cases if c.needs_answer and c.edge]
    tokens = sum(c.edge["tokens"] for c in answered)
    wall = sum(c.edge["wall_s"] for c in answered)
    prefill = sum(c.edge["prefill_s"] for c in answered)
    prefilled = sum(c.edge["prompt_tokens"] - c.edge["cached_tokens"] for c in answered)
    lat = [c.edge["latency_ms"] for c in answered]
    energy = sum(c.edge["energy_j"] for c in answered)
    per_label = {}
    for label in sorted({c.label for c in test}):
        group = [c for c in test if c.label == label]
        per_label[label] = {"n": len(group), "edge": float(np.mean([c.edge_pred == label for c in group])),
                            **({"cloud": float(np.mean([c.cloud_pred == label for c in group]))} if not skipped else {})}
    runtime = {
        "edge_tokens_per_s": tokens / wall if wall else float("nan"),
        "edge_decode_tokens_per_s": tokens / (wall - prefill) if wall > prefill else float("nan"),
        "edge_prefill_tokens_per_s": prefilled / prefill if prefill else float("nan"),
        "decision_latency_ms_p50": percentile(lat, 50), "decision_latency_ms_p99": percentile(lat, 99),
        "rss_mib_edge": rss_edge, "rss_mib_before_model": rss0, "model_load_s": load_s,
        "joules_per_answered_event": energy / max(1, len(answered)),
        "cpu_watts_per_core": settings.power.cpu_watts, "edge_answered": len(answered),
        "edge_invalid": sum(not c.edge_valid for c in answered),
        "mean_completion_tokens": tokens / max(1, len(answered)),
        "mean_prompt_tokens": float(np.mean([c.edge["prompt_tokens"] for c in answered])) if answered else 0.0,
        "mean_cached_prompt_tokens": float(np.mean([c.edge["cached_tokens"] for c in answered])) if answered else 0.0,
        "edge_pass_s": edge_s, "threads": threads,
    }
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"edge runtime (llama.cpp, {threads} thread(s), {len(answered)} answered events)")
    for col in ("metric", "value"):
        table.add_column(col)
    for k, v in runtime.items():
        table.add_row(k, f"{v:.3g}" if isinstance(v, float) else str(v))
    for t, tps, cpu_ms in speed_rows:
        table.add_row(f"tok/s at {t} thread(s) (side by side)", f"{tps:.3g}")
        table.add_row(f"CPU ms/token at {t} thread(s)", f"{cpu_ms:.3g}")
    for name, tps, note in grammar_rows:
        table.add_row(f"decode tok/s, {name}", f"{tps:.3g} {note}".strip())
    Console().print(table)
    extra = {"runtime": runtime, "threshold": threshold, "max_escalated": max_escalated,
             "calibration": {"n": len(cal), **({"cascade": _score(cal, threshold), "edge_only": _score(cal, None),
                                                  "cloud_only": _score(cal, math.inf, draft=False)} if threshold is not None else {})},
             "test_n": len(test), "per_label_test": per_label, "thread_comparison": speed_rows,
             "grammar_comparison": grammar_rows,
             "cloud": {"skipped": skipped, "dtype": cloud_dtype, **({"pass_s": cloud_s} if not skipped else {})},
             "confusion_edge_test": _confusion(test, "edge_pred"),
             "cases": [{"id": c.id, "split": c.split, "label": c.label, "edge": c.edge_pred, "score": c.score,
                        "critical": c.critical, "cloud": c.cloud_pred, "cloud_error": (c.cloud_error or "")[:200],
                        "cloud_score": c.cloud_score,
                        "cloud_tokens": [c.cloud_prompt_tokens, c.cloud_completion_tokens]} for c in cases],
             **({"confusion_cloud_test": _confusion(test, "cloud_pred")} if not skipped else {})}
    report("edge", "Edge vs cloud vs cascade (SmolLM2-135M; edge Q4_1 llama.cpp, cloud same GGUF on the cloud engine)",
           columns, rows, extra)


def _confusion(cases: list[Case], attr: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for c in cases:
        pred = getattr(c, attr) or "none"
        out.setdefault(c.label, {}).setdefault(pred, 0)
        out[c.label][pred] += 1
    return out
