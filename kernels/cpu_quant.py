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

``write_kv_int8`` is the same quantization fused with the KV-cache scatter (int8 KV caches,
``EngineConfig(kv_cache_dtype="int8")``): each new token's row per KV head goes straight into its
cache slot with its scale, no temporaries (the torch path copies, quantizes, then scatters: 350 us
against 136 us for a float32 write, per layer of a 60-token decode step).

``gather_dequantize`` is the way back for prefill attention (the torch reference, which ``kernels.ops``
hands it on CPU): int8 rows gathered and scaled straight into the caller's float32 or bf16 buffer. The
torch ops (two index_selects, a multiply, a cast, each allocating) took 2.5-3.0 ms for K and V of 16
sequences x 400 tokens x 3 KV heads on a 2-CPU Zen 4 guest; this takes 0.3-0.5 ms, with identical
values (one float32 product, then round-to-nearest-even to bf16, as torch's cast rounds).
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


@njit(inline="always", fastmath={"nnan", "ninf", "nsz", "reassoc"}, boundscheck=False)
def _quantize_row(x, q, min_absmax):  # type: ignore[no-untyped-def]
    """One row ``x`` into ``q``; returns its scale."""
    top = np.float32(0.0)
    for j in range(x.shape[0]):
        top = max(top, abs(_as_f32(x[j])))
    s = max(top, min_absmax) / np.float32(127.0)
    for j in range(x.shape[0]):
        q[j] = np.int8(np.round(_as_f32(x[j]) / s))
    return s


@njit(parallel=True, fastmath={"nnan", "ninf", "nsz", "reassoc"}, cache=True, boundscheck=False, nogil=True)
def _quantize_rows(x, q, scale, min_absmax):  # type: ignore[no-untyped-def]
    for i in prange(x.shape[0]):
        scale[i, 0] = _quantize_row(x[i], q[i], min_absmax)


@njit(inline="always", fastmath={"nnan", "ninf", "nsz", "reassoc"}, boundscheck=False)
def _write_row_int8(key, value, k_cache, v_cache, k_scale, v_scale, slots, t, min_absmax):  # type: ignore[no-untyped-def]
    """Row ``t`` of ``_write_kv_int8`` (a decode step's run of layers calls it for its few rows, serially)."""
    slot = slots[t]
    if slot >= 0:
        for h in range(key.shape[1]):
            k_scale[slot, h] = _quantize_row(key[t, h], k_cache[slot, h], min_absmax)
            v_scale[slot, h] = _quantize_row(value[t, h], v_cache[slot, h], min_absmax)


@njit(parallel=True, fastmath={"nnan", "ninf", "nsz", "reassoc"}, cache=True, boundscheck=False, nogil=True)
def _write_kv_int8(key, value, k_cache, v_cache, k_scale, v_scale, slots, min_absmax):  # type: ignore[no-untyped-def]
    """key/value ``[T, Hkv, D]``; caches ``[slots, Hkv, D]`` int8, scales ``[slots, Hkv]``; slots < 0 skipped."""
    for t in prange(key.shape[0]):
        _write_row_int8(key, value, k_cache, v_cache, k_scale, v_scale, slots, t, min_absmax)


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def _gather_dequantize_f32(cache, scale, index, out):  # type: ignore[no-untyped-def]
    for i in prange(index.shape[0]):
        r = index[i]
        s = scale[r]
        for j in range(cache.shape[1]):
            out[i, j] = np.float32(cache[r, j]) * s


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def _gather_dequantize_bf16(cache, scale, index, out):  # type: ignore[no-untyped-def]
    """``out`` holds bf16 bits (uint16): each float32 product rounded to nearest even, as torch casts."""
    for i in prange(index.shape[0]):
        r = index[i]
        s = scale[r]
        row = np.empty(cache.shape[1], np.float32)
        for j in range(cache.shape[1]):
            row[j] = np.float32(cache[r, j]) * s
        bits = row.view(np.uint32)
        for j in range(cache.shape[1]):
            b = bits[j]
            out[i, j] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


def gather_dequantize(cache: torch.Tensor, scale: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = cache_rows[index[i]] * scale_rows[index[i]]``: ``cache`` int8 ``[..., D]`` viewed as rows of
    ``D``, ``scale`` float32 with one value per row, ``out [N, D]`` contiguous float32 or bfloat16 (CPU)."""
    dim = cache.shape[-1]
    if out.dtype not in SUPPORTED_DTYPES or out.shape != (index.numel(), dim) or not out.is_contiguous():
        raise KernelError(f"cpu_quant.gather_dequantize writes a contiguous [{index.numel()}, {dim}] float32 or "
                          f"bfloat16 tensor, got {tuple(out.shape)} {out.dtype}")
    if cache.dtype != torch.int8 or scale.dtype != torch.float32 or scale.numel() * dim != cache.numel():
        raise KernelError(f"cpu_quant.gather_dequantize takes an int8 cache with one float32 scale per row, got "
                          f"{cache.dtype} {tuple(cache.shape)} and {scale.dtype} {tuple(scale.shape)}")
    if index.numel() == 0:
        return
    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
    rows, scales = cache.reshape(-1, dim).numpy(), scale.reshape(-1).numpy()
    where = index.reshape(-1).to(torch.int64).numpy()
    if out.dtype == torch.float32:
        _gather_dequantize_f32(rows, scales, where, out.numpy())
    else:
        _gather_dequantize_bf16(rows, scales, where, out.view(torch.int16).numpy().view(np.uint16))


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


def _rows(x: torch.Tensor) -> np.ndarray:
    """A 3-D float32/bfloat16 tensor as numpy (bf16 as its int16 bits), rows made contiguous if they are not."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return (x.view(torch.int16) if x.dtype == torch.bfloat16 else x).numpy()


def write_kv_int8(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  k_scale: torch.Tensor, v_scale: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``apiary.kernels.reference.write_kv_int8``'s result in one pass (CPU, float32 or bfloat16 K/V)."""
    if key.device.type != "cpu" or key.dtype not in SUPPORTED_DTYPES or value.dtype != key.dtype:
        raise KernelError(f"cpu_quant.write_kv_int8 takes CPU {SUPPORTED_DTYPES} K/V, got {key.dtype} on {key.device}")
    heads, dim = k_cache.shape[2:]
    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
    _write_kv_int8(_rows(key), _rows(value), k_cache.view(-1, heads, dim).numpy(), v_cache.view(-1, heads, dim).numpy(),
                   k_scale.view(-1, heads).numpy(), v_scale.view(-1, heads).numpy(),
                   slot_mapping.to(torch.int64).contiguous().numpy(), np.float32(MIN_ABSMAX))


def write_rows_int8(key: np.ndarray, value: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray, k_scale: np.ndarray,
                    v_scale: np.ndarray, slots: np.ndarray) -> None:
    """``write_kv_int8`` on numpy views its caller checked (``cpu_layers.CpuStep``, which sets numba's threads):
    ``key``/``value`` ``[T, Hkv, D]`` (bf16 as int16 bits), caches ``[S, Hkv, D]`` int8, scales ``[S, Hkv]``."""
    _write_kv_int8(key, value, k_rows, v_rows, k_scale, v_scale, slots, np.float32(MIN_ABSMAX))
