"""Distilled edge student vs its 135M teacher in llama.cpp at Q4: tokens/s side by side, and top-1 agreement.

Both GGUFs run the same work in one process, interleaved round by round (teacher, student,
teacher, …) so machine noise hits both alike; the table reports medians and the ratio. Prompt
speed is one batched evaluation of a sensor prompt; generation speed is greedy decoding of
``gen_tokens`` tokens one at a time (EOS ignored, so both do identical work). Agreement is
teacher-forced top-1 of the student vs the teacher (both in llama.cpp) on held-out sensor
samples (prompt + the teacher's answer), over the answer positions and over all positions.
With ``--spec``, the cloud engine (teacher GGUF, float32) also decodes held-out prompts with
speculative decoding, once with the distilled student folder as draft and once with the
naive draft of the same depth (the teacher's first layers), and reports acceptance rates.
The machine is shared with other engineers' jobs: absolute numbers move, ratios much less.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Optional

import typer


def _speed(llm: Any, prompt: list[int], gen_tokens: int) -> tuple[float, float]:
    """(prompt tokens/s, generated tokens/s) for one greedy run."""
    import numpy as np

    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    n_vocab = llm.n_vocab()
    for _ in range(gen_tokens):
        logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))
        llm.eval([int(logits.argmax())])
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), gen_tokens / (t2 - t1)


def _engine_speculates() -> bool:
    import dataclasses

    from apiary.cloud.engine import EngineConfig

    return any(f.name == "speculative" for f in dataclasses.fields(EngineConfig))


def acceptance(teacher: Path, prompts: list[str], draft: Path | None, num_layers: int | None, k: int,
               max_tokens: int) -> dict[str, Any]:
    """Greedy speculative decoding of ``prompts`` in the cloud engine; the draft's acceptance counters."""
    from apiary.cloud.engine import EngineConfig, LLMEngine, SamplingParams
    from apiary.cloud.engine.spec.config import SpeculativeConfig

    spec = SpeculativeConfig(method="draft", k=k, draft_model_path=draft, draft_num_layers=num_layers, adaptive=False)
    engine = LLMEngine(EngineConfig(model_path=teacher, kv_cache_bytes=256 << 20, max_num_seqs=len(prompts),
                                    speculative=spec))
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    metrics = engine.metrics()
    return {"acceptance_rate": metrics.get("spec_draft_acceptance_rate"),
            "tokens_per_verification": metrics.get("spec_draft_tokens_per_verification"),
            "proposed": metrics.get("spec_draft_proposed"), "seconds": time.perf_counter() - t0,
            "output_tokens": sum(len(o.output_token_ids) for o in outs)}


