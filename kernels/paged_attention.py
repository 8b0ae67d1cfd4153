"""Triton paged attention: split-K decode (flash-decoding) and variable-length causal prefill.

Both read K/V straight out of the paged cache ``[num_blocks, block_size, Hkv, D]`` through the
block table, token by token, so nothing is gathered or materialised. Both are grouped-query
aware: one program owns one KV head and all ``G = Hq // Hkv`` query heads that share it, so
each K/V tile is loaded once and multiplied against G query rows with ``tl.dot``. Softmax is
online (FlashAttention) in fp32 with exp2; fp16/bf16 operands feed the tensor cores, fp32
operands use exact ("ieee") dot products.

Decode splits each sequence's context into partitions of ``partition_size`` tokens handled
by separate programs (more parallelism at small batch / long context); every partition emits
its unnormalised output, running max and sum, and a second tiny kernel merges them with the
usual rescaling ``exp(m_i - max_j m_j)``, which never overflows. The number of partitions
comes from the block-table width, never from the context lengths' values, so a launch needs no
device-to-host synchronisation (CUDA-graph friendly); partitions past a sequence's end exit at once.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from apiary.kernels.triton_support import device_guard, dot_needs_fp32, next_pow2

LOG2E = 1.4426950408889634
DECODE_BLOCK_N = 64  # tokens per K/V tile
DECODE_PARTITION = 512  # tokens per split-K partition
PREFILL_BLOCK_M = 64  # query rows (queries x grouped heads) per program
PREFILL_BLOCK_N = 64


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                   scale_log2, window, partition_size, num_splits,
                   stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
                   stride_kblock, stride_ktok, stride_khead,
                   BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                   USE_WINDOW: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                   DOT_F32: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP

    ctx = tl.load(context_lens_ptr + seq)
    start = split * partition_size
    end = tl.minimum(start + partition_size, ctx)
    if USE_WINDOW:
        start = tl.maximum(start, ctx - window)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM

    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt

    for tile in range(start, end, BLOCK_N):
        tok = tile + offs_n
        valid = tok < end
        block = tl.load(table + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row = block * stride_kblock + (tok % BLOCK_SIZE) * stride_ktok + kv_head * stride_khead
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds at least one valid token
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if SPLIT:
        part = (seq * num_q_heads + heads) * num_splits + split  # [GROUP_PAD]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=g_mask[:, None] & d_mask[None, :])
        tl.store(part_ml_ptr + part * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_mask)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty sequence yields zeros
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_merge_kernel(part_acc_ptr, part_ml_ptr, out_ptr, num_splits, stride_ob, stride_oh,
                         HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < num_splits
    part = (seq * tl.num_programs(1) + head) * num_splits + offs_s
    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty partitions weigh 0
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    num = tl.sum(acc * weight[:, None], 0)
    den = tl.sum(l * weight, 0)
    out = num / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, cu_seqlens_ptr, context_lens_ptr,
                    tile_seq_ptr, tile_first_ptr, scale_log2, window,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    stride_kblock, stride_ktok, stride_khead,
                    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                    BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                    USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile_id)
    q_first = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_first
    q0 = (tile_id - tl.load(tile_first_ptr + seq)) * BLOCK_Q
    if q0 >= q_len:  # an idle program: the grid is sized from shapes, not from lengths
        return
    ctx = tl.load(context_lens_ptr + seq)
    offset = ctx - q_len  # position of this sequence's first query

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    qi = q0 + rows // GROUP_PAD  # row = (query, grouped head)
    g = rows % GROUP_PAD
    row_valid = (qi < q_len) & (g < GROUP)
    pos = offset + qi
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM

    tok_idx = (q_first + qi).to(tl.int64)
    head = kv_head * GROUP + g
    q = tl.load(q_ptr + tok_idx[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    hi = offset + tl.minimum(q0 + BLOCK_Q, q_len)  # one past the last key any row here may see
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(offset + q0 - window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt

    for tile in range(lo, hi, BLOCK_N):
        tok = tile + offs_n
        valid = tok < hi
        block = tl.load(table + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row = block * stride_kblock + (tok % BLOCK_SIZE) * stride_ktok + kv_head * stride_khead
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        visible = row_valid[:, None] & valid[None, :] & (tok[None, :] <= pos[:, None])
        if USE_WINDOW:
            visible = visible & (tok[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok_idx[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not silently drop to TF32 on the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _int32(t: torch.Tensor) -> torch.Tensor:
    """Index tensors as the agreed int32 with a unit last stride (a no-op for well-formed input)."""
    t = t if t.dtype == torch.int32 else t.to(torch.int32)
    return _last_dim_contiguous(t)


def decode_num_splits(max_blocks_per_seq: int, block_size: int, partition_size: int = DECODE_PARTITION) -> int:
    """Partitions per sequence, from the block-table width (an upper bound on any context length)."""
    return max(1, math.ceil(max_blocks_per_seq * block_size / partition_size))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                           partition_size: int = DECODE_PARTITION) -> torch.Tensor:
    """See ``apiary.kernels.ops.paged_decode_attention``; ``partition_size`` sets the split-K granularity."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    q = _last_dim_contiguous(q)
    block_tables, context_lens = _int32(block_tables), _int32(context_lens)
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    num_splits = decode_num_splits(block_tables.shape[1], block_size, partition_size)
    split = num_splits > 1
    if split:
        part_acc = torch.empty(batch * num_heads * num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(batch * num_heads * num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    d_pad = max(16, next_pow2(head_dim))
    with device_guard(q):
        _decode_kernel[(batch, num_kv_heads, num_splits)](
            q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_ml,
            scale * LOG2E, sliding_window or 0, partition_size, num_splits,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(16, next_pow2(group)),
            HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_N=DECODE_BLOCK_N,
            USE_WINDOW=sliding_window is not None, SPLIT=split, PRECISION=_precision(q.dtype),
            DOT_F32=dot_needs_fp32(q.dtype), num_warps=4)
        if split:
            _decode_merge_kernel[(batch, num_heads)](
                part_acc, part_ml, out, num_splits, out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, D_PAD=d_pad, SPLITS_PAD=next_pow2(num_splits), num_warps=4)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            sliding_window: int | None = None) -> torch.Tensor:
    """See ``apiary.kernels.ops.paged_prefill_attention``.

    Programs are laid out as ``T // BLOCK_Q + B`` query tiles (an upper bound computed from shapes);
    tile ``i`` belongs to the last sequence whose first tile ``cu[b] // BLOCK_Q + b`` is <= i, found
    with one ``searchsorted`` on the device.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    block_q = max(1, PREFILL_BLOCK_M // group_pad)
    q = _last_dim_contiguous(q)
    block_tables, cu_seqlens_q, context_lens = _int32(block_tables), _int32(cu_seqlens_q), _int32(context_lens)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or batch == 0:
        return out.zero_()
    cu = cu_seqlens_q.to(torch.int64)
    tile_first = cu[:-1] // block_q + torch.arange(batch, device=q.device)
    num_tiles = num_tokens // block_q + batch
    tile_seq = torch.searchsorted(tile_first, torch.arange(num_tiles, device=q.device), right=True) - 1
    with device_guard(q):
        _prefill_kernel[(num_tiles, num_kv_heads)](
            q, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens,
            tile_seq.to(torch.int32), tile_first.to(torch.int32), scale * LOG2E, sliding_window or 0,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q,
            HEAD_DIM=head_dim, D_PAD=max(16, next_pow2(head_dim)), BLOCK_N=PREFILL_BLOCK_N,
            USE_WINDOW=sliding_window is not None, PRECISION=_precision(q.dtype),
            DOT_F32=dot_needs_fp32(q.dtype), num_warps=4)
    return out
