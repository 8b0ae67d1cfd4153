"""Random paged-attention cases and a naive dense float64 oracle shared by the kernel tests."""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PagedCase:
    """A batch of sequences whose K/V sit in shuffled cache blocks, plus their queries."""

    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, M], padded with -1
    context_lens: torch.Tensor  # int32 [B]
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    scale: float


def make_case(context_lens: list[int], q_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int = 16, dtype: torch.dtype = torch.float32, device: str = "cpu",
              seed: int = 0, pad_value: int = -1, extra_blocks: int = 3) -> PagedCase:
    """Blocks are handed out in random order and unused slots hold garbage, so masking is exercised."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [max(1, math.ceil(c / block_size)) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(blocks_per_seq) + 2  # wider than needed: the padding must be ignored
    tables = torch.full((len(context_lens), max_blocks), pad_value, dtype=torch.int32)
    at = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = perm[at:at + n].to(torch.int32)
        at += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    return PagedCase(q.to(device), k_cache.to(device), v_cache.to(device), tables.to(device),
                     torch.tensor(context_lens, dtype=torch.int32, device=device), cu.to(device),
                     1.0 / math.sqrt(head_dim))


def dense_attention(case: PagedCase, sliding_window: int | None = None) -> torch.Tensor:
    """The obvious float64 loop: per sequence, rebuild contiguous K/V and softmax each query's scores."""
    q = case.q.double().cpu()
    k_cache, v_cache = case.k_cache.double().cpu(), case.v_cache.double().cpu()
    tables, ctx, cu = case.block_tables.cpu(), case.context_lens.cpu().tolist(), case.cu_seqlens_q.cpu().tolist()
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    for b, c in enumerate(ctx):
        slots = [int(tables[b, j // block_size]) * block_size + j % block_size for j in range(c)]
        k = k_cache.view(-1, num_kv_heads, k_cache.shape[-1])[slots]  # [c, Hkv, D]
        v = v_cache.view(-1, num_kv_heads, v_cache.shape[-1])[slots]
        q_len = cu[b + 1] - cu[b]
        for i in range(q_len):
            pos = c - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(q.shape[1]):
                kv = h // group
                scores = (k[lo:pos + 1, kv] @ q[cu[b] + i, h]) * case.scale
                out[cu[b] + i, h] = torch.softmax(scores, 0) @ v[lo:pos + 1, kv]
    return out


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Comparison tolerances: fp32 is tight, half types are limited by their 8/11-bit mantissas."""
    return {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}[dtype]


@dataclass(slots=True)
class Int8Case:
    """``case``'s caches written through ``ops.write_kv`` into int8 caches with their scales; ``dequantized`` is
    the same case with the float rows the int8 ones stand for (the oracle's input)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    dequantized: PagedCase


def quantize_case(case: PagedCase) -> Int8Case:
    from dataclasses import replace

    from apiary.kernels import ops

    num_blocks, block_size, heads, dim = case.k_cache.shape
    k, v = (torch.zeros(case.k_cache.shape, dtype=torch.int8) for _ in range(2))
    ks, vs = (torch.zeros(case.k_cache.shape[:3]) for _ in range(2))
    ops.write_kv(case.k_cache.view(-1, heads, dim), case.v_cache.view(-1, heads, dim), k, v,
                 torch.arange(num_blocks * block_size), ks, vs)
    deq = replace(case, k_cache=(k.float() * ks[..., None]).to(case.q.dtype),
                  v_cache=(v.float() * vs[..., None]).to(case.q.dtype))
    return Int8Case(k, v, ks, vs, deq)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's thread count set to ``n`` (at most numba's pool) for a block: the CPU kernels follow torch's count."""
    import numba

    before = torch.get_num_threads()
    torch.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    try:
        yield
    finally:
        torch.set_num_threads(before)



def micro_tiles(rows_next: Callable[[int, int], int], most: int, rows: int) -> list[int]:
    """The micro-tile sizes a GEMM's ``rows_next`` (its ``py_func``) splits ``rows`` into, at most ``most`` each."""
    sizes: list[int] = []
    while rows:
        sizes.append(rows_next(rows, most))
        rows -= sizes[-1]
    return sizes
