"""Small helpers shared by the Triton kernel modules (imported only when Triton runs)."""
from __future__ import annotations

import os

import torch
import triton

# Triton picks compiled vs interpreted kernels when ``@triton.jit`` runs, i.e. at import time.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in {"1", "true", "on", "yes"}


def next_pow2(n: int) -> int:
    """``tl.arange`` sizes must be powers of two; ``tl.dot`` operands need at least 16 rows/cols."""
    return triton.next_power_of_2(max(1, int(n)))


def device_guard(t: torch.Tensor):
    """Launch on the tensor's own GPU (matters on multi-GPU hosts); a no-op context on CPU."""
    import contextlib

    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def dot_needs_fp32(dtype: torch.dtype) -> bool:
    """The Triton interpreter multiplies bf16 ``tl.dot`` operands as raw uint16 bits (wrong results),

    so under the interpreter bf16 tiles are upcast to fp32 before ``tl.dot``; compiled GPU code
    keeps bf16 operands on the tensor cores.
    """
    return INTERPRETED and dtype == torch.bfloat16
