"""Knowledge distillation: a student with fewer layers learns the teacher's next-token distributions.

The teacher is the cloud's: the base GGUF with its task adapter merged (``--teacher-adapter``,
``apiary finetune``'s output; by default the shipped one when the base is its model). The
corpus is the edge's real work asked in the teacher's prompt style (the adapter's: the short
prompt) and answered by the teacher through our engine, schema-constrained and greedy;
answers whose assessment is not the simulator's label are left out (``keep_wrong``), so the
student learns the task from a teacher that got it right, plus general text so that it stays
a usable draft model.

Everything lives under one output folder and every stage resumes where it stopped::

    corpus.jsonl   training samples: sensor prompts + teacher answers (deploy.corpus)
    eval.jsonl     held-out sensor samples from other simulated hives
    corpus.json    what the corpus was built with (teacher, adapter, prompt style, seed): a resume must match
    teacher_tokenizer.json  the teacher GGUF's tokenizer metadata (slow to parse, so parsed once)
    targets.pt     the teacher's top-k logits at every position, computed once (float32)
    checkpoint.pt  student, optimizer and step, replaced atomically every ``checkpoint_every`` steps
    model/         the final student as a Hugging Face folder the cloud engine loads
    report.json    loss curve, held-out agreement with the teacher and task accuracy, before and after

The student copies the merged teacher's embeddings, final norm, head and an evenly spread
subset of its layers, then minimises the temperature-scaled KL divergence to the teacher
(times T^2) plus ``alpha_ce`` x cross-entropy on the text itself. The teacher runs once per
sample, not once per step: on this CPU its forward costs as much as a student step, and
its top 64 tokens hold nearly all of its probability mass, so the KL is taken over them plus
one bucket for everything else (exact over those 65 outcomes).

Sensor prompts all open with the same system message. That prefix runs once (teacher: once
in all; student: once per batch at batch 1, gradients flowing back through its K/V into every
sample's tail), and its loss counts as one sample's, so the answers are what the student
spends its steps on. The held-out task accuracy runs the student in the real engine, as the
cloud would run it, on situations from other simulated hives.
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

from apiary.cloud.engine.config import ModelConfig
from apiary.cloud.engine.loader import Checkpoint
from apiary.deploy import corpus as corpus_mod
from apiary.deploy.agreement import agreement, torch_top1
from apiary.deploy.finetune import autocast_dtype
from apiary.deploy.student import (LlamaForTraining, load_model, save_hf_folder, spread_layers, student_from_teacher,
                            tokenizer_metadata)


class DistillError(ValueError):
    """A distillation setting or resume state that cannot work."""


@dataclass(slots=True)
class DistillConfig:
    teacher: Path
    out: Path
    teacher_adapter: Path | None = None  # LoRA adapter merged into the teacher (apiary finetune's adapter/)
    layers: int = 8  # student depth; layers are copied evenly spread from the teacher
    layer_ids: list[int] | None = None  # or exactly these teacher layers
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 512  # general text is cut into pieces of this many tokens; sensor samples stay whole
    lr: float = 3e-4
    warmup_steps: int = 10
    temperature: float = 2.0
    alpha_ce: float = 0.1
    top_k: int = 64
    n_sensor: int = 240
    n_eval: int = 24
    n_general: int | None = None  # general-text records to include (None: all, 0: none)
    max_answer_tokens: int = 96
    context_drop: float = 0.25  # share of sensor situations seen with fewer earlier events (deploy.corpus)
    seed: int = 0
    threads: int = 2  # torch threads
    qat_steps: int = 0  # the last N steps train through the export's INT4 rounding (deploy.qat)
    qat_qtype: str = "q4_0"  # the GGUF block type `apiary quantize` will write
    keep_wrong: bool = False  # also learn from teacher answers whose assessment is not the label
    dtype: str = "auto"  # autocast of the student's matmuls (auto: bf16 where the CPU has it); weights stay float32
    checkpoint_every: int = 10
    train_embeddings: bool = False  # embeddings are tied to the head: frozen keeps the teacher's vocabulary space

    def __post_init__(self) -> None:
        self.teacher, self.out = Path(self.teacher), Path(self.out)
        self.teacher_adapter = Path(self.teacher_adapter) if self.teacher_adapter else None
        checks = [(self.steps >= 1, "steps must be >= 1"), (self.batch_size >= 1, "batch_size must be >= 1"),
                  (self.seq_len >= 16, "seq_len must be >= 16"), (self.lr > 0, "lr must be > 0"),
                  (self.temperature > 0, "temperature must be > 0"), (self.alpha_ce >= 0, "alpha_ce must be >= 0"),
                  (self.top_k >= 1, "top_k must be >= 1"), (self.n_sensor >= 0 and self.n_eval >= 0,
                                                            "n_sensor and n_eval must be >= 0"),
                  (self.dtype in ("auto", "float32", "bfloat16"), "dtype must be auto, float32 or bfloat16"),
                  (self.checkpoint_every >= 1, "checkpoint_every must be >= 1"),
                  (0 <= self.qat_steps <= self.steps, "qat_steps must be in 0..steps"),
                  (0 <= self.context_drop <= 1, "context_drop must be in 0..1"),
                  (self.qat_qtype in ("q4_0", "q4_1"), "qat_qtype must be q4_0 or q4_1")]
        for ok, message in checks:
            if not ok:
                raise DistillError(message)
        if not self.teacher.exists():
            raise DistillError(f"teacher model not found: {self.teacher}")
        if self.teacher_adapter is not None and not (self.teacher_adapter / "adapter_config.json").is_file():
            raise DistillError(f"teacher adapter not found: {self.teacher_adapter} has no adapter_config.json")

    @property
    def prompt_style(self) -> str:
        """The prompt the teacher was tuned for (its adapter's), which the student inherits."""
        if self.teacher_adapter is None:
            return "examples"
        from apiary.cloud.engine.adapter import read_config

        return read_config(self.teacher_adapter).prompt_style


@dataclass(slots=True)
class TokenSample:
    ids: list[int]
    answer_start: int  # first position whose next token belongs to the answer (0 for general text)
    shared: bool = False  # starts with the corpus's shared prompt prefix (every sensor sample does)


# The teacher at temperature T, per position: its top-k token ids [n, k] (int32) and their log-probabilities
# plus the log of the probability left outside them [n, k + 1] (float32). With that "rest" bucket the KL is
# exact over k + 1 outcomes: zero only when the student matches the teacher, not when it crams all its
# mass into the teacher's top k.
Targets = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class TokenData:
    """Tokenised samples plus the prompt prefix all sensor samples share (the fixed system message).

    The prefix runs once per batch (student) or once in all (teacher) and its K/V is reused:
    sensor prompts are ~1,300 tokens of which ~1,200 are that prefix.
    """

    prefix: list[int]
    samples: list[TokenSample]

    def tail(self, s: TokenSample) -> list[int]:
        return s.ids[len(self.prefix):] if s.shared else s.ids


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
    prompt_style: str = "examples"
    teacher_corpus: dict[str, Any] = field(default_factory=dict)  # the teacher's accuracy on its own answers
    eval: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


# ---------------------------------------------------------------- data


def tokenize(tok: Any, samples: list[corpus_mod.Sample], seq_len: int, prefix: list[int] | None = None) -> TokenData:
    """Token ids; general text cut into ``seq_len`` pieces; sensor samples whole, their shared prefix found.

    ``prefix``: use this shared prefix (the training set's) instead of finding one.
    """
    out: list[TokenSample] = []
    prompts: list[list[int]] = []
    for s in samples:
        ids = tok.encode(s.text)
        if s.kind == "general":
            out += [TokenSample(ids[i:i + seq_len], 0) for i in range(0, len(ids), seq_len) if len(ids[i:i + seq_len]) > 8]
        else:
            prompt = tok.encode(s.prompt)
            if ids[:len(prompt)] != prompt or len(ids) == len(prompt):
                raise DistillError("a sensor sample's prompt does not tokenise as a prefix of prompt + answer")
            prompts.append(prompt)
            out.append(TokenSample(ids, len(prompt) - 1, shared=True))
    if prefix is None:
        prefix = _common_prefix(prompts) if len(prompts) > 1 else []
    if any(s.ids[:len(prefix)] != prefix for s in out if s.shared):
        prefix = []
    return TokenData(prefix=prefix, samples=out) if prefix else \
        TokenData(prefix=[], samples=[dataclasses.replace(s, shared=False) for s in out])


def _common_prefix(seqs: list[list[int]]) -> list[int]:
    first = seqs[0]
    n = min(len(s) for s in seqs)
    for s in seqs[1:]:
        n = next((i for i in range(n) if s[i] != first[i]), n)
    return first[:n]


def top_k_targets(logits: torch.Tensor, k: int, temperature: float) -> Targets:
    """``logits`` [..., V] -> top-k ids and [top-k log-probs at ``temperature``, log of the rest]."""
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    values, indices = logp.topk(k, dim=-1)
    rest = torch.logsumexp(logp.scatter(-1, indices, float("-inf")), dim=-1, keepdim=True)
    return indices.to(torch.int32), torch.cat([values, rest], dim=-1)


@torch.no_grad()
def teacher_targets(teacher: LlamaForTraining, data: TokenData, k: int, temperature: float = 1.0,
                    batch_size: int = 4,
                    on_batch: Callable[[int], None] | None = None) -> tuple[Targets | None, list[Targets]]:
    """The teacher's :data:`Targets` at every position: once over the shared prefix, then each sample's tail."""
    prefix_t, kv = None, None
    if data.prefix:
        logits, kv = teacher.forward_with_cache(torch.tensor([data.prefix]))
        prefix_t = top_k_targets(logits[0], k, temperature)
    out: list[Targets] = [None] * len(data.samples)  # type: ignore[list-item]
    for shared in (True, False):
        order = sorted((i for i, s in enumerate(data.samples) if s.shared == shared),
                       key=lambda i: len(data.samples[i].ids))
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            tails = [data.tail(data.samples[i]) for i in idx]
            indices, values = top_k_targets(teacher(_pad(tails), past=kv if shared else None), k, temperature)
            for row, (i, tail) in enumerate(zip(idx, tails)):
                out[i] = (indices[row, :len(tail)].clone(), values[row, :len(tail)].clone())
            if on_batch:
                on_batch(len(idx))
    return prefix_t, out


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


def token_losses(student_logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, t_idx: torch.Tensor,
                 t_logp: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Sums over real positions of KL(teacher_T || student_T) * T^2 (over the teacher's top k and the rest)
    and of the next-token cross-entropy, with the position counts: (kl_sum, ce_sum, n_kl, n_ce).

    Shapes: logits [B, T, V]; ids, mask [B, T]; t_idx [B, T, k]; t_logp [B, T, k + 1] (see :data:`Targets`).
    """
    m = mask.bool()
    idx = t_idx[m].long()
    log_ps_all = F.log_softmax(student_logits[m].float() / temperature, dim=-1)  # [N, V]
    log_ps, log_pt = log_ps_all.gather(-1, idx), t_logp[m]
    if idx.shape[-1] < log_ps_all.shape[-1]:  # the rest bucket (empty when k covers the whole vocabulary)
        rest = torch.logsumexp(log_ps_all.scatter(-1, idx, float("-inf")), dim=-1, keepdim=True)
        log_ps = torch.cat([log_ps, rest], dim=-1)
    else:
        log_pt = log_pt[..., :-1]
    kl = (log_pt.exp() * (log_pt - log_ps)).sum() * temperature ** 2
    ce_mask = m[:, :-1] & m[:, 1:]
    ce = F.cross_entropy(student_logits[:, :-1][ce_mask].float(), ids[:, 1:][ce_mask], reduction="sum")
    return kl, ce, int(m.sum()), int(ce_mask.sum())


def distill_loss(student_logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, t_idx: torch.Tensor,
                 t_logp: torch.Tensor, temperature: float, alpha_ce: float) -> tuple[torch.Tensor, float, float]:
    """Mean KL (times T^2, teacher's top k) + ``alpha_ce`` x mean next-token cross-entropy: (loss, kl, ce)."""
    kl, ce, n_kl, n_ce = token_losses(student_logits, ids, mask, t_idx, t_logp, temperature)
    kl, ce = kl / max(n_kl, 1), ce / max(n_ce, 1)
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

    from apiary.cloud.engine.loader import read_gguf_metadata

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


def corpus_stamp(cfg: DistillConfig) -> dict[str, Any]:
    """What the corpus is built from; a folder built otherwise cannot be continued."""
    from apiary.cloud.engine.adapter import file_sha256

    adapter = None
    if cfg.teacher_adapter is not None:
        adapter = {"folder": str(cfg.teacher_adapter),
                   "sha256": {f.name: file_sha256(f) for f in sorted(cfg.teacher_adapter.iterdir()) if f.is_file()
                              and f.suffix in (".json", ".safetensors")}}
    return {"teacher": cfg.teacher.name, "teacher_size": cfg.teacher.stat().st_size if cfg.teacher.is_file() else None,
            "adapter": adapter, "prompt_style": cfg.prompt_style, "seed": cfg.seed, "context_drop": cfg.context_drop,
            "max_answer_tokens": cfg.max_answer_tokens, "answered_by": "engine, Action JSON schema, greedy"}


def prepare_corpus(cfg: DistillConfig, log: Callable[[str], None],
                   info: dict[str, Any] | None = None) -> tuple[list[corpus_mod.Sample], list[corpus_mod.Sample]]:
    """Training and held-out samples (answered by the teacher on first use, continued after a crash).

    Training answers that are wrong are dropped unless ``keep_wrong``; held-out samples are kept
    as they are (they measure agreement with the teacher, right or wrong).
    """
    t0 = time.perf_counter()
    stamp_path = cfg.out / "corpus.json"
    stamp = corpus_stamp(cfg)
    if stamp_path.is_file() and json.loads(stamp_path.read_text()) != stamp:
        raise DistillError(f"{cfg.out} holds a corpus built from another teacher, adapter or prompt style "
                           f"({stamp_path}); use another --out")
    stamp_path.write_text(json.dumps(stamp, indent=1))
    engine = None

    def build(name: str, n: int, seed: int) -> list[corpus_mod.Sample]:
        nonlocal engine
        path = cfg.out / f"{name}.jsonl"
        if not n:
            return []
        if engine is None and len(corpus_mod.load_corpus(path) if path.is_file() else []) < n:
            log(f"teacher: {cfg.teacher.name}" + (f" + adapter {cfg.teacher_adapter}" if cfg.teacher_adapter else "")
                + f", {cfg.prompt_style} prompt")
            engine = corpus_mod.teacher_engine(cfg.teacher, cfg.teacher_adapter)

        def note(done: int) -> None:
            log(f"{name}: teacher answered {done}/{n} ({time.perf_counter() - t0:.0f} s)")
        return corpus_mod.build_sensor_corpus(engine, path, n, seed, style=cfg.prompt_style,
                                              context_drop=cfg.context_drop, max_tokens=cfg.max_answer_tokens,
                                              on_sample=note)

    answered = build("corpus", cfg.n_sensor, cfg.seed)
    held_out = build("eval", cfg.n_eval, cfg.seed + corpus_mod.HELD_OUT_SEED_OFFSET)
    del engine
    right = [s for s in answered if s.right]
    if answered:
        log(f"teacher right on {len(right)}/{len(answered)} training situations"
            + ("" if cfg.keep_wrong else f"; learning from those {len(right)}"))
    if info is not None:
        info |= {"situations": len(answered), "right": len(right),
                                 "held_out_right": sum(s.right for s in held_out), "held_out": len(held_out),
                                 "kept": len(answered) if cfg.keep_wrong else len(right)}
    general = corpus_mod.general_samples()
    train = (answered if cfg.keep_wrong else right) + general[:cfg.n_general if cfg.n_general is not None else len(general)]
    if not train:
        raise DistillError("empty training corpus: set n_sensor > 0 or n_general > 0")
    return train, held_out


def load_teacher(cfg: DistillConfig) -> LlamaForTraining:
    """The teacher as a training module: the base model with its adapter (if any) merged into the weights."""
    from apiary.cloud.engine.adapter import merge

    teacher, _ = load_model(cfg.teacher)
    if cfg.teacher_adapter is not None:
        with torch.no_grad():
            weights = dict(teacher.state_dict())
            merge(weights, cfg.teacher_adapter, cfg.teacher)  # replaces the targets' entries with merged tensors
            teacher.load_state_dict(weights)
    return teacher


def task_accuracy(model_dir: Path, held_out: list[corpus_mod.Sample], max_tokens: int) -> dict[str, Any]:
    """The student's accuracy on the held-out situations through the real engine, beside the teacher's."""
    from apiary.deploy.accuracy import engine_accuracy

    if not held_out:
        return {}
    result = engine_accuracy(model_dir, [s.prompt for s in held_out], [str(s.label) for s in held_out],
                             max_tokens=max_tokens)
    return {**result, "teacher_accuracy": sum(s.right for s in held_out) / len(held_out)}


def evaluate(student: LlamaForTraining, data: TokenData, prefix_t: Targets | None,
             targets: list[Targets]) -> dict[str, Any]:
    """Teacher-forced top-1 agreement with the teacher (its top-1 is the first of its stored top-k)."""
    if not data.samples:
        return {}
    student.eval()
    ours = torch_top1(student, [s.ids for s in data.samples])
    theirs = [torch.cat([prefix_t[0], idx]) if s.shared and prefix_t is not None else idx
              for s, (idx, _) in zip(data.samples, targets)]
    theirs_np = [t[:, 0].numpy().astype(ours[0].dtype) for t in theirs]
    answers = agreement(ours, theirs_np, [s.answer_start for s in data.samples])
    everything = agreement(ours, theirs_np)
    return {"answer_top1_agreement": answers.rate, "answer_positions": answers.positions,
            "all_top1_agreement": everything.rate, "all_positions": everything.positions,
            "samples": len(data.samples)}


def step_loss(student: LlamaForTraining, data: TokenData, batch: list[int], prefix_t: Targets | None,
              targets: list[Targets], cfg: DistillConfig) -> tuple[torch.Tensor, float, float, int]:
    """One batch's loss: the shared prefix once (counted as one sample), then every sample's tail after it.

    Returns (loss, mean kl, mean ce, positions trained on).
    """
    kl_sum = ce_sum = torch.zeros(())
    n_kl = n_ce = 0
    shared = [i for i in batch if data.samples[i].shared]
    plain = [i for i in batch if not data.samples[i].shared]
    for group, past in ((shared, True), (plain, False)):
        if not group:
            continue
        kv = None
        if past:
            logits, kv = student.forward_with_cache(torch.tensor([data.prefix]))
            p = len(data.prefix)
            kl, ce, nk, nc = token_losses(logits, torch.tensor([data.prefix]), torch.ones(1, p), prefix_t[0][None],
                                          prefix_t[1][None], cfg.temperature)
            mean_tail = sum(len(data.tail(data.samples[i])) for i in group) / len(group)
            weight = mean_tail / p  # the prefix is one sample's worth of loss, not 1,200 positions' worth
            kl_sum, ce_sum = kl_sum + kl * weight, ce_sum + ce * weight
            n_kl, n_ce = n_kl + round(nk * weight), n_ce + round(nc * weight)
        tails = [data.tail(data.samples[i]) for i in group]
        ids, mask = _pad(tails), _pad([[1] * len(t) for t in tails])
        t_idx = torch.zeros(*ids.shape, cfg.top_k, dtype=torch.int32)
        t_val = torch.zeros(*ids.shape, cfg.top_k + 1, dtype=torch.float32)
        for row, i in enumerate(group):
            n = len(tails[row])
            t_idx[row, :n], t_val[row, :n] = targets[i]
        logits = student(ids, past=kv)
        kl, ce, nk, nc = token_losses(logits, ids, mask, t_idx, t_val, cfg.temperature)
        kl_sum, ce_sum, n_kl, n_ce = kl_sum + kl, ce_sum + ce, n_kl + nk, n_ce + nc
    kl_mean, ce_mean = kl_sum / max(n_kl, 1), ce_sum / max(n_ce, 1)
    tokens = sum(len(data.tail(data.samples[i])) for i in batch) + (len(data.prefix) if shared else 0)
    return kl_mean + cfg.alpha_ce * ce_mean, float(kl_mean.detach()), float(ce_mean.detach()), tokens


def distill(cfg: DistillConfig, *, resume: bool = True, progress: bool = True,
            log: Callable[[str], None] = print) -> DistillReport:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from apiary.cloud.engine.tokenizer import Tokenizer

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
    corpus_info: dict[str, Any] = {}
    train_samples, held_out = prepare_corpus(cfg, log, corpus_info)
    tok = Tokenizer.from_gguf_metadata(tok_meta)
    train = tokenize(tok, train_samples, cfg.seq_len)
    evals = tokenize(tok, held_out, cfg.seq_len, prefix=train.prefix)
    log(f"{len(train.samples)} training samples, {sum(len(train.tail(s)) for s in train.samples)} tokens "
        f"after a shared {len(train.prefix)}-token prompt prefix; {len(evals.samples)} held-out")

    targets_path = cfg.out / "targets.pt"
    key = _fingerprint(str(cfg.teacher), corpus_stamp(cfg)["adapter"], cfg.top_k, cfg.temperature, train.prefix, [s.ids for s in train.samples],
                       evals.prefix, [s.ids for s in evals.samples])
    cached = torch.load(targets_path, weights_only=False) if targets_path.exists() else None
    fresh = cached is not None and cached.get("key") == key
    teacher: LlamaForTraining | None = None
    if not fresh or state is None:  # a resumed run with its targets needs no teacher at all
        log(f"loading teacher {cfg.teacher}")
        teacher = load_teacher(cfg)
        teacher_config = teacher.config
    else:
        teacher_config = ModelConfig(**state["teacher_config"])
    layers = sorted(cfg.layer_ids) if cfg.layer_ids else spread_layers(teacher_config.num_layers, cfg.layers)
    if state is not None and state["config"]["layers_used"] != layers:
        raise DistillError(f"{ckpt_path} is for teacher layers {state['config']['layers_used']}, not {layers}; "
                           "use another --out or --no-resume")
    if fresh:
        prefix_t, train_t, eval_prefix_t, eval_t = cached["prefix"], cached["train"], cached["eval_prefix"], cached["eval"]
    else:
        assert teacher is not None
        total = len(train.samples) + len(evals.samples)
        log(f"teacher targets: top-{cfg.top_k} over {len(train.prefix)} prefix + "
            f"{sum(len(d.tail(s)) for d in (train, evals) for s in d.samples)} tokens")
        done = [0]

        def tick(n: int) -> None:
            done[0] += n
            if done[0] % 40 < n or done[0] == total:
                log(f"teacher targets {done[0]}/{total} samples ({time.perf_counter() - t_start:.0f} s)")
        prefix_t, train_t = teacher_targets(teacher, train, cfg.top_k, cfg.temperature, on_batch=tick)
        eval_prefix_t, eval_t = teacher_targets(teacher, evals, cfg.top_k, cfg.temperature, on_batch=tick)
        _atomic_save({"key": key, "prefix": prefix_t, "train": train_t, "eval_prefix": eval_prefix_t,
                      "eval": eval_t}, targets_path)

    if teacher is not None:
        student = student_from_teacher(Checkpoint(config=teacher.config, weights=dict(teacher.state_dict()),
                                                  source=cfg.teacher), layers)
        teacher_parameters = teacher.num_parameters()
        del teacher
    else:
        student = LlamaForTraining(dataclasses.replace(teacher_config, num_layers=len(layers)))
        teacher_parameters = state["teacher_parameters"]
    report = DistillReport(out=cfg.out, model_dir=cfg.out / "model", steps=cfg.steps, teacher_layers=layers,
                           prompt_style=cfg.prompt_style, teacher_corpus=corpus_info,
                           student_parameters=student.num_parameters(), teacher_parameters=teacher_parameters)
    student.model.embed_tokens.weight.requires_grad_(cfg.train_embeddings)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step = 0
    if state is None:
        report.eval["before"] = evaluate(student, evals, eval_prefix_t, eval_t)
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

    cast = autocast_dtype(cfg.dtype)
    autocast = torch.autocast("cpu", dtype=cast or torch.bfloat16, enabled=cast is not None)
    columns = [TextColumn("[bold]distill"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, disable=not progress, transient=False) as bar:
        task = bar.add_task("distill", total=cfg.steps, completed=step, info="")
        try:
            while step < cfg.steps:
                t0 = time.perf_counter()
                student.train()
                batch = sample_order(len(train.samples), cfg.seed, step * cfg.batch_size, cfg.batch_size)
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(step, cfg)
                student.set_fake_quant(cfg.qat_qtype if step >= cfg.steps - cfg.qat_steps else None)
                with autocast:
                    loss, kl, ce, tokens = step_loss(student, train, batch, prefix_t, train_t, cfg)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                del loss
                step += 1
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

    student.set_fake_quant(None)
    report.eval["after"] = evaluate(student, evals, eval_prefix_t, eval_t)
    save_hf_folder(student, tok_meta, report.model_dir,
                   extra_config={"apiary_distill": {"teacher": str(cfg.teacher), "teacher_layers": layers,
                                                    "teacher_adapter": str(cfg.teacher_adapter or ""),
                                                    "prompt_style": cfg.prompt_style, "seed": cfg.seed,
                                                    "context_drop": cfg.context_drop,
                                                    "qat": {"steps": cfg.qat_steps, "qtype": cfg.qat_qtype},
                                                    "steps": step, "train_tokens": report.train_tokens}})
    report.eval["task"] = task_accuracy(report.model_dir, held_out, cfg.max_answer_tokens)
    if report.eval["task"]:
        log(f"held-out task accuracy {report.eval['task']['accuracy']:.1%} (teacher "
            f"{report.eval['task']['teacher_accuracy']:.1%}) {report.eval['task']['per_label']}")
    report.seconds = time.perf_counter() - t_start
    (cfg.out / "report.json").write_text(json.dumps(asdict(report), indent=1, default=str))
    return report
