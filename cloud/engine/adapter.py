"""LoRA adapters: merged into a checkpoint's weights at load, so serving costs nothing extra.

An adapter is a folder with ``adapter_config.json`` (rank, alpha, target weights, the base
model's identity, the prompt style it was tuned for) and ``adapter.safetensors`` holding
``<weight name>.lora_A`` ``[r, in]`` and ``<weight name>.lora_B`` ``[out, r]`` per target,
under the engine's Hugging Face weight names (GGUF q/k already un-permuted, which is the
layout ``apiary.deploy.student.LlamaForTraining`` trains in). Merging adds ``alpha / r * B @ A``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from apiary.cloud.engine import host_memory
from apiary.cloud.engine.errors import EngineError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter.safetensors"
FORMAT = "apiary-lora-1"


@dataclass(slots=True)
class AdapterConfig:
    rank: int
    alpha: float
    targets: list[str]  # weight names without ".weight", e.g. "model.layers.0.self_attn.q_proj"
    base: str = ""  # the base checkpoint's file name (informational)
    base_sha256: str = ""  # the base checkpoint's hash, checked at merge when set
    prompt_style: str = "examples"  # shared.prompting.build_messages style the adapter was tuned for
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def read_config(folder: str | Path) -> AdapterConfig:
    path = Path(folder).expanduser() / CONFIG_FILE
    try:
        doc = json.loads(path.read_text())
        if doc.pop("format", None) != FORMAT:
            raise ValueError(f"not a {FORMAT} adapter")
        config = AdapterConfig(**doc)
    except (OSError, ValueError, TypeError) as e:
        raise EngineError(f"adapter {folder}: cannot read {CONFIG_FILE}: {e}") from None
    if config.rank < 1 or not config.targets:
        raise EngineError(f"adapter {folder}: rank must be >= 1 and targets non-empty")
    return config


def write(folder: str | Path, config: AdapterConfig, tensors: dict[str, torch.Tensor]) -> Path:
    """Write an adapter folder (weights first, config last: its presence marks a complete adapter)."""
    import dataclasses
    import os

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (WEIGHTS_FILE + ".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, folder / WEIGHTS_FILE)
    tmp = folder / (CONFIG_FILE + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, **dataclasses.asdict(config)}, indent=1))
    os.replace(tmp, folder / CONFIG_FILE)
    return folder


def file_sha256(path: str | Path) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def merge(weights: dict[str, torch.Tensor], folder: str | Path, base_path: str | Path | None = None) -> AdapterConfig:
    """Add the adapter in ``folder`` to ``weights`` (float32): each target's entry is replaced by a new, merged tensor
    (the checkpoint's own tensors are not written); EngineError if it does not fit
    (or, when both are known, was tuned on another base file than ``base_path``)."""
    from safetensors.torch import load_file

    config = read_config(folder)
    base_sha256 = file_sha256(base_path) if config.base_sha256 and base_path and Path(base_path).is_file() else None
    if base_sha256 and config.base_sha256 != base_sha256:
        raise EngineError(f"adapter {folder} was tuned on a base with sha256 {config.base_sha256[:12]}…, "
                          f"not this one ({base_sha256[:12]}…)")
    try:
        tensors = load_file(str(Path(folder).expanduser() / WEIGHTS_FILE))
    except (OSError, ValueError) as e:
        raise EngineError(f"adapter {folder}: cannot read {WEIGHTS_FILE}: {e}") from None
    pages = host_memory.FilePages([weights[n + ".weight"] for n in config.targets if n + ".weight" in weights])
    for name in config.targets:
        w = weights.get(name + ".weight")
        a, b = tensors.get(name + ".lora_A"), tensors.get(name + ".lora_B")
        if w is None or a is None or b is None:
            raise EngineError(f"adapter {folder}: target {name} is missing from the model or the adapter")
        if a.shape != (config.rank, w.shape[1]) or b.shape != (w.shape[0], config.rank):
            raise EngineError(f"adapter {folder}: {name} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                              f"which do not fit a {tuple(w.shape)} weight at rank {config.rank}")
        # a new tensor, not ``w +=``: the checkpoint cache maps its file, and a write would make private copies of
        # those pages, which the model could then not drop once it has copied them (``host_memory.FilePages``); the
        # mapped original's pages are dropped here, as the model drops those it copies
        weights[name + ".weight"] = w + config.scale * (b.float() @ a.float())
        pages.release(w)
    return config
