"""Per-row (per-token) symmetric int8 quantization for CPUs, compiled with numba: one pass per row.

Why: the engine's W8A8 projections (``apiary.cloud.engine.int8``) quantize every activation row
before each int8 GEMM. In torch that is five ops (absmax, clamp, divide, round, cast), each a
pass over the tensor with its own allocation; on the 2-core dev machine, one thread, it took
132 us for 64 x 576 and 436 us for 64 x 1,536, more than the int8 GEMM it feeds. Here each row
is read twice (max, then quantize) inside one call: 63 us and 149 us.

Results are those of the torch expression ``round(x / (max(|x|, 1e-8) / 127))`` (round half to
even, the division in float32, not a reciprocal multiply), so either path gives the same int8.
float32 and bfloat16 rows are supported (bf16 bits are widened in registers, as in
``apiary.kernels.cpu_attention``, which owns that conversion).
"""
from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, prange

from apiary.kernels.cpu_attention import _as_f32
from apiary.kernels.errors import KernelError

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
MIN_ABSMAX = 1e-8  # rows of zeros get this absmax: scale > 0, all-zero int8


@njit(parallel=True, fastmath={"nnan", "ninf", "nsz", "reassoc"}, cache=True, boundscheck=False, nogil=True)
def _quantize_rows(x, q, scale, min_absmax):  # type: ignore[no-untyped-def]
    rows, cols = x.shape
    for i in prange(rows):
        top = np.float32(0.0)
        for j in range(cols):
            top = max(top, abs(_as_f32(x[i, j])))
        s = max(top, min_absmax) / np.float32(127.0)
        for j in range(cols):
            q[i, j] = np.int8(np.round(_as_f32(x[i, j]) / s))
        scale[i, 0] = s


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (CPU, float32 or bfloat16) -> ``(q [M, K] int8, scale [M, 1] float32)``, ``x ~= q * scale``."""
    if x.device.type != "cpu" or x.dtype not in SUPPORTED_DTYPES or x.dim() != 2:
        raise KernelError(f"cpu_quant.quantize_rows takes 2-D CPU {SUPPORTED_DTYPES} tensors, "
                          f"got {tuple(x.shape)} {x.dtype} on {x.device}")
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=torch.int8)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32)
    if x.shape[0]:
        numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
        bits = (x.view(torch.int16) if x.dtype == torch.bfloat16 else x).numpy()
        _quantize_rows(bits, q.numpy(), scale.numpy(), np.float32(MIN_ABSMAX))
    return q, scale
