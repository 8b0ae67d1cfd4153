"""Task fine-tuning of the cloud model: LoRA on labelled situations, so the teacher answers the task.

The base model (SmolLM2-135M) with worked examples in its prompt gets the sensor task
right about two times in three. ``apiary finetune`` teaches it from labelled situations (the
simulator's, with seeds no benchmark split uses, plus operators' labels exported by
``apiary fleet export-labels``): the prompt is the short one (system message and the event,
no worked examples, < 400 tokens) and the target is the ``Action`` JSON with the true
assessment and an action, urgency and explanation written from the event
(``apiary.deploy.answers``). Only the answer tokens (and the end token) carry loss.

Why a hand-written LoRA and not peft: the training model is our own ``LlamaForTraining``
(Hugging Face weight names, the engine's loader and RoPE), not a transformers model, and
the wrapper is a dozen lines; peft would bring transformers and accelerate into a deploy
tool for the same arithmetic. The adapter is saved in the engine's format
(``apiary.cloud.engine.adapter``) and merged at load, so serving the teacher costs nothing extra.

Everything lives under one folder and resumes where it stopped::

    checkpoint.pt   LoRA weights, optimizer and step (replaced atomically every few steps)
    adapter/        the final adapter (``EngineConfig(adapter_path=...)``)
    report.json     losses, validation accuracy as it trained, per-label accuracy at the end

Validation runs the real engine: the adapter so far merged into the base, the action
schema enforced by the grammar, greedy, on held-out situations from other simulated hives.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from apiary.cloud.engine import adapter as adapter_format
from apiary.deploy.answers import answer_text
from apiary.deploy.student import LlamaForTraining, load_model

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Seeds of the simulator splits: training and validation are disjoint from bench/make_edge_eval's
# calibration (101) and test (202) splits and from the distillation's held-out hives.
TRAIN_SEED, VAL_SEED = 303, 404


class FinetuneError(ValueError):
    """A setting or resume state that cannot work."""


@dataclass(slots=True)
class FinetuneConfig:
    base: Path
    out: Path
    steps: int = 120
    batch_size: int = 8
    lr: float = 4e-4
    warmup_steps: int = 10
    rank: int = 16
    alpha: float = 32.0
    lora_layers: int = 12  # adapt the last N layers: below them nothing needs gradients (~2x cheaper steps)
    train_situations: int = 960
    val_situations: int = 48
    labels: list[Path] = field(default_factory=list)  # operators' exports (rows: id, label, event, context)
    eval_every: int = 40
    checkpoint_every: int = 10
    seed: int = 0
    threads: int | None = None
    dtype: str = "auto"  # autocast dtype for matmuls: auto = bfloat16 where the CPU has bf16 instructions

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "rank", "lora_layers", "train_situations", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise FinetuneError(f"{name} must be >= 1")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise FinetuneError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")


@dataclass(slots=True)
class Example:
    prompt: list[int]
    answer: list[int]  # the answer's tokens, then the end token
    label: str


@dataclass(slots=True)
class FinetuneReport:
    adapter_dir: str
    steps: int
    seconds: float
    autocast: str
    train_examples: int
    losses: list[float] = field(default_factory=list)
    validation: list[dict[str, Any]] = field(default_factory=list)  # {step, accuracy, valid, per_label}
    prompt_tokens_mean: float = 0.0


# ---------------------------------------------------------------- LoRA


class LoRALinear(nn.Module):
    """``base(x) + alpha / r * B(A(x))`` with the base frozen; B starts at zero, so step 0 is the base model."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        base.weight.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype)) * self.scale


def add_lora(model: LlamaForTraining, rank: int, alpha: float, targets: Sequence[str] = TARGETS,
             layers: int | None = None) -> dict[str, LoRALinear]:
    """Wrap the target projections of the last ``layers`` layers (all when None); freeze everything else.

    Autograd records nothing below the lowest adapted layer (no input there needs a gradient), so
    adapting only the upper layers makes the backward pass that much shorter. Returns {weight name: module}.
    """
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped: dict[str, LoRALinear] = {}
    first = 0 if layers is None else max(0, len(model.model.layers) - layers)
    for i, layer in enumerate(model.model.layers):
        if i < first:
            continue
        for part_name, part in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
            for name in targets:
                base = getattr(part, name, None)
                if isinstance(base, nn.Linear):
                    lora = LoRALinear(base, rank, alpha)
                    setattr(part, name, lora)
                    wrapped[f"model.layers.{i}.{part_name}.{name}"] = lora
    if not wrapped:
        raise FinetuneError(f"no target projections {list(targets)} in the model")
    return wrapped


