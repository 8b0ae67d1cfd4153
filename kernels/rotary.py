"""Triton rotary embedding (rotate-half / neox layout) for q and k in one launch.

One program per token reads that token's cos/sin row once and rotates every query and key head:
``x1' = x1 cos - x2 sin``, ``x2' = x2 cos + x1 sin`` with ``x1, x2`` the two halves of a head, in fp32.
Outputs are new tensors; q and k may be strided views (e.g. slices of a fused QKV projection).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from apiary.kernels.triton_support import device_guard, next_pow2


@triton.jit
def _rotate_heads(x_ptr, out_ptr, token, cos, sin, stride_xt, stride_xh, stride_ot, stride_oh,
                  NUM_HEADS: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HALF)[None, :]
    src = x_ptr + token * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cos_sin_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                   stride_cs, NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, QH_PAD: tl.constexpr,
                   KH_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, q_out_ptr, token, cos, sin, stride_qt, stride_qh, stride_qot, stride_qoh,
                  NUM_Q_HEADS, QH_PAD, HALF, HALF_PAD)
    _rotate_heads(k_ptr, k_out_ptr, token, cos, sin, stride_kt, stride_kh, stride_kot, stride_koh,
                  NUM_K_HEADS, KH_PAD, HALF, HALF_PAD)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``apiary.kernels.ops.apply_rotary``."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos_sin_cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                                                                                  device=k.device)
    half = q.shape[2] // 2
    with device_guard(q):
        _rotary_kernel[(q.shape[0],)](
            q, k, q_out, k_out, positions, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
            k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
            NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1], QH_PAD=next_pow2(q.shape[1]),
            KH_PAD=next_pow2(k.shape[1]), HALF=half, HALF_PAD=next_pow2(half), num_warps=4)
    return q_out, k_out
