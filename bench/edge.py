"""Edge cascade: edge-only vs cloud-only vs cascade accuracy on labelled situations; edge tok/s, latency, RSS, J/answer.

The evaluation set is ``bench/data/edge_eval_{calibration,test,shift}.jsonl`` (simulator
situations with ground truth, as the bridge publishes them, made by ``python -m
bench.make_edge_eval``; ``shift`` is a hotter climate with noisier sensors than anything is
tuned on). Every situation goes through the edge exactly as the agent handles it (triage
with ``apiary.edge.triage.needs_answer(event, context)``, then the llama.cpp INT4 model with the JSON
grammar, confidence from logprob quantiles); every situation that needs an answer also goes
to the cloud tier exactly as the cloud worker answers an escalation
(``apiary.cloud.actions.generate_action`` on the cloud engine: the registry GGUF dequantized, fp32 by
default, plus the LoRA adapter of ``--cloud-adapter``, by default the shipped teacher adapter,
as ``apiary cloud serve`` does; one request decoded under the
same JSON Schema, its confidence scored by the edge's rule). Both answers are kept, so the
cascade can be replayed for any threshold without re-running a model:

* the confidence threshold is chosen on the **calibration** split (best accuracy with at
  most ``--max-escalated`` of answered events escalated; ties: fewer escalations) and
  scored on the **test** and **shift** splits;
* "cascade" escalates on confidence and invalid answers only; "cascade + policy" also
  applies the default policy's rule that critical-severity events always go to the cloud.

Prompt styles (``apiary.shared.prompting.build_messages``): the edge asks in ``--edge-prompt-style``
(``auto``: ``LocalModel``'s own resolution, the GGUF's ``apiary.prompt_style`` metadata
(``apiary.shared.prompting.PROMPT_STYLE_KEY``), else ``examples``; the agent's Responder builds the
prompt in ``LocalModel.prompt_style``), the cloud in its
engine's style (``AsyncEngine.prompt_style``: the adapter's, else ``examples``), as the worker
does. With the defaults the edge is the shipped edge image's INT4 student and the cloud the
tuned teacher, both asking in the short prompt, as ``apiary demo`` runs them.

Routine readings (severity info, no flags, device not flagged just before) are triaged as
"normal" with no model call in every strategy, as the agent does. The energy budget is
disabled for the evaluation (every event may use the model); joules per answered event use
the configured power profile's watts per busy core. Per scored split the JSON under
results/bench/ holds per-label accuracy per tier (triage, edge only, cloud only, cascade),
escalated share, agreement with cloud-only, prompt tokens per answered event on each tier,
edge joules per answered event, invalid answers per tier and confusion matrices; next to it,
``edge-confusion-<tier>.png`` per tier and ``edge-cascade-curve.png`` (accuracy against the
escalated share as the threshold moves). The machine is shared and noisy (2 cores, other
engineers' jobs): the thread comparison runs its two settings interleaved on the same
prompts, and wall-clock numbers should be compared within one run only.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import typer

CALIBRATION = "calibration"
SCORED_SPLITS = ("test", "shift")
STYLE_CHOICES = ("auto", "examples", "short")
TIERS = ("triage", "edge_only", "cloud_only", "cascade")
TIER_NAMES = {"triage": "triage", "edge_only": "edge only", "cloud_only": "cloud only", "cascade": "cascade"}


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
    from apiary.bench.make_edge_eval import SPLITS, load, path_of
    from apiary.edge.triage import needs_answer
    from apiary.shared.protocol import SensorEvent

    cases = []
    for split in SPLITS:
        if not path_of(split).is_file():
            raise typer.BadParameter(f"{path_of(split)} is missing: run python -m apiary.bench.make_edge_eval")
        rows = load(split)
        if limit:
            rows = rows[:limit]
        for r in rows:
            ev = SensorEvent.model_validate(r["event"])
            context = [SensorEvent.model_validate(c) for c in r["context"]]
            cases.append(Case(id=r["id"], split=split, label=r["label"], event=ev, context=context,
                              needs_answer=needs_answer(ev, context)))
    return cases


def _run_edge(cases: list[Case], settings: Any, model: Any) -> None:
    """Each case through the agent's Responder, always answering locally (the cascade is replayed later);
    the Responder asks in the model's prompt style."""
    from apiary.edge.policy import EscalationPolicy, Situation
    from apiary.edge.responder import Responder

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
        c.edge = {"latency_ms": a.latency_ms, "wall_s": g.wall_s if g else 0.0, "prefill_s": g.prefill_s if g else 0.0,
                  "cpu_s": g.cpu_s if g else 0.0, "tokens": g.completion_tokens if g else 0,
                  "prompt_tokens": g.prompt_tokens if g else 0, "cached_tokens": g.cached_tokens if g else 0,
                  "energy_j": a.energy_j or 0.0}
        if (i + 1) % 20 == 0:
            print(f"  edge: {i + 1}/{len(cases)} situations")