def lora_tensors(wrapped: dict[str, LoRALinear]) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in wrapped.items():
        out[f"{name}.lora_A"] = m.lora_A.detach().clone()
        out[f"{name}.lora_B"] = m.lora_B.detach().clone()
    return out


def load_lora(wrapped: dict[str, LoRALinear], tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, m in wrapped.items():
            m.lora_A.copy_(tensors[f"{name}.lora_A"])
            m.lora_B.copy_(tensors[f"{name}.lora_B"])


# ---------------------------------------------------------------- data


def situations_from_labels(paths: Sequence[Path]) -> list[tuple[str, Any, list[Any]]]:
    """(label, event, context) rows of operator label exports (``apiary fleet export-labels``)."""
    from apiary.shared.protocol import ASSESSMENTS, SensorEvent

    rows = []
    for path in paths:
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                label = doc["label"]
                if label not in ASSESSMENTS:
                    raise ValueError(f"unknown label {label!r}")
                rows.append((label, SensorEvent.model_validate(doc["event"]),
                             [SensorEvent.model_validate(c) for c in doc.get("context", [])]))
            except (ValueError, KeyError, TypeError) as e:
                raise FinetuneError(f"{path}:{n}: not a labelled situation: {e}") from None
    return rows


def build_examples(tok: Any, rows: Sequence[tuple[str, Any, list[Any]]]) -> list[Example]:
    """Short-prompt chats and their reference answers as token ids (the prompt as the engine renders it)."""
    from apiary.shared.prompting import build_messages

    eos = tok.eos_token_id
    if eos is None:
        raise FinetuneError("the base model's tokenizer has no end-of-sequence token")
    out = []
    for label, event, context in rows:
        messages = [m.model_dump() for m in build_messages(event, context, style="short")]
        prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
        answer = tok._tok.encode(answer_text(label, event, context), add_special_tokens=False).ids + [eos]
        out.append(Example(prompt, answer, label))
    return out


def batch_tensors(batch: Sequence[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids ``[B, T]`` and the loss mask of the positions that predict answer tokens."""
    seqs = [e.prompt + e.answer for e in batch]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, (e, s) in enumerate(zip(batch, seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, len(e.prompt) - 1: len(s) - 1] = True  # position t predicts token t + 1
    return ids, mask


def loss_of(model: LlamaForTraining, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(ids)[:, :-1]
    targets = ids[:, 1:]
    m = mask[:, :-1]
    return F.cross_entropy(logits[m], targets[m])


def lr_at(step: int, cfg: FinetuneConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def autocast_dtype(choice: str) -> torch.dtype | None:
    """bf16 autocast where the CPU multiplies bf16 natively (AVX-512 bf16 / AMX); float32 elsewhere
    (emulated bf16 is slower than float32: a short distillation ran past 600 s on an AVX2 host)."""
    from apiary.kernels import cpu

    if choice == "float32":
        return None
    if choice == "bfloat16":
        return torch.bfloat16
    return torch.bfloat16 if cpu.native_bf16(cpu.host_flags()) else None


# ---------------------------------------------------------------- validation


def validate(base: Path, adapter_dir: Path | None, rows: Sequence[tuple[str, Any, list[Any]]],
             max_tokens: int = 96) -> dict[str, Any]:
    """Accuracy of the base (+ adapter) on ``rows`` in the short prompt through the real engine."""
    from apiary.deploy.accuracy import engine_accuracy
    from apiary.shared.prompting import build_messages

    prompts = [[m.model_dump() for m in build_messages(e, c, style="short")] for _, e, c in rows]
    return engine_accuracy(base, prompts, [label for label, _, _ in rows], adapter=adapter_dir, max_tokens=max_tokens)


# ---------------------------------------------------------------- the run


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def finetune(cfg: FinetuneConfig, *, resume: bool = True, progress: bool = True,
             log: Callable[[str], None] = print) -> FinetuneReport:
    from apiary.cloud.engine.tokenizer import load_tokenizer
    from apiary.firmware_bridge.simulator import labelled_situations

    started = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cfg.out.mkdir(parents=True, exist_ok=True)
    model, ckpt = load_model(cfg.base)
    tok = load_tokenizer(Path(cfg.base), ckpt.metadata or None)
    torch.manual_seed(cfg.seed)
    wrapped = add_lora(model, cfg.rank, cfg.alpha, layers=cfg.lora_layers)
    train_rows = [(s.label, s.event, s.context) for s in labelled_situations(cfg.train_situations, TRAIN_SEED)]
    train_rows += situations_from_labels(cfg.labels)
    val_rows = [(s.label, s.event, s.context) for s in labelled_situations(cfg.val_situations, VAL_SEED)]
    examples = build_examples(tok, train_rows)
    fingerprint = json.dumps({k: str(v) for k, v in asdict(cfg).items()
                              if k not in ("steps", "eval_every", "checkpoint_every", "threads")}, sort_keys=True)
    params = [p for m in wrapped.values() for p in (m.lora_A, m.lora_B)]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    cast = autocast_dtype(cfg.dtype)
    report = FinetuneReport(adapter_dir=str(cfg.out / "adapter"), steps=cfg.steps, seconds=0.0,
                            autocast=str(cast or "float32").replace("torch.", ""), train_examples=len(examples),
                            prompt_tokens_mean=sum(len(e.prompt) for e in examples) / max(1, len(examples)))
    step = 0
    ck_path = cfg.out / "checkpoint.pt"
    if resume and ck_path.is_file():
        state = torch.load(ck_path, weights_only=False)
        if state.get("fingerprint") != fingerprint:
            raise FinetuneError(f"{ck_path} belongs to a run with other settings; use another --out or --no-resume")
        load_lora(wrapped, state["lora"])
        opt.load_state_dict(state["opt"])
        step, report.losses, report.validation = state["step"], state["losses"], state["validation"]
        log(f"resuming at step {step}")
    rng = random.Random(cfg.seed)
    order = [i for _ in range(cfg.steps * cfg.batch_size // max(1, len(examples)) + 2)
             for i in rng.sample(range(len(examples)), len(examples))]

    def checkpoint() -> None:
        _atomic_save({"fingerprint": fingerprint, "step": step, "lora": lora_tensors(wrapped),
                      "opt": opt.state_dict(), "losses": report.losses, "validation": report.validation}, ck_path)

    def save_adapter(folder: Path) -> Path:
        targets = list(wrapped)
        config = adapter_format.AdapterConfig(rank=cfg.rank, alpha=cfg.alpha, targets=targets, base=cfg.base.name,
                                              base_sha256=adapter_format.file_sha256(cfg.base) if cfg.base.is_file()
                                              else "", prompt_style="short",
                                              extra={"steps": step, "train_situations": cfg.train_situations,
                                                     "train_seed": TRAIN_SEED, "seed": cfg.seed})
        return adapter_format.write(folder, config, {k: v.to(torch.float16) for k, v in lora_tensors(wrapped).items()})

    def evaluate() -> None:
        folder = save_adapter(cfg.out / "adapter-latest")
        result = {"step": step, **validate(cfg.base, folder, val_rows)}
        report.validation.append(result)
        log(f"step {step}: validation accuracy {result['accuracy']:.1%} (valid {result['valid']:.0%}) "
            f"{result['per_label']}")

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = [TextColumn("finetune"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn()]
    model.train()
    with Progress(*columns, disable=not progress, transient=False) as bar:
        task = bar.add_task("steps", total=cfg.steps, completed=step, loss="-")
        while step < cfg.steps:
            batch = [examples[i] for i in order[step * cfg.batch_size:(step + 1) * cfg.batch_size]]
            ids, mask = batch_tensors(batch)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            with torch.autocast("cpu", dtype=cast, enabled=cast is not None):
                loss = loss_of(model, ids, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            report.losses.append(round(loss.item(), 5))
            bar.update(task, completed=step, loss=f"{report.losses[-1]:.3f}")
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                checkpoint()
            if step % cfg.eval_every == 0 and step < cfg.steps:
                model.eval()
                evaluate()
                model.train()
    model.eval()
    final = save_adapter(cfg.out / "adapter")
    if not report.validation or report.validation[-1]["step"] != step:
        result = {"step": step, **validate(cfg.base, final, val_rows)}
        report.validation.append(result)
        log(f"step {step}: validation accuracy {result['accuracy']:.1%} (valid {result['valid']:.0%}) "
            f"{result['per_label']}")
    report.seconds = time.perf_counter() - started
    tmp = cfg.out / "report.json.tmp"
    tmp.write_text(json.dumps(asdict(report), indent=1))
    os.replace(tmp, cfg.out / "report.json")
    return report
