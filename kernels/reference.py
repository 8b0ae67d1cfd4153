"""Plain-torch references for every kernel: the correctness oracle and the CPU production path.

Everything is vectorised (no Python loop over tokens). Attention gathers the paged K/V of
each sequence into a padded tensor; decode attention (one query per sequence) then runs as two
batched matmuls, prefill attention through ``F.scaled_dot_product_attention``: with a boolean
mask, or ``is_causal`` for chunks with nothing cached before them. Grouped-query
attention folds the query heads that share a KV head into the query axis (or, for the
``is_causal`` call, uses SDPA's ``enable_gqa``), so K/V are never repeated.
Inputs may be fp32/fp16/bf16; SDPA accumulates in fp32 internally and the elementwise ops
compute in fp32.

Conventions (shared with the Triton kernels and the engine):
- caches are ``[num_blocks, block_size, num_kv_heads, head_dim]``; slot = block * block_size + offset;
- query head ``h`` reads KV head ``h // (Hq // Hkv)``;
- a query at position ``p`` sees key positions ``j <= p`` and, with ``sliding_window=w``,
  only ``j > p - w`` (the ``w`` most recent tokens, itself included);
- a sequence with ``context_len == 0`` (a padding row) yields zeros;
- an int8 cache comes with float32 scales ``[num_blocks, block_size, num_kv_heads]``, one per token
  and KV head (symmetric: ``row ~= q * scale``, ``write_kv_int8``); attention dequantizes the rows it
  gathers to the query's dtype.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# A fused int8 gather (``apiary.kernels.cpu_quant.gather_dequantize``): (cache, scale, row index, out) -> None
Dequantize = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True, slots=True)
class Int8Scales:
    """An int8 cache's K and V scales, and the fused gather that dequantizes its rows (None: torch ops)."""

    k: torch.Tensor
    v: torch.Tensor
    dequantize: Dequantize | None = None


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter ``key``/``value`` ``[T, Hkv, D]`` into their cache slots; slots < 0 are skipped."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value[keep].to(v_cache.dtype))


def write_kv_int8(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  k_scale: torch.Tensor, v_scale: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``write_kv`` into int8 caches: each token's row per KV head quantized on its own (``quantize_rows``),
    its scale stored beside it. Per token and head, so a block never needs requantizing as it fills."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for x, cache, scales in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        q, s = quantize_rows(x[keep].reshape(-1, head_dim))
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, q.view(-1, num_kv_heads, head_dim))
        scales.view(-1, num_kv_heads).index_copy_(0, slots, s.view(-1, num_kv_heads))