def _run_cloud(cases: list[Case], model_path: str, dtype: str, max_tokens: int,
               adapter: str | None, weights: str = "dtype", kv_cache_dtype: str = "auto") -> tuple[str | None, str | None]:
    """Cloud-tier answers for every case that needs one, in the engine's prompt style.
    Returns (why it was skipped or None, the cloud's prompt style)."""
    try:
        import asyncio

        from apiary.cloud.actions import generate_action
        from apiary.cloud.engine import AsyncEngine, EngineConfig, LLMEngine
    except ImportError as e:
        return f"cloud engine not importable ({e}); cloud-only and cascade rows skipped", None
    from apiary.shared.prompting import build_messages

    llm = LLMEngine(EngineConfig(model_path=model_path, dtype=dtype, adapter_path=adapter, weights=weights,
                                 kv_cache_dtype=kv_cache_dtype))
    engine = AsyncEngine(llm)
    style = engine.prompt_style
    todo = [c for c in cases if c.needs_answer]

    async def one(c: Case) -> None:
        messages = [m.model_dump() for m in build_messages(c.event, c.context, style=style)]
        try:
            out = await generate_action(engine, messages=messages, max_tokens=max_tokens)
        except Exception as e:  # the worker would answer with an error: the cloud gave no action
            c.cloud_pred, c.cloud_error = "invalid", f"{type(e).__name__}: {e}"
            return
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
    return None, style


def _escalates(c: Case, threshold: float, with_policy: bool) -> bool:
    if not c.needs_answer:
        return False
    if with_policy and c.critical:
        return True
    return not c.edge_valid or c.score is None or c.score < threshold


def _final(c: Case, draft: bool) -> str | None:
    """The escalated event's final assessment, as the agent decides it (``apiary.edge.agent.final_from_reply``):
    the cloud's answer when it is valid, else the local draft when there is one."""
    if c.cloud_pred == "invalid" and draft and c.edge_valid:
        return c.edge_pred
    return c.cloud_pred


def _pred(c: Case, threshold: float | None, with_policy: bool = False, draft: bool = True) -> tuple[str | None, bool]:
    """One strategy's final assessment of a case and whether it escalated (``threshold=None``: edge only)."""
    e = threshold is not None and _escalates(c, threshold, with_policy)
    return (_final(c, draft) if e else c.edge_pred), e


def _score(cases: list[Case], threshold: float | None, with_policy: bool = False,
           draft: bool = True) -> dict[str, float]:
    """Accuracy, share escalated (of answered events), invalid final answers and cloud tokens of one strategy.

    ``threshold=None`` means edge-only; ``-inf`` with no policy never escalates, ``+inf`` always
    does. ``draft``: the edge answered first, so a failed cloud answer falls back to it.
    """
    answered = [c for c in cases if c.needs_answer]
    correct = esc = prompt_tok = completion_tok = agree = invalid = 0
    for c in cases:
        pred, e = _pred(c, threshold, with_policy, draft)
        correct += pred == c.label
        agree += pred == c.cloud_pred
        invalid += pred == "invalid"
        if e:
            esc += 1
            prompt_tok += c.cloud_prompt_tokens
            completion_tok += c.cloud_completion_tokens
    return {"accuracy": correct / max(1, len(cases)), "escalated": esc / max(1, len(answered)),
            "invalid": invalid, "cloud_prompt_tokens": prompt_tok, "cloud_completion_tokens": completion_tok,
            "agree_with_cloud": agree / max(1, len(cases))}


