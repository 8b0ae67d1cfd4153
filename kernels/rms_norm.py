"""Triton RMSNorm, optionally fused with the residual add that precedes it in every block.

One program per row: it loads the row once, (adds the residual and stores the new residual
stream rounded to the activation dtype, as an unfused model would), then normalises in fp32.
Fusing saves a full read and write of the activations per layer versus add-then-norm.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from apiary.kernels.triton_support import device_guard, next_pow2


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (xf * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """See ``apiary.kernels.ops.rms_norm``."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
        residual_out = torch.empty_like(out)
    else:
        r2 = residual_out = out  # unused
    weight = weight if weight.stride(0) == 1 else weight.contiguous()
    block_h = next_pow2(hidden)
    with device_guard(x):
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, residual_out, eps,
            x2.stride(0), r2.stride(0), out.stride(0), residual_out.stride(0),
            HIDDEN=hidden, BLOCK_H=block_h, HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block_h // 256)))
    if residual is not None:
        return out.view(x.shape), residual_out.view(x.shape)
    return out.view(x.shape)
