"""A CPU step's small per-layer ops, compiled with numba: RMSNorm (with its residual add), rotary, the KV write.

Why: in torch each of these is several ops (RMSNorm with the residual: add, two casts, square, mean,
rsqrt, two multiplies, a cast), each paying torch's dispatch and an allocation. On a 2-CPU Zen 4 guest
a 32-row bf16 decode step of SmolLM2 spent 8.4 ms in RMSNorm (61 calls, ~140 us each), 5.6 ms in rotary
and 4.1 ms in the KV write, 24% of a 76.6 ms step, for a few microseconds of arithmetic. Here each is one
call and one pass over its rows (the step: 65.1 ms; docs/kernels.md).

Results are the torch references' (``apiary.kernels.reference``) up to float32 summation order: sums
and products in float32, rounded to the tensor's dtype where the reference rounds (bf16: round to
nearest even, as torch's cast). float32 and bfloat16 tensors are served (bf16 as its int16 bits).
The kernels are serial: at decode sizes a parallel region's fork and join cost more than the work.
A ``CpuStep`` of ``PARALLEL_ROWS`` or more rows (a prompt chunk) takes the RMSNorm's and rotary's
row-parallel twins, each row the same loop and so the same numbers.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from apiary.kernels.cpu_attention import _as_f32
from apiary.kernels.errors import KernelError

if TYPE_CHECKING:
    from apiary.kernels.cpu_decode_layers import LayerStack

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# Rows from which a step's RMSNorm and rotary spread over numba's threads: a prompt chunk's hundreds of rows
# (a 380-row RMSNorm ~0.1 ms, rotary with the KV write ~0.36 ms serial); a decode step's few rows stay on one
# thread, where a parallel region's hand-off costs about what the work does.
PARALLEL_ROWS = 64
# Reassociation lets the sum of squares vectorize: a serial float32 sum over a 576-wide row is a chain of
# dependent adds (~1.3 ns per element measured, 24 us for 32 rows); torch's own sum is not serial either.
FASTMATH = {"nnan", "ninf", "nsz", "contract", "reassoc"}


@intrinsic
def _f32_as_bf16_bits(typingctx, value):  # type: ignore[no-untyped-def]
    """float32 -> the int16 bits of the nearest bfloat16 (ties to even; torch's cast for finite values)."""
    signature = types.int16(types.float32)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        i32 = ir.IntType(32)
        bits = builder.bitcast(args[0], i32)
        odd = builder.and_(builder.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 1))
        rounded = builder.add(builder.add(bits, ir.Constant(i32, 0x7FFF)), odd)
        return builder.trunc(builder.lshr(rounded, ir.Constant(i32, 16)), ir.IntType(16))

    return signature, codegen


def _store(out, value):  # type: ignore[no-untyped-def]  # pragma: no cover - replaced by the overload in compiled code
    raise NotImplementedError


@overload(_store)
def _store_impl(out, value):  # type: ignore[no-untyped-def]
    """A float32 value as ``out``'s element type (bf16 bits for int16 arrays)."""
    if out.dtype == types.int16:
        return lambda out, value: _f32_as_bf16_bits(value)
    return lambda out, value: np.float32(value)


@njit(inline="always", fastmath=FASTMATH, boundscheck=False)
def _norm_row(x, residual, has_residual, weight, eps, out, summed, t, row):  # type: ignore[no-untyped-def]
    """Row ``t`` of ``_rms_norm`` (``row``: n float32 of scratch)."""
    n = x.shape[1]
    squares = np.float32(0.0)
    for j in range(n):
        v = _as_f32(x[t, j])
        if has_residual:
            bits = _store(summed, v + _as_f32(residual[t, j]))
            summed[t, j] = bits
            v = _as_f32(bits)
        row[j] = v
        squares += v * v
    inv = np.float32(1.0) / np.sqrt(squares / np.float32(n) + eps)
    for j in range(n):
        out[t, j] = _store(out, row[j] * inv * _as_f32(weight[j]))


@njit(fastmath=FASTMATH, cache=True, boundscheck=False, nogil=True)
def _rms_norm(x, residual, has_residual, weight, eps, out, summed):  # type: ignore[no-untyped-def]
    """``x``/``residual`` ``[T, H]``; with ``has_residual`` the rounded sum goes to ``summed`` and is normed."""
    row = np.empty(x.shape[1], np.float32)
    for t in range(x.shape[0]):
        _norm_row(x, residual, has_residual, weight, eps, out, summed, t, row)