def _candidates(cases: list[Case]) -> list[float]:
    return sorted({c.score for c in cases if c.score is not None} | {-math.inf, math.inf})


def _choose_threshold(cases: list[Case], max_escalated: float) -> float:
    """Best calibration accuracy with at most ``max_escalated`` escalated; ties go to fewer escalations."""
    best, best_key = -math.inf, None
    for t in _candidates(cases):
        s = _score(cases, t)
        if s["escalated"] > max_escalated + 1e-9:
            continue
        key = (s["accuracy"], -s["escalated"])
        if best_key is None or key > best_key:
            best, best_key = t, key
    return best


def _num(x: float | None) -> float | str | None:
    """A threshold for JSON: finite floats as they are, infinities as "inf"/"-inf" (strict JSON has none)."""
    return x if x is None or math.isfinite(x) else ("inf" if x > 0 else "-inf")


def _curve(cases: list[Case]) -> list[dict[str, Any]]:
    """The cascade at every distinct threshold (never .. always escalate): escalated share and accuracy."""
    out = []
    for t in _candidates(cases):
        s = _score(cases, t)
        out.append({"threshold": _num(t), "escalated": s["escalated"], "accuracy": s["accuracy"]})
    return out


def _tier_preds(cases: list[Case], threshold: float | None) -> dict[str, list[str]]:
    """Each tier's answer per case; triage answers "routine" or "answered" (a model looks at it)."""
    preds = {"triage": ["answered" if c.needs_answer else "routine" for c in cases],
             "edge_only": [c.edge_pred for c in cases]}
    if threshold is not None:
        preds["cloud_only"] = [_pred(c, math.inf, draft=False)[0] or "none" for c in cases]
        preds["cascade"] = [_pred(c, threshold)[0] or "none" for c in cases]
    return preds


def _correct(tier: str, label: str, pred: str) -> bool:
    if tier == "triage":  # right when it spares the model a normal reading or hands it an anomaly
        return (pred == "routine") == (label == "normal")
    return pred == label


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


