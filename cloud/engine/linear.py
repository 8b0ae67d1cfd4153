"""A linear layer whose weight is prepacked for the CPU GEMM when that pays.

bf16 on a CPU where numba compiles ``vdpbf16ps`` (AVX-512 BF16): our own kernel
(``apiary.kernels.cpu_bf16_gemm`` through ``ops.bind_bf16_linear``), 1.6-1.9x oneDNN's at decode's 1-16
rows, 1.2x at 64 and level with it at prompt sizes; its float32 sums are rounded once as oneDNN's are, but in another
order, so ~0.02% of outputs are one bf16 ulp from ``F.linear``'s. Elsewhere, oneDNN with the weight packed:

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
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from apiary.kernels import cpu, ops

if TYPE_CHECKING:
    from apiary.kernels.cpu_bf16_gemm import Bound
    from apiary.kernels.cpu_bf16w_gemm import Bound as BoundBF16W


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
    """``y = x @ weight.T + bias``. Where our GEMM holds the weight (``kernel``), its packed copy is the only one:
    ``weight`` unpacks it on demand (fall-back calls, int8 conversion, tests). Why: keeping the plain bf16 weight
    beside the packed one held 212 MB of SmolLM2's 1.2 GB resident that no step reads."""

    plain: torch.Tensor | None  # the weight in plain layout; None where ``kernel`` holds it
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None  # oneDNN's layout
    kernel: Bound | BoundBF16W | None = None  # our GEMM bound to this weight (``ops.bind_bf16_linear``, ``bind_bf16w_linear``)
    takes: torch.dtype | None = None  # the rows ``kernel`` takes: the weight's dtype, or float32 for bf16 weights

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, flags: Iterable[str] | None = None) -> Linear:
        """``flags``: the CPU's features (default: this host's, ``apiary.kernels.cpu.host_flags``); the bf16 kernel
        needs native bf16 there as well as in what numba compiles for."""
        native = weight.dtype == torch.bfloat16 and cpu.native_bf16(cpu.host_flags() if flags is None else flags)
        kernel = ops.bind_bf16_linear(weight, bias) if native else None
        if kernel is not None:
            return cls(None, bias, None, kernel, weight.dtype)
        return cls(weight, bias, _pack(weight, bias, flags))

    @classmethod
    def bf16_weights(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear | None:
        """A float32 layer whose weight is held in bf16 and widened in registers (``ops.bind_bf16w_linear``): float32
        rows in, float32 products and sums, from half the bytes. None where that kernel does not run here."""
        kernel = ops.bind_bf16w_linear(weight, bias)
        if kernel is None:
            return None
        return cls(None, None if bias is None else bias.float(), None, kernel, torch.float32)

    @property
    def weight(self) -> torch.Tensor:
        """The weight ``[N, K]`` in plain layout: held, or unpacked from the kernel's copy (a new tensor each call)."""
        if self.plain is not None:
            return self.plain
        assert self.kernel is not None, "a Linear holds its weight plain or in its kernel"
        return self.kernel.weight.unpacked()

    @property
    def dtype(self) -> torch.dtype:
        """The weight's dtype (bf16 where the kernel holds it), without unpacking it."""
        return self.plain.dtype if self.plain is not None else torch.bfloat16

    @property
    def path(self) -> str:
        """Which GEMM 2-D inputs of the weight's dtype take (for the engine's load log)."""
        if self.kernel is not None and self.takes == torch.float32 and self.dtype == torch.bfloat16:
            return "bf16 weights, float32 sums (kernels/cpu_bf16w_gemm.py)"
        if self.kernel is not None:
            return "our bf16 kernel (vdpbf16ps, kernels/cpu_bf16_gemm.py)"
        return "oneDNN, weight prepacked" if self.packed is not None else "F.linear"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dim() == 2 and x.shape[0] and x.dtype == self.takes:
            return self.kernel(x)
        if x.dim() != 2 or x.shape[0] == 0 or x.dtype != self.dtype or self.plain is None:
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.weight.to(x.dtype), bias)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``self(silu(gate) * up)`` for ``gate_up = [gate | up]`` (a SwiGLU's two projections side by side): with
        the bf16 kernel, the elementwise part inside its call, rounded as the torch ops round (with bf16-held weights,
        in float32 inside that kernel's call); a run of layers
        in one call (``kernels/cpu_decode_layers.py``) calls the same kernel the same way."""
        if self.kernel is not None and gate_up.dim() == 2 and gate_up.shape[0] and gate_up.dtype == self.takes:
            return self.kernel(gate_up, True)
        gate, up = gate_up.chunk(2, dim=-1)
        return self(F.silu(gate) * up)

    def tensors(self) -> list[torch.Tensor]:
        """The parameters as held, for counting: the plain weight, or the kernel's packed one (padded to whole tiles)."""
        held = [self.plain] if self.plain is not None else [torch.from_numpy(self.kernel.weight.packed)]  # type: ignore[union-attr]
        return held + ([] if self.bias is None else [self.bias])