def _gather_rows(block_tables: torch.Tensor, num_blocks: int, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """Row indices ``[B, Hkv, num_blocks * block_size]`` into a cache viewed as ``[slots * Hkv, D]``."""
    table = block_tables[:, :num_blocks].long().clamp(min=0)  # -1 padding is masked out later
    offsets = torch.arange(block_size, device=block_tables.device)
    slots = (table[:, :, None] * block_size + offsets).flatten(1)  # [B, L]
    heads = torch.arange(num_kv_heads, device=block_tables.device)
    return slots[:, None, :] * num_kv_heads + heads[None, :, None]


_workspace = threading.local()  # per-thread gather buffers (CPU only) and decode plans


def _workspace_kv(dtype: torch.dtype, n: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two ``[n, head_dim]`` views of this thread's reused gather buffer for ``dtype`` (see ``_gather_kv``)."""
    buffers = getattr(_workspace, "buffers", None)
    if buffers is None:
        buffers = _workspace.buffers = {}
    # inference-mode tensors cannot be written outside inference mode (and vice versa): one buffer each
    key = (dtype, torch.is_inference_mode_enabled())
    buf = buffers.get(key)
    if buf is None or buf.numel() < 2 * n * head_dim:
        buf = buffers[key] = torch.empty(2 * n * head_dim, dtype=dtype)
    return buf[:n * head_dim].view(n, head_dim), buf[n * head_dim:2 * n * head_dim].view(n, head_dim)


def _gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
               scales: Int8Scales | None = None, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of each sequence as padded tensors ``[B, Hkv, L, D]``.

    With ``scales`` (int8 caches) the gathered rows are dequantized to ``dtype``: by torch ops, or by
    the fused gather the scales name (``Int8Scales.dequantize``, CPU) straight into the buffer below. Float rows
    of another dtype (bf16 under float32 queries) are widened to ``dtype``.

    One ``index_select`` of head rows straight into SDPA's head-major layout: a single copy, and
    no strided K/V for SDPA to trip over (both measured faster on CPU than gather-then-transpose).
    On CPU the copies land in a reused per-thread buffer: freshly allocated tens of MB are returned
    to the OS by glibc and page-faulted back in on every call, which measured 3-4x slower than the
    copy itself on this machine. The views are only valid until this thread's next gather.
    """
    head_dim = k_cache.shape[-1]
    index = rows.flatten()
    n = index.numel()
    if scales is not None and scales.dequantize is not None and k_cache.device.type == "cpu":
        k, v = _workspace_kv(dtype, n, head_dim)
        scales.dequantize(k_cache, scales.k, index, k)
        scales.dequantize(v_cache, scales.v, index, v)
    elif scales is not None:
        k, v = (torch.mul(c.view(-1, head_dim).index_select(0, index), s.view(-1, 1).index_select(0, index)).to(dtype)
                for c, s in ((k_cache, scales.k), (v_cache, scales.v)))
    elif k_cache.device.type != "cpu":
        k = k_cache.view(-1, head_dim).index_select(0, index)
        v = v_cache.view(-1, head_dim).index_select(0, index)
    else:
        k, v = _workspace_kv(k_cache.dtype, n, head_dim)
        torch.index_select(k_cache.view(-1, head_dim), 0, index, out=k)
        torch.index_select(v_cache.view(-1, head_dim), 0, index, out=v)
    if scales is None and dtype is not None and k.dtype != dtype:  # bf16 rows under float32 queries: widened, exact
        k, v = k.to(dtype), v.to(dtype)
    return k.view(*rows.shape, head_dim), v.view(*rows.shape, head_dim)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
            may_be_empty: bool) -> torch.Tensor:
    """SDPA with GQA folded into the query axis.

    q ``[B, Q, Hq, D]``, k/v ``[B, Hkv, L, D]``, allowed ``[B, Q, L]`` -> ``[B, Q, Hq, D]``.
    ``may_be_empty``: some rows may see no key at all (they come out as zeros instead of NaN).
    """
    b, nq, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    # [B, Q, Hkv, G, D] -> [B, Hkv, G*Q, D]: the G heads that share a KV head become extra query rows.
    qg = q.view(b, nq, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, group * nq, d)
    if nq == 1:
        mask = allowed[:, None]  # [B, 1, 1, L], broadcast over heads and rows
    else:
        mask = allowed[:, None, None].expand(b, 1, group, nq, allowed.shape[-1]).reshape(b, 1, group * nq, -1)
    empty = None
    if may_be_empty:  # let such rows see key 0, then zero them
        empty = ~mask.any(-1, keepdim=True)
        mask = mask | (empty & (torch.arange(mask.shape[-1], device=mask.device) == 0))
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    if empty is not None:
        out = out.masked_fill(empty, 0.0)
    return out.view(b, hkv, group, nq, d).permute(0, 3, 1, 2, 4).reshape(b, nq, hq, d)


def _allowed(q_pos: torch.Tensor, context_lens: torch.Tensor, key_len: int, sliding_window: int | None) -> torch.Tensor:
    """Boolean ``[B, Q, L]``: key j is visible to a query at q_pos if j <= q_pos, j < ctx, inside the window."""
    j = torch.arange(key_len, device=q_pos.device)
    allowed = (j <= q_pos[..., None]) & (j < context_lens[:, None, None])
    if sliding_window is not None:
        allowed &= j > q_pos[..., None] - sliding_window
    return allowed


def _decode_plan(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, num_kv_heads: int,
                 sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Gather rows, visibility mask and "some sequence has no keys" for one decode call.

    They depend only on the block tables and lengths, which are the same for every layer of a
    step: the last few plans are kept with a copy of their inputs and reused when the inputs are
    equal (compared by value: cheap next to rebuilding, and blind to tensor identity, reuse of
    freed memory or in-place edits). Building them once per step instead of once per layer saves
    ~60 us per call on CPU, ~7 ms per 64-sequence step.
    """
    plans = getattr(_workspace, "plans", None)
    if plans is None:
        plans = _workspace.plans = []
    params = (block_size, num_kv_heads, sliding_window, block_tables.device)
    for seen_params, seen_tables, seen_lens, plan in plans:
        if (seen_params == params and seen_tables.shape == block_tables.shape and seen_lens.shape == context_lens.shape
                and torch.equal(seen_lens, context_lens) and torch.equal(seen_tables, block_tables)):
            return plan
    ctx = context_lens.long()
    shortest, longest = torch.stack(torch.aminmax(ctx)).tolist()  # one host sync for both
    rows = _gather_rows(block_tables, max(1, -(-longest // block_size)), block_size, num_kv_heads)
    j = torch.arange(rows.shape[-1], device=ctx.device)
    allowed = j < ctx[:, None]  # the query is the newest token: it sees every cached one
    if sliding_window is not None:
        allowed &= j >= ctx[:, None] - sliding_window
    plan = rows, allowed, shortest < 1
    plans.insert(0, (params, block_tables.clone(), context_lens.clone(), plan))
    del plans[8:]
    return plan


def _scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
            dequantize: Dequantize | None) -> Int8Scales | None:
    return None if k_scale is None or v_scale is None else Int8Scales(k_scale, v_scale, dequantize)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence ``q[B, Hq, D]`` over its ``context_lens[b]`` cached tokens -> ``[B, Hq, D]``."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    _, block_size, num_kv_heads, _ = k_cache.shape
    rows, allowed, may_be_empty = _decode_plan(block_tables, context_lens, block_size, num_kv_heads, sliding_window)
    k, v = _gather_kv(k_cache, v_cache, rows, _scales(k_scale, v_scale, None), q.dtype)
    return _attend_one(q, k, v, allowed, scale, may_be_empty)


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
                may_be_empty: bool) -> torch.Tensor:
    """Single-query attention as two batched matmuls: q ``[B, Hq, D]``, k/v ``[B, Hkv, L, D]``, allowed ``[B, L]``.

    Why not SDPA: with one query per sequence its CPU kernel works on G (= Hq / Hkv) query rows
    at a time and measured 2x slower than these two matmuls (which see [G, D] x [D, L] per KV
    head). Scores come out of the matmul in the input dtype (bf16 rounding, within what the
    bf16 output keeps), softmax runs in fp32, probabilities go back to the input dtype for P.V.
    """
    b, hq, d = q.shape
    hkv = k.shape[1]
    scores = torch.matmul(q.view(b, hkv, hq // hkv, d), k.transpose(-1, -2)).float()  # [B, Hkv, G, L]
    scores.mul_(scale).masked_fill_(~allowed[:, None, None], float("-inf"))
    probs = scores.softmax(dim=-1)
    if may_be_empty:  # a sequence without keys: softmax of all -inf is NaN; such rows yield zeros
        probs = probs.nan_to_num_(0.0)
    return torch.matmul(probs.to(v.dtype), v).view(b, hq, d)


def _prefill_group(q: torch.Tensor, out: torch.Tensor, seqs: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, block_tables: torch.Tensor, starts: torch.Tensor, q_lens: torch.Tensor,
                   context_lens: torch.Tensor, scale: float, sliding_window: int | None,
                   scales: Int8Scales | None) -> None:
    """Attention for the sequences ``seqs``, padded together to their longest query; writes into ``out``."""
    lens = q_lens[seqs]
    ctx = context_lens[seqs]
    max_q = int(lens.max())
    block_size = k_cache.shape[1]
    num_blocks = max(1, -(-int(ctx.max()) // block_size))
    i = torch.arange(max_q, device=q.device)
    valid = i < lens[:, None]  # [G, max_q]
    rows = (starts[seqs][:, None] + i).masked_fill(~valid, 0)
    q_pad = q[rows]  # [G, max_q, Hq, D]; padded rows read token 0 and are dropped below
    rows_kv = _gather_rows(block_tables[seqs], num_blocks, block_size, k_cache.shape[2])
    k, v = _gather_kv(k_cache, v_cache, rows_kv, scales, q.dtype)
    if sliding_window is None and bool((ctx == lens).all()):
        res = _attend_fresh(q_pad, k[:, :, :max_q], v[:, :, :max_q], scale)
    else:
        q_pos = ctx[:, None] - lens[:, None] + i
        allowed = _allowed(q_pos, ctx, k.shape[2], sliding_window) & valid[..., None]
        res = _attend(q_pad, k, v, allowed, scale, may_be_empty=True)  # padding rows see nothing
    out[rows[valid]] = res[valid]


def _attend_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Chunks starting at position 0 (nothing cached before them): plain causal attention.

    q ``[B, Q, Hq, D]``, k/v ``[B, Hkv, Q, D]`` -> ``[B, Q, Hq, D]``.

    Query i sits at position i, so SDPA's top-left ``is_causal`` is exactly the mask: no mask tensor
    is built and the flash kernel skips the masked half (measured ~25% faster than the masked call
    on 1,024-token prompt chunks). A padded query row sees padded keys, but its output is dropped;
    real rows only see keys of real tokens.
    """
    return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, scale=scale,
                                          enable_gqa=True).transpose(1, 2)


SOLO_QUERIES = 128  # prefill chunks at least this long get an attention call of their own (no padding)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, dequantize: Dequantize | None = None) -> torch.Tensor:
    """Variable-length causal attention of new tokens ``q[T, Hq, D]`` over their cached prefix -> ``[T, Hq, D]``.

    int8 caches come with ``k_scale``/``v_scale``; ``dequantize`` is a fused gather for their rows (CPU).

    Query i of sequence b sits at position ``context_lens[b] - q_len_b + i``. Sequences are grouped by
    query length in power-of-two buckets, so a mixed batch (one long prefill chunk beside many
    single-token decodes) pads each group at most 2x instead of padding everything to the longest.
    A chunk of ``SOLO_QUERIES`` or more queries runs alone: padded to a neighbour's length its causal
    attention costs up to 4x its own (a 335-token prompt beside a 512-token one: 2.3x), while one more
    call costs ~30 us against its >= 0.4 ms of work (docs/kernels.md).
    """
    out = torch.zeros_like(q)
    if q.shape[0] == 0:
        return out
    cu = cu_seqlens_q.long()
    starts, q_lens = cu[:-1], cu[1:] - cu[:-1]
    ctx = context_lens.long()
    live = q_lens > 0
    # Chunks that start at position 0 (nothing cached before them) group apart from chunks that
    # continue a prefix: a group of the former takes the cheaper is_causal path.
    continues = (ctx > q_lens).long()
    bucket = torch.where(live, 2 * torch.ceil(torch.log2(q_lens.clamp(min=1).double())).long() + continues, -1)
    solo = live & (q_lens >= SOLO_QUERIES)
    bucket[solo] = -2 - torch.arange(int(solo.sum()), device=bucket.device)  # a group of its own each
    for b in torch.unique(bucket[live]).tolist():  # live buckets are >= 0, solo ones <= -2
        seqs = torch.nonzero(bucket == b).flatten()
        _prefill_group(q, out, seqs, k_cache, v_cache, block_tables, starts, q_lens, ctx, scale, sliding_window,
                       _scales(k_scale, v_scale, dequantize))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last axis, optionally fused with the residual add.

    With ``residual``: ``s = x + residual`` (rounded to x's dtype, as an unfused model would store it),
    returns ``(rmsnorm(s), s)``.
    """
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    out = out.to(x.dtype)
    return (out, x) if residual is not None else out


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (neox) RoPE of ``q[T, Hq, D]`` and ``k[T, Hkv, D]``; returns new tensors."""
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def rotary_cos_sin_cache(max_positions: int, head_dim: int, base: float = 10000.0,
                         dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The ``[max_positions, head_dim]`` table ``apply_rotary`` expects: first half cos, second half sin."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.float64, device=device)[:, None] * inv_freq
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of ``x [M, K]``: ``(q int8, scale [M, 1] float32)`` with
    ``q = round(x / scale)``, ``scale = max(|x|, 1e-8) / 127`` per row (round half to even)."""
    scale = torch.linalg.vector_norm(x.float(), float("inf"), dim=-1, keepdim=True).clamp_(min=1e-8).div_(127.0)
    return torch.div(x, scale).round_().to(torch.int8), scale