def _split_report(cases: list[Case], threshold: float | None) -> dict[str, Any]:
    """Everything measured on one scored split (``threshold=None``: no cloud pass)."""
    from apiary.shared.protocol import ASSESSMENTS

    answered = [c for c in cases if c.needs_answer]
    ran = [c for c in answered if c.edge]
    preds = _tier_preds(cases, threshold)
    strategies = {"edge_only": _score(cases, None)}
    if threshold is not None:
        strategies["cloud_only"] = _score(cases, math.inf, draft=False)
        strategies["cascade"] = _score(cases, threshold)
        strategies["cascade_policy"] = _score(cases, threshold, with_policy=True)
    per_label: dict[str, dict[str, Any]] = {}
    for label in [a for a in ASSESSMENTS if any(c.label == a for c in cases)]:
        idx = [i for i, c in enumerate(cases) if c.label == label]
        per_label[label] = {"n": len(idx), **{tier: _mean([_correct(tier, label, p[i]) for i in idx])
                                             for tier, p in preds.items()}}
    confusion: dict[str, dict[str, dict[str, int]]] = {}
    for tier, p in preds.items():
        m = confusion[tier] = {}
        for c, pred in zip(cases, p):
            m.setdefault(c.label, {}).setdefault(pred, 0)
            m[c.label][pred] += 1
    cloud = threshold is not None
    return {
        "n": len(cases), "answered": len(answered),
        "accuracy": {tier: _mean([_correct(tier, c.label, pred) for c, pred in zip(cases, p)])
                     for tier, p in preds.items()},
        "triage": {"anomalies_routine": sum(c.label != "normal" and not c.needs_answer for c in cases),
                   "normal_answered": sum(c.label == "normal" and c.needs_answer for c in cases)},
        "strategies": strategies,
        "escalated": strategies["cascade"]["escalated"] if cloud else None,
        "escalated_policy": strategies["cascade_policy"]["escalated"] if cloud else None,
        "agree_cascade_cloud": strategies["cascade"]["agree_with_cloud"] if cloud else None,
        "prompt_tokens": {"edge_mean": _mean([c.edge["prompt_tokens"] for c in ran]),
                          "edge_cached_mean": _mean([c.edge["cached_tokens"] for c in ran]),
                          "cloud_mean": _mean([c.cloud_prompt_tokens for c in answered]) if cloud else None},
        "completion_tokens": {"edge_mean": _mean([c.edge["tokens"] for c in ran]),
                              "cloud_mean": _mean([c.cloud_completion_tokens for c in answered]) if cloud else None},
        "edge_joules_per_answered_event": sum(c.edge["energy_j"] for c in ran) / max(1, len(ran)),
        "invalid": {"edge": sum(not c.edge_valid for c in answered),
                    **({"cloud": sum(c.cloud_pred == "invalid" for c in answered),
                        "cascade": strategies["cascade"]["invalid"]} if cloud else {})},
        "per_label": per_label, "confusion": confusion,
        **({"curve": _curve(cases)} if cloud else {}),
    }


def _thread_comparison(model: Any, cases: list[Case], n: int, style: str) -> list[list[Any]]:
    """Same prompts at 1 and 2 llama.cpp threads, interleaved, for a side-by-side tok/s ratio."""
    from apiary.shared.prompting import build_messages

    prompts = [build_messages(c.event, c.context, style=style) for c in cases if c.needs_answer][:n]
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


def _grammar_comparison(model: Any, cases: list[Case], n: int, style: str) -> list[list[Any]]:
    """Three ways to get grammar-constrained greedy answers, same prompts, decode tok/s side by side:
    LocalModel's loop (top-k grammar check + per-token logprobs), llama.cpp's grammar-first sampler
    chain (no logprobs), and llama-cpp-python's high-level chat completion with logprobs."""
    from llama_cpp import Llama, LlamaGrammar

    from apiary.shared.prompting import build_messages

    prompts = [build_messages(c.event, c.context, style=style) for c in cases if c.needs_answer][:n]
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


