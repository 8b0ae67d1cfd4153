"""Knowledge distillation: a student with fewer layers learns the teacher's next-token distributions.

Everything lives under one output folder and every stage resumes where it stopped::

    corpus.jsonl   training samples: sensor prompts + teacher answers, general text (deploy.corpus)
    eval.jsonl     held-out sensor samples from other simulated hives
    teacher_tokenizer.json  the teacher GGUF's tokenizer metadata (slow to parse, so parsed once)
    targets.pt     the teacher's top-k logits at every position, computed once (float32)
    checkpoint.pt  student, optimizer and step, replaced atomically every ``checkpoint_every`` steps
    model/         the final student as a Hugging Face folder the cloud engine loads
    report.json    loss curve and held-out agreement with the teacher, before and after

The student copies the teacher's embeddings, final norm, head and an evenly spread subset
of its layers, then minimises the temperature-scaled KL divergence to the teacher
(times T^2) plus ``alpha_ce`` x cross-entropy on the text itself. The teacher runs once per
sample, not once per step: on this CPU its forward costs as much as a student step, and
its top 64 logits hold nearly all of its probability mass, so the KL is taken over them
(the teacher's distribution renormalised on its top k; the student's full softmax).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from cloud.engine.config import ModelConfig
from cloud.engine.loader import Checkpoint
from deploy import corpus as corpus_mod
from deploy.agreement import agreement, torch_top1
from deploy.student import (LlamaForTraining, load_model, save_hf_folder, spread_layers, student_from_teacher,
                            tokenizer_metadata)


class DistillError(ValueError):
    """A distillation setting or resume state that cannot work."""


@dataclass(slots=True)
class DistillConfig:
    teacher: Path
    out: Path
    layers: int = 8  # student depth; layers are copied evenly spread from the teacher
    layer_ids: list[int] | None = None  # or exactly these teacher layers
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 512  # longer samples are cut (general text into several samples)
    lr: float = 3e-4
    warmup_steps: int = 10
    temperature: float = 2.0
    alpha_ce: float = 0.1
    top_k: int = 64
    n_sensor: int = 240
    n_eval: int = 24
    n_general: int | None = None  # general-text records to include (None: all, 0: none)
    max_answer_tokens: int = 96
    seed: int = 0
    threads: int = 2  # torch threads
    answer_threads: int = 1  # llama.cpp threads for the teacher's answers (spin-waiting threads crawl on a busy CPU)
    dtype: str = "bfloat16"  # autocast dtype of the student's matmuls; weights stay float32
    checkpoint_every: int = 10
    train_embeddings: bool = False  # embeddings are tied to the head: frozen keeps the teacher's vocabulary space

    def __post_init__(self) -> None:
        self.teacher, self.out = Path(self.teacher), Path(self.out)
        checks = [(self.steps >= 1, "steps must be >= 1"), (self.batch_size >= 1, "batch_size must be >= 1"),
                  (self.seq_len >= 16, "seq_len must be >= 16"), (self.lr > 0, "lr must be > 0"),
                  (self.temperature > 0, "temperature must be > 0"), (self.alpha_ce >= 0, "alpha_ce must be >= 0"),
                  (self.top_k >= 1, "top_k must be >= 1"), (self.n_sensor >= 0 and self.n_eval >= 0,
                                                            "n_sensor and n_eval must be >= 0"),
                  (self.dtype in ("float32", "bfloat16"), "dtype must be float32 or bfloat16"),
                  (self.checkpoint_every >= 1, "checkpoint_every must be >= 1")]
        for ok, message in checks:
            if not ok:
                raise DistillError(message)
        if not self.teacher.exists():
            raise DistillError(f"teacher model not found: {self.teacher}")


@dataclass(slots=True)
class TokenSample:
    ids: list[int]
    answer_start: int  # first position whose next token belongs to the answer (0 for general text)


@dataclass(slots=True)
class DistillReport:
    out: Path
    model_dir: Path
    steps: int
    losses: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    teacher_layers: list[int] = field(default_factory=list)
    student_parameters: int = 0
    teacher_parameters: int = 0
    train_tokens: int = 0
    eval: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


# ---------------------------------------------------------------- data


def tokenize(tok: Any, samples: list[corpus_mod.Sample], seq_len: int) -> list[TokenSample]:
    out: list[TokenSample] = []
    for s in samples:
        ids = tok.encode(s.text)
        if s.kind == "general":
            out += [TokenSample(ids[i:i + seq_len], 0) for i in range(0, len(ids), seq_len) if len(ids[i:i + seq_len]) > 8]
        else:
            out.append(TokenSample(ids[:seq_len], max(0, min(len(tok.encode(s.prompt)) - 1, seq_len - 1))))
    return out


@torch.no_grad()
def teacher_targets(teacher: LlamaForTraining, samples: list[TokenSample], k: int, batch_size: int = 4,
                    on_batch: Callable[[int], None] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The teacher's top-k (token ids int32, logits float32) at every position of every sample."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(samples)  # type: ignore[list-item]
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].ids))
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        ids = _pad([samples[i].ids for i in idx])
        logits = teacher(ids)
        values, indices = logits.topk(k, dim=-1)
        for row, i in enumerate(idx):
            n = len(samples[i].ids)
            out[i] = (indices[row, :n].to(torch.int32).clone(), values[row, :n].clone())
        if on_batch:
            on_batch(len(idx))
    return out


def _pad(seqs: list[list[int]], value: int = 0) -> torch.Tensor:
    ids = torch.full((len(seqs), max(len(s) for s in seqs)), value, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, :len(s)] = torch.tensor(s, dtype=torch.long)
    return ids


def sample_order(n: int, seed: int, position: int, count: int) -> list[int]:
    """Sample indices ``position .. position+count`` of an endless stream of per-epoch shuffles (resumable)."""
    out = []
    for g in range(position, position + count):
        epoch, i = divmod(g, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(perm[i]))
    return out


# ---------------------------------------------------------------- loss


def distill_loss(student_logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, t_idx: torch.Tensor,
                 t_val: torch.Tensor, temperature: float, alpha_ce: float) -> tuple[torch.Tensor, float, float]:
    """KL(teacher_T || student_T) * T^2 over the teacher's top k, + alpha_ce * next-token cross-entropy.

    Shapes: logits [B, T, V]; ids, mask [B, T]; t_idx, t_val [B, T, k]. Returns (loss, kl, ce).
    """
    m = mask.bool()
    s = student_logits[m]  # [N, V]
    log_ps = F.log_softmax(s / temperature, dim=-1).gather(-1, t_idx[m].long())  # [N, k]
    log_pt = F.log_softmax(t_val[m] / temperature, dim=-1)
    kl = (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean() * temperature ** 2
    ce_mask = m[:, :-1] & m[:, 1:]
    ce = F.cross_entropy(student_logits[:, :-1][ce_mask], ids[:, 1:][ce_mask]) if ce_mask.any() else s.sum() * 0
    return kl + alpha_ce * ce, float(kl.detach()), float(ce.detach())


def lr_at(step: int, cfg: DistillConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# ---------------------------------------------------------------- the run


def teacher_tokenizer(teacher: Path, cache: Path) -> dict[str, Any]:
    """The teacher GGUF's tokenizer metadata, cached next to the run (parsing a 49k-token vocabulary is slow)."""
    import gguf

    from cloud.engine.loader import read_gguf_metadata

    if teacher.is_dir():
        return {}
    stamp = {"teacher": str(teacher.resolve()), "size": teacher.stat().st_size, "mtime": teacher.stat().st_mtime}
    if cache.is_file():
        doc = json.loads(cache.read_text())
        if doc.get("stamp") == stamp:
            return doc["meta"]
    meta = tokenizer_metadata(read_gguf_metadata(gguf.GGUFReader(teacher)))
    tmp = cache.with_name(cache.name + ".tmp")
    tmp.write_text(json.dumps({"stamp": stamp, "meta": meta}))
    os.replace(tmp, cache)
    return meta


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _fingerprint(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def prepare_corpus(cfg: DistillConfig, tokenizer_meta: dict[str, Any],
                   log: Callable[[str], None]) -> tuple[list[corpus_mod.Sample], list[corpus_mod.Sample]]:
    """Training and held-out samples (built with the teacher on first use, continued after a crash)."""
    t0 = time.perf_counter()
    render = corpus_mod.chat_template_renderer(tokenizer_meta)

    def build(name: str, n: int, seed: int) -> list[corpus_mod.Sample]:
        def note(done: int) -> None:
            if done % 20 == 0 or done == n:
                log(f"{name}: teacher answered {done}/{n} ({time.perf_counter() - t0:.0f} s)")
        return corpus_mod.build_sensor_corpus(cfg.teacher, cfg.out / f"{name}.jsonl", n, seed, render=render,
                                              max_tokens=cfg.max_answer_tokens, threads=cfg.answer_threads,
                                              on_sample=note) if n else []

    train = build("corpus", cfg.n_sensor, cfg.seed)
    held_out = build("eval", cfg.n_eval, cfg.seed + corpus_mod.HELD_OUT_SEED_OFFSET)
    general = corpus_mod.general_samples()
    train = train + general[:cfg.n_general if cfg.n_general is not None else len(general)]
    if not train:
        raise DistillError("empty training corpus: set n_sensor > 0 or n_general > 0")
    return train, held_out


def evaluate(student: LlamaForTraining, samples: list[TokenSample],
             targets: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """Teacher-forced top-1 agreement with the teacher (its top-1 is the first of its stored top-k)."""
    if not samples:
        return {}
    student.eval()
    ours = torch_top1(student, [s.ids for s in samples])
    theirs = [idx[:, 0].numpy().astype(ours[0].dtype) for idx, _ in targets]
    answers = agreement(ours, theirs, [s.answer_start for s in samples])
    everything = agreement(ours, theirs)
    return {"answer_top1_agreement": answers.rate, "answer_positions": answers.positions,
            "all_top1_agreement": everything.rate, "all_positions": everything.positions, "samples": len(samples)}


def distill(cfg: DistillConfig, *, resume: bool = True, progress: bool = True,
            log: Callable[[str], None] = print) -> DistillReport:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from cloud.engine.tokenizer import Tokenizer

    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cfg.out.mkdir(parents=True, exist_ok=True)
    ckpt_path = cfg.out / "checkpoint.pt"
    state = torch.load(ckpt_path, weights_only=False) if resume and ckpt_path.exists() else None

    tok_meta = teacher_tokenizer(cfg.teacher, cfg.out / "teacher_tokenizer.json")
    if not tok_meta:
        raise DistillError(f"{cfg.teacher} carries no GGUF tokenizer metadata; the teacher must be a GGUF file")
    train_samples, held_out = prepare_corpus(cfg, tok_meta, log)
    tok = Tokenizer.from_gguf_metadata(tok_meta)
    train = tokenize(tok, train_samples, cfg.seq_len)
    evals = tokenize(tok, held_out, cfg.seq_len)

    targets_path = cfg.out / "targets.pt"
    key = _fingerprint(str(cfg.teacher), cfg.top_k, [s.ids for s in train], [s.ids for s in evals])
    cached = torch.load(targets_path, weights_only=False) if targets_path.exists() else None
    teacher: LlamaForTraining | None = None
    if cached is None or cached.get("key") != key or state is None:  # a resumed run with targets needs no teacher
        log(f"loading teacher {cfg.teacher}")
        teacher, _ = load_model(cfg.teacher)
        teacher_config = teacher.config
    else:
        teacher_config = ModelConfig(**state["teacher_config"])
    layers = sorted(cfg.layer_ids) if cfg.layer_ids else spread_layers(teacher_config.num_layers, cfg.layers)
    if state is not None and state["config"]["layers_used"] != layers:
        raise DistillError(f"{ckpt_path} is for teacher layers {state['config']['layers_used']}, not {layers}; "
                           "use another --out or --no-resume")
    if cached is not None and cached.get("key") == key:
        train_t, eval_t = cached["train"], cached["eval"]
    else:
        assert teacher is not None
        log(f"teacher targets: top-{cfg.top_k} over {sum(len(s.ids) for s in train + evals)} tokens")
        done = [0]
        total = len(train) + len(evals)

        def tick(n: int) -> None:
            done[0] += n
            if done[0] % 40 < n or done[0] == total:
                log(f"teacher targets {done[0]}/{total} samples ({time.perf_counter() - t_start:.0f} s)")
        train_t = teacher_targets(teacher, train, cfg.top_k, on_batch=tick)
        eval_t = teacher_targets(teacher, evals, cfg.top_k, on_batch=tick)
        _atomic_save({"key": key, "train": train_t, "eval": eval_t}, targets_path)

    if teacher is not None:
        student = student_from_teacher(Checkpoint(config=teacher.config, weights=dict(teacher.state_dict()),
                                                  source=cfg.teacher), layers)
        teacher_parameters = teacher.num_parameters()
        del teacher
    else:
        student = LlamaForTraining(dataclasses.replace(teacher_config, num_layers=len(layers)))
        teacher_parameters = state["teacher_parameters"]
    report = DistillReport(out=cfg.out, model_dir=cfg.out / "model", steps=cfg.steps, teacher_layers=layers,
                           student_parameters=student.num_parameters(), teacher_parameters=teacher_parameters)
    student.model.embed_tokens.weight.requires_grad_(cfg.train_embeddings)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step = 0
    if state is None:
        report.eval["before"] = evaluate(student, evals, eval_t)
    else:
        student.load_state_dict(state["student"])
        optimizer.load_state_dict(state["optimizer"])
        step, report.losses, report.kl = state["step"], state["losses"], state["kl"]
        report.eval["before"], report.train_tokens = state["eval_before"], state["train_tokens"]
        log(f"resumed from {ckpt_path} at step {step}")

    def save_checkpoint() -> None:
        _atomic_save({"step": step, "student": student.state_dict(), "optimizer": optimizer.state_dict(),
                      "losses": report.losses, "kl": report.kl, "eval_before": report.eval.get("before", {}),
                      "train_tokens": report.train_tokens, "teacher_parameters": teacher_parameters,
                      "teacher_config": {f.name: getattr(teacher_config, f.name)
                                         for f in dataclasses.fields(teacher_config)},
                      "config": {**asdict(cfg), "layers_used": layers}}, ckpt_path)

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16")
    columns = [TextColumn("[bold]distill"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, disable=not progress, transient=False) as bar:
        task = bar.add_task("distill", total=cfg.steps, completed=step, info="")
        try:
            while step < cfg.steps:
                t0 = time.perf_counter()
                student.train()
                batch = sample_order(len(train), cfg.seed, step * cfg.batch_size, cfg.batch_size)
                ids = _pad([train[i].ids for i in batch])
                mask = _pad([[1] * len(train[i].ids) for i in batch])
                k = cfg.top_k
                t_idx = torch.zeros(*ids.shape, k, dtype=torch.int32)
                t_val = torch.zeros(*ids.shape, k, dtype=torch.float32)
                for row, i in enumerate(batch):
                    n = len(train[i].ids)
                    t_idx[row, :n], t_val[row, :n] = train_t[i]
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(step, cfg)
                with autocast:
                    logits = student(ids)
                loss, kl, ce = distill_loss(logits, ids, mask, t_idx, t_val, cfg.temperature, cfg.alpha_ce)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                del logits, loss
                step += 1
                tokens = int(mask.sum())
                report.train_tokens += tokens
                report.losses.append(round(kl + cfg.alpha_ce * ce, 5))
                report.kl.append(round(kl, 5))
                bar.update(task, completed=step, info=f"kl {kl:.3f} ce {ce:.3f} "
                                                      f"{tokens / (time.perf_counter() - t0):.0f} tok/s")
                if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                    save_checkpoint()
                    if not progress:
                        log(f"step {step}/{cfg.steps} kl {kl:.3f} ce {ce:.3f} lr {lr_at(step - 1, cfg):.2e} "
                            f"({time.perf_counter() - t_start:.0f} s)")
        except KeyboardInterrupt:
            save_checkpoint()
            log(f"interrupted: checkpoint at step {step} in {ckpt_path}; run again to resume")
            raise

    report.eval["after"] = evaluate(student, evals, eval_t)
    save_hf_folder(student, tok_meta, report.model_dir,
                   extra_config={"apiary_distill": {"teacher": str(cfg.teacher), "teacher_layers": layers,
                                                    "steps": step, "train_tokens": report.train_tokens}})
    report.seconds = time.perf_counter() - t_start
    (cfg.out / "report.json").write_text(json.dumps(asdict(report), indent=1, default=str))
    return report
