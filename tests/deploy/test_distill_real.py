"""A short real distillation from the tuned teacher (SmolLM2-135M + the shipped task adapter): loss falls,
the INT4 export runs in llama.cpp like the torch student.

Tiny on purpose (4-layer student, a few samples, 8 steps): it proves the pipeline end to end,
not the quality; the real run's numbers are in docs/deploy.md and the shipped student's in
docs/benchmarks.md. Q4_0, not Q4_1: this student's
weights sit a few Adam steps away from the Q4_1 teacher's grid, and re-quantising to that same
grid snaps them back to the teacher's layers (see docs/deploy.md).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from apiary.deploy.distill import DistillConfig, DistillReport, distill

pytestmark = pytest.mark.slow

STEPS = 8


def config(teacher: Path, out: Path, steps: int = STEPS) -> DistillConfig:
    from apiary.shared import assets

    return DistillConfig(teacher=teacher, teacher_adapter=assets.shipped("sensor-teacher-lora"), out=out, layers=4, steps=steps, batch_size=2, seq_len=384, lr=5e-4,
                         warmup_steps=1, n_sensor=2, n_eval=1, n_general=2, max_answer_tokens=64,
                         checkpoint_every=4, threads=2, qat_steps=2)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> DistillReport:
    return distill(config(gguf_path, tmp_path_factory.mktemp("distill")), progress=False, log=lambda m: None)


@pytest.mark.timeout(600)
def test_short_distillation_lowers_the_loss_and_writes_everything(run: DistillReport) -> None:
    assert len(run.losses) == STEPS and run.teacher_layers == [0, 10, 19, 29]
    assert np.mean(run.losses[-3:]) < 0.8 * np.mean(run.losses[:2]), run.losses
    assert run.student_parameters < 0.5 * run.teacher_parameters
    assert run.eval["after"]["all_positions"] > 0 and run.eval["before"]["samples"] == 1
    for name in ("corpus.jsonl", "eval.jsonl", "corpus.json", "targets.pt", "checkpoint.pt", "report.json"):
        assert (run.out / name).is_file(), name
    assert (run.model_dir / "config.json").is_file() and (run.model_dir / "model.safetensors").is_file()
    # The tuned teacher answered in its short prompt, right on its situations; the student inherits the style.
    assert run.prompt_style == "short" and run.teacher_corpus["situations"] == 2
    assert run.teacher_corpus["right"] == run.teacher_corpus["kept"] >= 1
    distilled = json.loads((run.model_dir / "config.json").read_text())["apiary_distill"]
    assert distilled["prompt_style"] == "short" and distilled["teacher_adapter"].endswith("teacher-lora")
    assert distilled["qat"] == {"steps": 2, "qtype": "q4_0"}
    assert run.eval["task"]["n"] == 1 and 0.0 <= run.eval["task"]["accuracy"] <= 1.0


@pytest.mark.timeout(600)
def test_int4_export_runs_in_llama_cpp_like_the_torch_student(run: DistillReport, tmp_path: Path) -> None:
    from apiary.cloud.engine import EngineConfig, LLMEngine, SamplingParams
    from apiary.deploy.agreement import agreement, llama_top1
    from apiary.deploy.corpus import load_corpus
    from apiary.deploy.quantize import quantize
    from apiary.deploy.student import load_model

    report = quantize(run.model_dir, tmp_path / "student.gguf", "q4_0", corpus_path=run.out / "eval.jsonl", n_eval=2)
    assert report.size_bytes < report.fp32_bytes / 3 and report.top1_agreement is not None and report.positions > 0

    # The torch student's own greedy continuation of a held-out prompt, then llama.cpp teacher-forced along it.
    student, _ = load_model(run.model_dir)
    engine = LLMEngine(EngineConfig(model_path=run.model_dir, kv_cache_bytes=16 << 20, max_num_seqs=2,
                                    dtype="float32"))  # the float32 torch student is the oracle
    prompt = engine.tokenizer.encode(load_corpus(run.out / "eval.jsonl")[0].prompt)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(24):
            ids.append(int(student(torch.tensor([ids]))[0, -1].argmax()))
    greedy = ids[len(prompt):]
    # The cloud engine loads the same folder and decodes the same tokens.
    [out] = engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))
    assert out.output_token_ids[:12] == greedy[:12]
    [llama] = llama_top1(report.path, [ids], threads=1)
    theirs = llama[len(prompt) - 1:-1]
    match = agreement([theirs], [np.array(greedy)])
    # Where INT4 picks another token, the float student was, on average, nearly undecided between the two.
    with torch.no_grad():
        logits = student(torch.tensor([ids]))[0, len(prompt) - 1:-1].float()
    gap = logits.max(-1).values - logits.gather(1, torch.as_tensor(theirs, dtype=torch.long)[:, None])[:, 0]
    # Measured: after bf16 training 83% identical (gaps where not: 0.2-2.5 logits, mean 0.22 over all 24);
    # after float32 training (hosts without native bf16) 46%, the student looping between near-tied
    # tokens (gaps 0.02-1.4, mean 0.33). A broken export (wrong layout or scales) picks tokens the
    # student ranks far below, everywhere.
    assert match.rate >= 0.4 and gap.mean() < 0.6, (match, gap.tolist(), greedy, theirs.tolist())


@pytest.mark.timeout(600)
def test_distillation_resumes_from_its_checkpoint(run: DistillReport, gguf_path: Path) -> None:
    messages: list[str] = []
    more = distill(config(gguf_path, run.out, steps=STEPS + 2), progress=False, log=messages.append)
    assert any("resumed" in m and f"step {STEPS}" in m for m in messages), messages
    assert not any("loading teacher" in m or "teacher targets" in m for m in messages)  # nothing recomputed
    assert len(more.losses) == STEPS + 2 and more.losses[:STEPS] == run.losses