def _plots(json_path: Path, splits: dict[str, dict[str, Any]], calibration_curve: list[dict[str, Any]] | None,
           threshold: float | None) -> dict[str, str]:
    """A confusion-matrix PNG per tier (one panel per scored split) and, with a cloud pass, the
    cascade's accuracy-vs-escalation curve, next to ``json_path``; returns {name: path}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from apiary.shared.protocol import ASSESSMENTS

    out: dict[str, str] = {}
    stem = json_path.stem
    json_path.parent.mkdir(parents=True, exist_ok=True)
    for tier in TIERS:
        if not all(tier in r["confusion"] for r in splits.values()):
            continue
        fig, axes = plt.subplots(1, len(splits), figsize=(5.6 * len(splits), 5.0), squeeze=False)
        for ax, (name, r) in zip(axes[0], splits.items()):
            m = r["confusion"][tier]
            rows = list(ASSESSMENTS)
            cols = ["routine", "answered"] if tier == "triage" else list(ASSESSMENTS) + sorted(
                {p for preds in m.values() for p in preds} - set(ASSESSMENTS))
            grid = np.array([[m.get(a, {}).get(p, 0) for p in cols] for a in rows])
            ax.imshow(grid, cmap="Blues", vmin=0, aspect="auto")
            for (i, j), v in np.ndenumerate(grid):
                if v:
                    ax.text(j, i, str(v), ha="center", va="center",
                            color="white" if v > grid.max() / 2 else "black", fontsize=9)
            ax.set_xticks(range(len(cols)), cols, rotation=45, ha="right", fontsize=8)
            ax.set_yticks(range(len(rows)), rows, fontsize=8)
            ax.set_xlabel("answer")
            ax.set_ylabel("truth")
            ax.set_title(f"{name}: {TIER_NAMES[tier]}, accuracy {r['accuracy'][tier]:.0%} (n={r['n']})", fontsize=10)
        fig.tight_layout()
        path = json_path.parent / f"{stem}-confusion-{tier}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out[f"confusion_{tier}"] = str(path)
    if threshold is not None:
        fig, ax = plt.subplots(figsize=(6.4, 4.6))
        curves = {CALIBRATION: calibration_curve or [], **{n: r.get("curve", []) for n, r in splits.items()}}
        for name, pts in curves.items():
            if not pts:
                continue
            line, = ax.plot([p["escalated"] for p in pts], [p["accuracy"] for p in pts], ".-", ms=3, label=name)
            at = (splits[name]["strategies"]["cascade"] if name in splits
                  else next((p for p in pts if p["threshold"] == _num(threshold)), None))
            if at is not None:
                ax.plot(at["escalated"], at["accuracy"], "o", ms=9, mfc="none", color=line.get_color())
        ax.set_xlabel("escalated (share of answered events)")
        ax.set_ylabel("accuracy (all situations)")
        ax.set_xlim(-0.02, 1.02)
        ax.set_title(f"cascade: threshold swept; circles: chosen on calibration ({threshold:.2f})"
                     if math.isfinite(threshold) else "cascade: threshold swept (chosen: never escalate)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = json_path.parent / f"{stem}-cascade-curve.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out["cascade_curve"] = str(path)
    return out


def command(
    limit: int = typer.Option(0, help="use only the first N situations of each split (0: all)"),
    threads: int = typer.Option(1, help="llama.cpp threads for the evaluation (1 is robust on a shared machine)"),
    max_escalated: float = typer.Option(0.25, help="most of the answered events the cascade may escalate"),
    edge_model: Path = typer.Option(None, help="edge GGUF (default: the shipped edge image's INT4 student)"),
    edge_prompt_style: str = typer.Option(
        "auto", help="edge prompt style: auto (the GGUF's apiary.prompt_style metadata, else examples) | examples "
                     "| short"),
    cloud_adapter: str = typer.Option(
        "auto", help="LoRA adapter for the cloud engine: auto (the shipped teacher adapter), none, or a folder "
                     "(apiary finetune); its prompt style is the cloud's"),
    cloud_dtype: str = typer.Option("float32", help="cloud engine dtype (float32 | bfloat16)"),
    cloud_weights: str = typer.Option("dtype", help="cloud engine's decoder weights: dtype | int8 (W8A8) | bf16 (held "
                                                    "in bf16, float32 sums) | auto"),
    cloud_kv_cache_dtype: str = typer.Option("auto", help="cloud engine's KV cache rows: auto | dtype | bf16 | int8"),
    cloud_max_tokens: int = typer.Option(128, help="max tokens per cloud answer"),
    skip_cloud: bool = typer.Option(False, help="edge only (no cloud engine)"),
    thread_prompts: int = typer.Option(6, help="prompts for the 1-vs-2 thread comparison (0: skip)"),
    grammar_prompts: int = typer.Option(3, help="prompts for the grammar-strategy comparison (0: skip)"),
) -> None:
    """Evaluate edge-only, cloud-only and the cascade; measure the edge's speed, latency, memory and energy."""
    from apiary.bench.common import RESULTS_DIR, percentile, report
    from apiary.edge.errors import EdgeError
    from apiary.edge.model import LocalModel
    from apiary.edge.settings import EdgeSettings, PolicySettings, PowerProfile
    from apiary.shared import assets

    if edge_prompt_style not in STYLE_CHOICES:
        raise typer.BadParameter(f"--edge-prompt-style must be one of {', '.join(STYLE_CHOICES)}")
    base_gguf = str(assets.ensure("smollm2-135m-q4"))
    if cloud_adapter == "auto":
        adapter = assets.adapter_for(Path(base_gguf))
    else:
        adapter = None if cloud_adapter == "none" else Path(cloud_adapter)
    if adapter is not None and not adapter.is_dir():
        raise typer.BadParameter(f"--cloud-adapter {cloud_adapter} is not a folder")
    rss0 = _rss_mib()
    edge_gguf = str(edge_model) if edge_model is not None else str(assets.model_file("edge-student"))
    settings = EdgeSettings(threads=threads, prompt_style=edge_prompt_style, power=PowerProfile(enabled=False),
                            policy=PolicySettings(min_confidence=-math.inf, critical_severities=[]))
    cases = _load_cases(limit)
    print(f"{len(cases)} situations ({sum(c.needs_answer for c in cases)} need an answer); edge pass ...")
    load_t = time.perf_counter()
    try:
        model = LocalModel.from_settings(settings, edge_gguf)
    except EdgeError as e:
        raise typer.BadParameter(str(e)) from None
    load_s = time.perf_counter() - load_t
    edge_style, edge_style_source = model.prompt_style, model.prompt_style_source
    print(f"edge: {Path(edge_gguf).name}, {edge_style} prompt ({edge_style_source})")
    t0 = time.perf_counter()
    _run_edge(cases, settings, model)
    edge_s = time.perf_counter() - t0
    rss_edge = _rss_mib()
    speed_rows = _thread_comparison(model, cases, thread_prompts, edge_style) if thread_prompts else []
    grammar_rows = _grammar_comparison(model, cases, grammar_prompts, edge_style) if grammar_prompts else []
    model.close()

    skipped = "cloud pass skipped (--skip-cloud)" if skip_cloud else None
    cloud_style = None
    if not skip_cloud:
        print("cloud pass ...")
        t0 = time.perf_counter()
        skipped, cloud_style = _run_cloud(cases, base_gguf, cloud_dtype, cloud_max_tokens,
                                          str(adapter) if adapter is not None else None, cloud_weights,
                                          cloud_kv_cache_dtype)
        cloud_s = time.perf_counter() - t0
    if skipped:
        print(skipped)

    by_split = {name: [c for c in cases if c.split == name] for name in (CALIBRATION, *SCORED_SPLITS)}
    threshold = None if skipped else _choose_threshold(by_split[CALIBRATION], max_escalated)
    splits = {name: _split_report(by_split[name], threshold) for name in SCORED_SPLITS}

    columns = ["split", "strategy", "accuracy", "escalated", "invalid", "cloud prompt tok", "cloud completion tok",
               "agree w/ cloud-only"]
    names = {"edge_only": "edge only", "cloud_only": "cloud only",
             "cascade": f"cascade (p10 logprob < {threshold:.2f})" if threshold is not None else "cascade",
             "cascade_policy": "cascade + policy (critical -> cloud)"}
    rows: list[list[Any]] = []
    for split, r in splits.items():
        for key, s in r["strategies"].items():
            rows.append([f"{split} ({r['n']})", names[key], s["accuracy"], s["escalated"], s["invalid"],
                         s["cloud_prompt_tokens"], s["cloud_completion_tokens"],
                         s["agree_with_cloud"] if not skipped else "-"])

    answered = [c for c in cases if c.needs_answer and c.edge]
    tokens = sum(c.edge["tokens"] for c in answered)
    wall = sum(c.edge["wall_s"] for c in answered)
    prefill = sum(c.edge["prefill_s"] for c in answered)
    prefilled = sum(c.edge["prompt_tokens"] - c.edge["cached_tokens"] for c in answered)
    lat = [c.edge["latency_ms"] for c in answered]
    energy = sum(c.edge["energy_j"] for c in answered)
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
        "mean_prompt_tokens": _mean([c.edge["prompt_tokens"] for c in answered]) if answered else 0.0,
        "mean_cached_prompt_tokens": _mean([c.edge["cached_tokens"] for c in answered]) if answered else 0.0,
        "edge_pass_s": edge_s, "threads": threads,
    }
    from rich.console import Console
    from rich.table import Table

    console = Console()
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
    console.print(table)

    def fmt(v: Any) -> str:
        return "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)

    tiers = [t for t in TIERS if t in next(iter(splits.values()))["accuracy"]]
    table = Table(title="per tier (triage: routine for normal, answered for anomalies)")
    for col in ("split", "answered", *(f"acc. {TIER_NAMES[t]}" for t in tiers), "edge prompt tok/event",
                "cloud prompt tok/event", "edge J/answered", "invalid edge/cloud/cascade"):
        table.add_column(col)
    for split, r in splits.items():
        inv = r["invalid"]
        table.add_row(split, f"{r['answered']}/{r['n']}", *(fmt(r["accuracy"][t]) for t in tiers),
                      f"{fmt(r['prompt_tokens']['edge_mean'])} ({fmt(r['prompt_tokens']['edge_cached_mean'])} cached)",
                      fmt(r["prompt_tokens"]["cloud_mean"]), fmt(r["edge_joules_per_answered_event"]),
                      "/".join(str(inv.get(k, "-")) for k in ("edge", "cloud", "cascade")))
    console.print(table)
    table = Table(title="accuracy per label")
    for col in ("label", *(f"{s} {TIER_NAMES[t]}" for s in splits for t in tiers)):
        table.add_column(col)
    labels = list(dict.fromkeys(lab for r in splits.values() for lab in r["per_label"]))
    for label in labels:
        table.add_row(label, *(fmt(splits[s]["per_label"].get(label, {}).get(t)) for s in splits for t in tiers))
    console.print(table)

    out = RESULTS_DIR / "edge.json"
    cal_curve = _curve(by_split[CALIBRATION]) if threshold is not None else None
    plots = _plots(out, splits, cal_curve, threshold)
    cascade = {c.id: _pred(c, threshold)[1] for c in cases} if threshold is not None else {}
    extra = {"runtime": runtime, "threshold": _num(threshold), "max_escalated": max_escalated,
             "edge": {"model": edge_gguf, "prompt_style": edge_style, "prompt_style_source": edge_style_source},
             "cloud": {"skipped": skipped, "model": base_gguf, "adapter": str(adapter) if adapter else None,
                       "prompt_style": cloud_style, "dtype": cloud_dtype, "weights": cloud_weights,
                       "kv_cache_dtype": cloud_kv_cache_dtype,
                       **({"pass_s": cloud_s} if not skipped else {})},
             "calibration": {"n": len(by_split[CALIBRATION]),
                             "answered": sum(c.needs_answer for c in by_split[CALIBRATION]),
                             **({"curve": cal_curve} if cal_curve is not None else {})},
             "splits": splits, "plots": plots, "thread_comparison": speed_rows, "grammar_comparison": grammar_rows,
             "cases": [{"id": c.id, "split": c.split, "label": c.label, "needs_answer": c.needs_answer,
                        "edge": c.edge_pred, "score": c.score, "critical": c.critical,
                        "edge_tokens": [c.edge.get("prompt_tokens", 0), c.edge.get("tokens", 0)],
                        "cloud": c.cloud_pred, "cloud_error": (c.cloud_error or "")[:200],
                        "cloud_score": c.cloud_score,
                        "cloud_tokens": [c.cloud_prompt_tokens, c.cloud_completion_tokens],
                        "escalated": cascade.get(c.id)} for c in cases]}
    cloud_name = Path(base_gguf).name + (f" + {adapter.name}" if adapter else "")
    report("edge", f"Edge vs cloud vs cascade (edge {Path(edge_gguf).name} on llama.cpp, {edge_style} prompt; "
                   f"cloud {cloud_name} on the cloud engine, {cloud_style or '-'} prompt)",
           columns, rows, extra, out=out)
    for path in plots.values():
        console.print(f"wrote {path}")
