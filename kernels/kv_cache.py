"""Triton KV-cache write: scatter each new token's K and V rows into its cache slot.

One program per token copies the token's ``[Hkv, D]`` key and value (any row strides, e.g. views
into a fused QKV projection) to ``slot = block * block_size + offset`` of the contiguous caches,
converting to the cache dtype. Tokens with a negative slot (padding) store nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from apiary.kernels.triton_support import device_guard, next_pow2


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :] & (slot >= 0)
    src = token.to(tl.int64)
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(key_ptr + src * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + src * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """See ``apiary.kernels.ops.write_kv``."""
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    num_tokens, num_kv_heads, head_dim = key.shape
    with device_guard(key):
        _write_kv_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, H_PAD=next_pow2(num_kv_heads), D_PAD=next_pow2(head_dim),
            num_warps=4)