@njit(parallel=True, fastmath=FASTMATH, cache=True, boundscheck=False, nogil=True)
def _rms_norm_rows(x, residual, has_residual, weight, eps, out, summed):  # type: ignore[no-untyped-def]
    """``_rms_norm`` with its rows spread over numba's threads (a prompt chunk's hundreds of rows), the same
    numbers: each row is the same loop."""
    for t in prange(x.shape[0]):
        _norm_row(x, residual, has_residual, weight, eps, out, summed, t, np.empty(x.shape[1], np.float32))


@njit(fastmath=FASTMATH, cache=True, boundscheck=False, nogil=True)
def _rotate(x, positions, cos_sin, out):  # type: ignore[no-untyped-def]
    """Rotate-half RoPE of ``x [T, H, D]`` into ``out``; ``cos_sin [P, D]``: first half cos, second half sin."""
    half = x.shape[2] // 2
    for t in range(x.shape[0]):
        p = positions[t]
        for h in range(x.shape[1]):
            for j in range(half):
                c, s = cos_sin[p, j], cos_sin[p, half + j]
                a, b = _as_f32(x[t, h, j]), _as_f32(x[t, h, half + j])
                out[t, h, j] = _store(out, a * c - b * s)
                out[t, h, half + j] = _store(out, b * c + a * s)


@njit(cache=True, boundscheck=False, nogil=True)
def _write_kv(key, value, k_cache, v_cache, slots):  # type: ignore[no-untyped-def]
    """Rows of ``key``/``value`` ``[T, Hkv, D]`` into ``[slots, Hkv, D]`` caches of the same dtype; slots < 0 skipped."""
    for t in range(key.shape[0]):
        slot = slots[t]
        if slot < 0:
            continue
        for h in range(key.shape[1]):
            for j in range(key.shape[2]):
                k_cache[slot, h, j] = key[t, h, j]
                v_cache[slot, h, j] = value[t, h, j]


def _np(x: torch.Tensor) -> np.ndarray:
    """A CPU float32/bfloat16 tensor as numpy without a copy (bf16 as its int16 bits), strides kept."""
    return (x.view(torch.int16) if x.dtype == torch.bfloat16 else x).numpy()


def _require(ok: bool, what: Callable[[], str]) -> None:
    """The message is built only for a failure: formatting it costs more than the kernels."""
    if not ok:
        raise KernelError(f"kernels.cpu_layers: {what()}")


