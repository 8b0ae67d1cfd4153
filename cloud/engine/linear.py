"""A linear layer whose weight is prepacked for the CPU GEMM when that pays.

Why: ``F.linear`` on bfloat16 CPU tensors hands the weight to oneDNN in plain layout, and oneDNN
re-lays it out on every call. Packing it once at load (``torch.ops.mkldnn._reorder_linear_weight``,
what inductor's freezing pass does) measured 1.4-1.7x faster on this model's matmuls at the
batch sizes decoding runs (1-64 rows), ~1.1x on 1,024-row prefill chunks, with bit-identical
results. float32 goes through MKL, where packing measured no gain, and CUDA needs none: there
``Linear`` is plain ``F.linear``. The packing ops are internal to torch, so their absence or any
mismatch on a probe input falls back to ``F.linear``. So does a CPU without native bf16
(``apiary.kernels.cpu.native_bf16``: avx512_bf16 or amx_bf16): there oneDNN emulates bf16, packing is
not the speed path (the engine's ``auto`` dtype is float32 there), and the probe does not match.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from apiary.kernels import cpu


def _pack(weight: torch.Tensor, bias: torch.Tensor | None, flags: Iterable[str] | None) -> torch.Tensor | None:
    """The oneDNN-packed weight, or None where packing is unavailable or would not match ``F.linear``."""
    mkldnn = torch.ops.mkldnn
    if (weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available()
            or not cpu.native_bf16(cpu.host_flags() if flags is None else flags)
            or not hasattr(mkldnn, "_reorder_linear_weight") or not hasattr(mkldnn, "_linear_pointwise")):
        return None
    try:
        with torch.inference_mode():
            packed = mkldnn._reorder_linear_weight(weight, None)
            probe = torch.linspace(-1, 1, 3 * weight.shape[1], dtype=weight.dtype).view(3, -1)
            same = torch.equal(mkldnn._linear_pointwise(probe, packed, bias, "none", [], ""),
                               F.linear(probe, weight, bias))
    except RuntimeError:
        return None
    return packed if same else None


@dataclass(slots=True)
class Linear:
    """``y = x @ weight.T + bias``; ``weight`` stays available in plain layout (tests, parameter counts)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, flags: Iterable[str] | None = None) -> Linear:
        """``flags``: the CPU's features (default: this host's, ``apiary.kernels.cpu.host_flags``)."""
        return cls(weight, bias, _pack(weight, bias, flags))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.dim() != 2 or x.shape[0] == 0 or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def tensors(self) -> list[torch.Tensor]:
        """The parameters (plain layout), for counting."""
        return [self.weight] + ([] if self.bias is None else [self.bias])