def command(
    student: Path = typer.Option(Path("results/distill/smollm2-8l/smollm2-8l-q4_0.gguf"), help="Student GGUF."),
    teacher: Optional[Path] = typer.Option(None, help="Teacher GGUF (default: the SmolLM2-135M Q4 asset)."),
    eval_corpus: Optional[Path] = typer.Option(None, help="Held-out samples (default: eval.jsonl next to the student)."),
    n_eval: int = typer.Option(24, help="Held-out samples for the agreement columns."),
    rounds: int = typer.Option(5, help="Interleaved speed rounds per model."),
    gen_tokens: int = typer.Option(64, help="Tokens generated per speed round."),
    threads: int = typer.Option(2, help="llama.cpp threads (the devices run 2)."),
    spec: bool = typer.Option(True, help="Also measure the student's acceptance rate as the engine's draft."),
    spec_prompts: int = typer.Option(8, help="Held-out prompts decoded speculatively."),
    spec_k: int = typer.Option(4, help="Draft tokens per verification."),
    spec_tokens: int = typer.Option(48, help="Tokens generated per prompt."),
) -> None:
    """Distilled edge student vs its 135M teacher in llama.cpp at Q4: tokens/s side by side, and top-1 agreement."""
    from llama_cpp import Llama

    from apiary.bench.common import report
    from apiary.deploy.agreement import agreement, llama_top1
    from apiary.deploy.corpus import load_corpus
    from apiary.shared import assets

    teacher = teacher or assets.ensure("smollm2-135m-q4")
    if not student.is_file():
        raise typer.BadParameter(f"student GGUF not found: {student} (run `apiary distill` and `apiary quantize`)")
    eval_corpus = eval_corpus or student.parent / "eval.jsonl"
    samples = load_corpus(eval_corpus)[:n_eval] if eval_corpus.is_file() else []

    models = {"teacher": Llama(model_path=str(teacher), n_ctx=2048, n_batch=512, n_threads=threads,
                               n_threads_batch=threads, verbose=False),
              "student": Llama(model_path=str(student), n_ctx=2048, n_batch=512, n_threads=threads,
                               n_threads_batch=threads, verbose=False)}
    tok = models["teacher"]
    prompt_text = samples[0].prompt if samples else "<|im_start|>user\nHive 7: 40.8 C, weight -2.4 kg.<|im_end|>\n"
    prompt = tok.tokenize(prompt_text.encode(), add_bos=False, special=True)
    speeds: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    _speed(models["teacher"], prompt, 4), _speed(models["student"], prompt, 4)  # warm-up
    for _ in range(rounds):
        for name, llm in models.items():
            speeds[name].append(_speed(llm, prompt, gen_tokens))
    seqs = [tok.tokenize(s.text.encode(), add_bos=False, special=True) for s in samples]
    starts = [len(tok.tokenize(s.prompt.encode(), add_bos=False, special=True)) - 1 for s in samples]
    for llm in models.values():
        llm.close()

    answer = everything = None
    if samples:
        ours, theirs = llama_top1(student, seqs, threads), llama_top1(teacher, seqs, threads)
        answer, everything = agreement(ours, theirs, starts), agreement(ours, theirs)

    def med(name: str, i: int) -> float:
        return statistics.median(s[i] for s in speeds[name])

    extra: dict[str, Any] = {"rounds": rounds, "gen_tokens": gen_tokens, "threads": threads, "teacher": str(teacher),
                             "student": str(student), "prompt_tokens": len(prompt), "raw": speeds,
                             "eval_samples": len(samples)}
    t_mib, s_mib = teacher.stat().st_size / 2**20, student.stat().st_size / 2**20
    rows: list[list[Any]] = [
        ["file size (MiB)", round(t_mib, 1), round(s_mib, 1), f"{s_mib / t_mib:.2f}x"],
        [f"prompt tok/s ({len(prompt)} tokens, {threads} threads)", round(med("teacher", 0), 1),
         round(med("student", 0), 1), f"{med('student', 0) / med('teacher', 0):.2f}x"],
        [f"generation tok/s ({gen_tokens} tokens, {threads} threads)", round(med("teacher", 1), 1),
         round(med("student", 1), 1), f"{med('student', 1) / med('teacher', 1):.2f}x"],
    ]
    extra |= {"prompt_speedup": med("student", 0) / med("teacher", 0),
              "generation_speedup": med("student", 1) / med("teacher", 1)}
    if answer is not None and everything is not None:
        extra |= {"answer_top1_agreement": answer.rate, "answer_positions": answer.positions,
                  "all_top1_agreement": everything.rate, "all_positions": everything.positions}
        rows += [["top-1 = teacher, answer positions (held-out)", 1.0, round(answer.rate, 3), f"{answer.positions} pos"],
                 ["top-1 = teacher, all positions (held-out)", 1.0, round(everything.rate, 3),
                  f"{everything.positions} pos"]]
    folder = student.parent / "model"
    if spec and not _engine_speculates():
        extra["spec"] = "skipped: this engine's EngineConfig has no `speculative` setting yet"
    elif spec and samples and (folder / "config.json").is_file():
        import json

        layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
        prompts = [s.prompt for s in samples[:spec_prompts]]
        extra["spec_student"] = acceptance(teacher, prompts, folder, None, spec_k, spec_tokens)
        extra["spec_truncated_teacher"] = acceptance(teacher, prompts, None, layers, spec_k, spec_tokens)
        for label, key in (("distilled student", "spec_student"), (f"teacher's first {layers} layers",
                                                                   "spec_truncated_teacher")):
            rate = extra[key]["acceptance_rate"]
            rows.append([f"engine draft acceptance, k={spec_k}: {label}", "-",
                         round(rate, 3) if rate is not None else "-", f"{len(prompts)} prompts"])
    report("distill", "Edge student vs its teacher: llama.cpp Q4 speed, agreement, draft acceptance",
           ["measure", "teacher", "student", "ratio / note"], rows, extra)