def serves(*tensors: torch.Tensor) -> bool:
    """True when every tensor is on the CPU in one supported dtype with a unit last stride (what ``kernels.ops``
    asks before routing a call here)."""
    dtype = tensors[0].dtype
    return dtype in SUPPORTED_DTYPES and all(
        t.device.type == "cpu" and t.dtype == dtype and (t.dim() == 0 or t.stride(-1) == 1) for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``apiary.kernels.reference.rms_norm`` of 2-D ``x`` (weight float32 or x's dtype)."""
    _require(x.dim() == 2 and serves(x, *(() if residual is None else (residual,))) and weight.dim() == 1
             and weight.device.type == "cpu" and weight.dtype in (torch.float32, x.dtype) and weight.is_contiguous(),
             lambda: f"rms_norm takes 2-D CPU {SUPPORTED_DTYPES} rows, got {tuple(x.shape)} {x.dtype}")
    out = torch.empty(x.shape, dtype=x.dtype)
    summed = torch.empty(x.shape, dtype=x.dtype) if residual is not None else out
    _rms_norm(_np(x), _np(residual if residual is not None else x), residual is not None, _np(weight),
              np.float32(eps), _np(out), _np(summed))
    return (out, summed) if residual is not None else out


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``apiary.kernels.reference.apply_rotary``: new contiguous ``(q, k)`` (float32 table)."""
    _require(serves(q, k) and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous(),
             lambda: f"apply_rotary takes CPU {SUPPORTED_DTYPES} q/k and a float32 table, got {q.dtype}/{k.dtype}, "
             f"{cos_sin_cache.dtype}")
    pos = positions.to(torch.int64).contiguous().numpy()
    table = cos_sin_cache.numpy()
    out_q, out_k = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    _rotate(_np(q), pos, table, _np(out_q))
    _rotate(_np(k), pos, table, _np(out_k))
    return out_q, out_k


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """``apiary.kernels.reference.write_kv`` for K/V of the caches' own dtype."""
    _require(serves(key, value, k_cache, v_cache), lambda: f"write_kv takes CPU K/V and caches of one dtype in "
             f"{SUPPORTED_DTYPES}, got {key.dtype}/{value.dtype} into {k_cache.dtype}")
    heads, dim = k_cache.shape[2:]
    _write_kv(_np(key), _np(value), _np(k_cache.view(-1, heads, dim)), _np(v_cache.view(-1, heads, dim)),
              slot_mapping.to(torch.int64).contiguous().numpy())


# ---------------------------------------------------------------- a forward pass's kernels, checked once


@njit(inline="always", fastmath=FASTMATH, boundscheck=False)
def _rotary_row(qkv, num_heads, num_kv_heads, positions, cos_sin, q_out, k_rows, v_rows, slots, t):  # type: ignore[no-untyped-def]
    """Row ``t`` of ``_rotary_write_kv``."""
    dim = q_out.shape[2]
    half = dim // 2
    p = positions[t]
    for h in range(num_heads):
        base = h * dim
        for j in range(half):
            c, s = cos_sin[p, j], cos_sin[p, half + j]
            a, b = _as_f32(qkv[t, base + j]), _as_f32(qkv[t, base + half + j])
            q_out[t, h, j] = _store(q_out, a * c - b * s)
            q_out[t, h, half + j] = _store(q_out, b * c + a * s)
    slot = slots[t]
    if slot >= 0:
        for h in range(num_kv_heads):
            base = (num_heads + h) * dim
            for j in range(half):
                c, s = cos_sin[p, j], cos_sin[p, half + j]
                a, b = _as_f32(qkv[t, base + j]), _as_f32(qkv[t, base + half + j])
                k_rows[slot, h, j] = _store(k_rows, a * c - b * s)
                k_rows[slot, h, half + j] = _store(k_rows, b * c + a * s)
            base = (num_heads + num_kv_heads + h) * dim
            for j in range(dim):
                v_rows[slot, h, j] = _store(v_rows, _as_f32(qkv[t, base + j]))


@njit(fastmath=FASTMATH, cache=True, boundscheck=False, nogil=True)
def _rotary_write_kv(qkv, num_heads, num_kv_heads, positions, cos_sin, q_out, k_rows, v_rows,
                     slots):  # type: ignore[no-untyped-def]
    """The q/k/v projection's rows ``qkv [T, (Hq + 2 Hkv) * D]``: rotate-half RoPE of the query heads into
    ``q_out [T, Hq, D]``; the rotated key heads and the value heads into rows ``[S, Hkv, D]`` of ``qkv``'s dtype at
    ``slots[T]`` (< 0 skipped): a float cache's rows at the step's slots, or a step buffer at 0..T-1 that the
    int8 write quantizes. What ``_rotate`` on q and k, then ``_write_kv``, compute, in one pass."""
    for t in range(qkv.shape[0]):
        _rotary_row(qkv, num_heads, num_kv_heads, positions, cos_sin, q_out, k_rows, v_rows, slots, t)


@njit(parallel=True, fastmath=FASTMATH, cache=True, boundscheck=False, nogil=True)
def _rotary_write_kv_rows(qkv, num_heads, num_kv_heads, positions, cos_sin, q_out, k_rows, v_rows,
                          slots):  # type: ignore[no-untyped-def]
    """``_rotary_write_kv`` with its rows spread over numba's threads (a step's slots are distinct, so no two
    rows write the same cache row)."""
    for t in prange(qkv.shape[0]):
        _rotary_row(qkv, num_heads, num_kv_heads, positions, cos_sin, q_out, k_rows, v_rows, slots, t)


class CpuStep:
    """One CPU forward pass's per-layer kernels, with the per-call work of ``kernels.ops`` done once.

    Why: at decode sizes the kernels themselves take microseconds (an RMSNorm of 13 rows: 3 us) and
    everything around them took ten times that: ``ops``' checks, ``serves``, two ``torch.empty`` and five
    numpy views per call (``ops.rms_norm``: 32 us; rotary and the KV write the same), ~150 us per layer.
    ``kernels.ops.cpu_step`` checks the step's shapes, dtypes and devices once and builds this; every
    layer then calls straight into numba with views made once: the normed rows and the rotated queries
    live in buffers reused by every layer (each is consumed by the next matmul or attention before the
    layer writes it again), the residual stream in two that take turns, rotary and the KV write are one
    pass (``_rotary_write_kv``; into int8 caches through one quantizing write), and decode attention gets
    its block tables and lengths converted once. The values are bit for bit the per-call kernels'
    (``tests/kernels/test_cpu_layers.py``). The caller guarantees what ``ops.cpu_step`` checked: every
    layer's tensors have the step's token count, dtype and head layout, and its caches the shape of
    those it was given.
    """

    __slots__ = ("num_heads", "num_kv_heads", "head_dim", "eps", "positions", "cos_sin", "slots", "normed",
                 "_normed", "_sums", "q", "_q", "_kv", "_decode", "_prefill", "_attn", "_np_of")

    def __init__(self, tokens: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 eps: float, positions: torch.Tensor, slot_mapping: torch.Tensor, cos_sin: torch.Tensor,
                 decode: tuple[torch.Tensor, torch.Tensor, float, int | None] | None, quantized: bool = False,
                 prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, int | None] | None = None) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.eps = np.float32(eps)
        self.positions = positions.to(torch.int64).contiguous().numpy()
        self.slots = slot_mapping.to(torch.int64).contiguous().numpy()
        self.cos_sin = cos_sin.numpy()
        self.normed = torch.empty((tokens, hidden), dtype=dtype)
        self._normed = _np(self.normed)
        self._sums = [(b, _np(b)) for b in (torch.empty((tokens, hidden), dtype=dtype) for _ in range(2))]
        self.q = torch.empty((tokens, num_heads, head_dim), dtype=dtype)
        self._q = _np(self.q)
        # int8 caches: rotated keys and the values first go to these rows, then one quantizing write takes them
        self._kv = None
        if quantized:
            rows = [_np(torch.empty((tokens, num_kv_heads, head_dim), dtype=dtype)) for _ in range(2)]
            self._kv = (rows[0], rows[1], np.arange(tokens, dtype=np.int64))
        self._decode = None
        if decode is not None:
            from apiary.kernels import cpu_attention

            tables, lens, scale, window = decode
            self._decode = cpu_attention.Prepared(tables, lens, scale, window)
        # the query runs after the decode rows (prompt chunks, verifications), where the numba kernels serve them
        self._prefill = None
        if prefill is not None:
            from apiary.kernels import cpu_attention

            self._prefill = cpu_attention.PreparedPrefill(*prefill, num_heads, head_dim)
        self._attn = torch.empty((tokens, num_heads, head_dim), dtype=dtype)  # ``attention``'s rows, every layer
        self._np_of: dict[tuple[int, tuple[int, ...] | None], np.ndarray] = {}  # views of weights, caches, scales
        # numba's thread count is per calling thread (the async engine steps in its own thread): once per pass
        numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))

    def _lasting(self, t: torch.Tensor, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A numpy view of a weight, cache or scale (``t.view(shape)`` with a shape), made once per step."""
        key = (id(t), shape)
        view = self._np_of.get(key)
        if view is None:
            view = self._np_of[key] = _np(t if shape is None else t.view(shape))
        return view

    def _rows(self, cache: torch.Tensor) -> np.ndarray:
        """A ``[num_blocks, block_size, Hkv, D]`` cache as ``[slots, Hkv, D]`` rows."""
        return self._lasting(cache, (-1, self.num_kv_heads, self.head_dim))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rmsnorm(x + residual), x + residual)`` (without a residual: ``(rmsnorm(x), x)``). Both are the step's
        buffers: the normed rows valid until the next call, the sum until the one after (two take turns)."""
        xs = _np(x)
        norm = _rms_norm_rows if xs.shape[0] >= PARALLEL_ROWS else _rms_norm
        if residual is None:
            norm(xs, xs, False, self._lasting(weight), self.eps, self._normed, self._normed)
            return self.normed, x
        # The sum goes to the buffer the residual is not in: summing in place aliases the kernel's input and
        # output, and LLVM's vectoriser then takes the scalar loop, whose float32 sum rounds differently.
        out, out_np = self._sums[1] if residual is self._sums[0][0] else self._sums[0]
        norm(xs, _np(residual), True, self._lasting(weight), self.eps, self._normed, out_np)
        return self.normed, out

    def rotary_write_kv(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Rotated queries ``[T, Hq, D]`` (the step's buffer, valid until the next call); rotated keys and the
        values into the caches at the step's slots (int8 caches: quantized per token and KV head, with the
        scales ``cpu_quant.write_kv_int8`` gives)."""
        rotate = _rotary_write_kv_rows if qkv.shape[0] >= PARALLEL_ROWS else _rotary_write_kv
        if self._kv is None:
            rotate(_np(qkv), self.num_heads, self.num_kv_heads, self.positions, self.cos_sin, self._q,
                             self._rows(k_cache), self._rows(v_cache), self.slots)
            return self.q
        from apiary.kernels import cpu_quant

        keys, values, rows = self._kv
        rotate(_np(qkv), self.num_heads, self.num_kv_heads, self.positions, self.cos_sin, self._q, keys,
                         values, rows)
        cpu_quant.write_rows_int8(keys, values, self._rows(k_cache), self._rows(v_cache),
                                  self._lasting(k_scale, (-1, self.num_kv_heads)),
                                  self._lasting(v_scale, (-1, self.num_kv_heads)), self.slots)
        return self.q

    @property
    def attends_all(self) -> bool:
        """Whether ``attention`` serves every row of the step: no query runs, or runs the numba kernels take."""
        decodes = 0 if self._decode is None else self._decode.tables.shape[0]
        return self._prefill is not None or decodes == self.q.shape[0]

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Every row's attention (``attends_all``): the decode rows', then the query runs' (``ops.paged_prefill_attention``),
        written into one buffer of the step (valid until the next call), so there is no concatenation; bit for bit
        the per-call kernels'."""
        scales = None if k_scale is None or v_scale is None else (self._lasting(k_scale), self._lasting(v_scale))
        keys, values = self._lasting(k_cache), self._lasting(v_cache)
        decodes = 0
        if self._decode is not None:
            decodes = self._decode.tables.shape[0]
            self._decode(q[:decodes], keys, values, scales, self._attn[:decodes])
        if self._prefill is not None:
            self._prefill(q[decodes:], keys, values, scales, self._attn[decodes:])
        return self._attn

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The step's decode rows' attention (``q``: its first ``num_decode_tokens`` rows; int8 caches with their
        scales)."""
        assert self._decode is not None, "this step has no decode rows"
        scales = None if k_scale is None or v_scale is None else (self._lasting(k_scale), self._lasting(v_scale))
        return self._decode(q, self._lasting(k_cache), self._lasting(v_cache), scales)

    def stacked_layers(self, x: torch.Tensor, residual: torch.Tensor | None, stack: LayerStack,
                       pool: torch.Tensor, scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``stack``'s layers for a step of decode rows only, one compiled call (``cpu_decode_layers``): the
        ``(x, residual)`` that the per-layer calls (``rms_norm``, the projections, ``rotary_write_kv``,
        ``decode_attention``) would give, bit for bit. ``pool``: the KV pool ``[layers, 2, blocks, block_size, Hkv,
        D]`` whose layer ``i`` holds layer ``i``'s K and V (``cloud.engine.kv_cache.KVPool``); an int8 one with its
        ``scales [layers, 2, blocks, block_size, Hkv]``."""
        from apiary.kernels import cpu_decode_layers

        decode = self._decode
        quantized = pool.dtype == torch.int8
        _require(decode is not None and (self._kv is not None) == quantized and decode.tables.shape[0] == x.shape[0],
                 lambda: "stacked_layers takes a step of decode rows only, over the cache the step was made for")
        _require(pool.dim() == 6 and pool.is_contiguous() and pool.dtype in (x.dtype, torch.bfloat16, torch.int8)
                 and pool.shape[1] == 2 and tuple(pool.shape[4:]) == (self.num_kv_heads, self.head_dim)
                 and stack.first + stack.count <= pool.shape[0] and x.is_contiguous()
                 and (residual is None or (residual.is_contiguous() and residual.shape == x.shape)),
                 lambda: f"stacked_layers takes a contiguous [layers, 2, blocks, block_size, {self.num_kv_heads}, "
                         f"{self.head_dim}] pool of the rows' dtype, bf16 or int8, got {tuple(pool.shape)} {pool.dtype}")
        _require(quantized == (scales is not None) and (scales is None or (
                     scales.dtype == torch.float32 and scales.is_contiguous() and scales.shape == pool.shape[:-1])),
                 lambda: f"stacked_layers takes an int8 pool's float32 scales {list(pool.shape[:-1])} and a float "
                         f"pool's none, got {None if scales is None else (tuple(scales.shape), scales.dtype)}")
        out, summed = cpu_decode_layers.run(stack, _np(x), None if residual is None else _np(residual), _np(pool),
                                            self.num_heads, self.positions, self.cos_sin, self.slots, decode.tables,
                                            decode.lens, decode.scale, decode.window, self.eps,
                                            None if scales is None else _np(scales))
        as_tensor = (lambda a: torch.from_numpy(a).view(torch.bfloat16)) if x.dtype == torch.bfloat16 else torch.from_numpy
        return as_tensor(out), as_tensor(summed)
