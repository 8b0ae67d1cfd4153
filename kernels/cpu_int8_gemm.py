"""Grouped int8 GEMM for CPUs with AVX-512 VNNI: int8 weights and activations, one scale per 64 inputs.

Why: the W8A8 projections of ``apiary.cloud.engine.int8`` through oneDNN quantized activations per
token and cost ~100 us a call at decode's 1-16 rows (slower than bf16), and per-token activation
scales cost accuracy: 95.3-96.0% teacher-forced agreement with the fp32 engine against the 97% gate.
Scales per 64 inputs on both sides (as llama.cpp's Q8_0 pairs do per 32) measured 98.4% (docs/engine.md
"int8 weights"), and a kernel of our own takes one call per projection, activations quantized inside it.

The product of a row ``x`` and output ``n`` is ``sum_g sx[g] * sw[n, g] * sum_{k in g} qx[k] * qw[n, k]``.
The inner sums are ``vpdpbusd``: 16 int32 lanes (16 outputs), each adding four u8 x s8 products per
instruction. Weights go in as u8 (``qw + 128``), activations as s8, so each group's sum carries
``128 * sum(qx)``, which the accumulator starts at minus (no int16 saturation: 255 x 127 fits). After
each group the 16 int32 sums are converted once and added with their two scales (four vector ops per
16 ``vpdpbusd``).

Layouts: weights ``[N / 16, K / 4, 16, 4]`` u8 (for each 16 outputs and 4 inputs, one 64-byte vector),
their scales ``[N / 16, K / 64, 16]``; K is padded with zeros to a multiple of 64. A work item is 16
outputs for every row, in micro-tiles of at most ``ROWS`` rows (int and float accumulators in registers),
so a weight tile is read from memory once per call and its 16 x K bytes stay in L1 across the rows.
While a group of one tile computes, the same group of the next tile is asked for (16 prefetches of
64 bytes): a decode step's 106 MB of int8 weights do not fit any cache, and without this the cores
waited on them (30 layers of projections at 16 rows: 11.1 -> 7.6-7.8 ms; prefetching a whole tile
at its start gained nothing, two tiles ahead no more than one).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from apiary.kernels.cpu_attention import _as_f32, _close_loop, _data, _exp, _open_loop, _splat
from apiary.kernels.errors import KernelError

GROUP = 64  # inputs per scale, both sides (32: no consistent gain in agreement, twice the float work per vpdpbusd)
TILE = 16  # outputs per vector: 16 int32 lanes
# Rows per micro-tile (at most 8: the leftover rows go as 4, 2, 1): 2 x 6 int and 6 float accumulators beside the
# 16 weight vectors LLVM keeps for a group. With 8 rows LLVM spilled float accumulators every group: 30 layers of
# projections at 256 rows took 113-122 ms against 94-110 with 6 (and with 5), the same at 16 rows.
ROWS = 6
WEIGHT_ZERO_POINT = 128  # weights enter vpdpbusd as unsigned bytes
MIN_ABSMAX = 1e-8  # groups of zeros get this absmax: scale > 0, all-zero int8
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
REQUIRED_FEATURES = ("avx512f", "avx512bw", "avx512vnni")  # LLVM's names for what the kernel's instructions need


@functools.cache
def available() -> bool:
    """Whether numba compiles for a CPU with the instructions this kernel uses (LLVM's view of the host)."""
    try:
        from llvmlite import binding

        features = binding.get_host_cpu_features()
    except Exception:  # noqa: BLE001 - no host feature query: say no, callers take another path
        return False
    return all(features.get(name, False) for name in REQUIRED_FEATURES)


@dataclass(frozen=True, slots=True)
class GroupedWeight:
    """A linear layer's weight in the kernel's layout; ``dequantized()`` is what it computes with."""

    packed: np.ndarray  # [N / 16, Kp / 4, 16, 4] uint8: q + 128
    scales: np.ndarray  # [N / 16, Kp / 64, 16] float32
    out_features: int
    in_features: int

    @property
    def groups(self) -> int:
        return self.scales.shape[1]

    def dequantized(self) -> torch.Tensor:
        """The float32 ``[N, K]`` weight: ``q * scale`` per group (tests, error analysis)."""
        tiles, quads = self.packed.shape[:2]
        q = torch.from_numpy(self.packed).permute(0, 2, 1, 3).reshape(tiles * TILE, quads * 4).to(torch.int16) - WEIGHT_ZERO_POINT
        s = torch.from_numpy(self.scales).permute(0, 2, 1).reshape(tiles * TILE, self.groups)
        w = q.float().view(tiles * TILE, self.groups, GROUP) * s[:, :, None]
        return w.reshape(tiles * TILE, -1)[: self.out_features, : self.in_features].contiguous()

    def tensors(self) -> list[torch.Tensor]:
        """The packed bytes and scales (for counting what the layer holds)."""
        return [torch.from_numpy(self.packed), torch.from_numpy(self.scales)]


def quantize_weight(weight: torch.Tensor) -> GroupedWeight:
    """Symmetric int8 per (output, 64 inputs) of ``weight [N, K]``, packed for the kernel (zeros pad N to a
    multiple of 16 and K to one of 64)."""
    rows, k = weight.shape
    n, padded = -(-rows // TILE) * TILE, -(-k // GROUP) * GROUP
    w = torch.zeros(n, padded, dtype=torch.float32)
    w[:rows, :k] = weight.float()
    grouped = w.view(n, padded // GROUP, GROUP)
    scale = grouped.abs().amax(dim=2).clamp(min=MIN_ABSMAX) / 127
    q = torch.round(grouped / scale[:, :, None]).clamp(-127, 127).to(torch.int16) + WEIGHT_ZERO_POINT
    packed = q.to(torch.uint8).view(n // TILE, TILE, padded // 4, 4).permute(0, 2, 1, 3).contiguous()
    scales = scale.view(n // TILE, TILE, -1).permute(0, 2, 1).contiguous()
    return GroupedWeight(packed.numpy(), scales.numpy(), rows, k)


def quantize_activations(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` as the kernel quantizes it: ``(q [M, groups * 64] int8, scale [M, groups] float32)``,
    ``x ~= q * scale`` per group of 64 (tests and the reference)."""
    m, k = x.shape
    q = torch.zeros(m, groups * GROUP, dtype=torch.int8)
    scale = torch.empty(m, groups, dtype=torch.float32)
    corr = torch.empty(m, groups, dtype=torch.int32)
    if m:
        x = x.contiguous()
        _quantize(x.view(torch.int16).numpy() if x.dtype == torch.bfloat16 else x.numpy(), q.numpy(), scale.numpy(),
                  corr.numpy(), k)
    return q, scale


def reference(x: torch.Tensor, weight: GroupedWeight) -> torch.Tensor:
    """The kernel's result in float64 torch ops: group-quantized ``x`` times the dequantized weight."""
    q, scale = quantize_activations(x, weight.groups)
    xq = (q.double().view(x.shape[0], weight.groups, GROUP) * scale.double()[:, :, None]).view(q.shape)
    w = torch.zeros(weight.out_features, weight.groups * GROUP, dtype=torch.float64)
    w[:, : weight.in_features] = weight.dequantized().double()
    return xq @ w.t()


def linear(x: torch.Tensor, weight: GroupedWeight, gated: bool = False) -> torch.Tensor:
    """``x [M, K] @ W.T`` -> ``[M, N]`` in ``x``'s dtype (float32 or bfloat16, CPU), activations quantized
    per 64 inputs inside the call. ``gated``: ``x`` is ``[M, 2K]`` (a SwiGLU's gate and up projections side
    by side) and the product is ``(silu(gate) * up) @ W.T``, the elementwise part done in the same pass."""
    k = weight.in_features * (2 if gated else 1)
    if x.device.type != "cpu" or x.dtype not in SUPPORTED_DTYPES or x.dim() != 2 or x.shape[1] != k:
        raise KernelError(f"cpu_int8_gemm.linear takes a 2-D CPU {SUPPORTED_DTYPES} tensor of {k} "
                          f"columns, got {tuple(x.shape)} {x.dtype} on {x.device}")
    m, n = x.shape[0], weight.packed.shape[0] * TILE
    if m == 0:
        return x.new_empty((0, weight.out_features))
    want = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    if numba.get_num_threads() != want:
        numba.set_num_threads(max(1, want))
    x = x.contiguous()
    if x.dtype == torch.bfloat16:
        bits = np.empty((m, n), np.int16)
        _linear(x.view(torch.int16).numpy(), weight.packed, weight.scales, bits, gated)
        out = torch.from_numpy(bits).view(torch.bfloat16)
    else:
        out = torch.from_numpy(np.empty((m, n), np.float32))
        _linear(x.numpy(), weight.packed, weight.scales, out.numpy(), gated)
    return out if n == weight.out_features else out[:, : weight.out_features].contiguous()


# ---------------------------------------------------------------- compiled parts


@njit(inline="always", fastmath={"nnan", "ninf", "nsz"}, boundscheck=False)
def _quantize_row(x, q, scale, corr, k):  # type: ignore[no-untyped-def]
    """Row ``x`` (k values; float32, or bf16 bits as int16) into ``q`` per group of 64 (zeros past k)."""
    for g in range(scale.shape[0]):
        start, stop = g * GROUP, min(k, (g + 1) * GROUP)
        top = np.float32(0.0)
        for j in range(start, stop):
            top = max(top, abs(_as_f32(x[j])))
        s = max(top, np.float32(MIN_ABSMAX)) / np.float32(127.0)
        total = 0
        for j in range(start, stop):
            v = np.int8(np.round(_as_f32(x[j]) / s))
            q[j] = v
            total += v
        for j in range(max(start, stop), (g + 1) * GROUP):
            q[j] = 0
        scale[g] = s
        corr[g] = -WEIGHT_ZERO_POINT * total


@njit(inline="always", fastmath={"nnan", "ninf", "nsz"}, boundscheck=False)
def _silu(x):  # type: ignore[no-untyped-def]
    """``x * sigmoid(x)`` in float32, with the exponential of a non-positive number only (``_exp``'s domain)."""
    e = _exp(-abs(x))
    return x / (np.float32(1.0) + e) if x >= 0 else x * e / (np.float32(1.0) + e)


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def _quantize(x, q, scale, corr, k):  # type: ignore[no-untyped-def]
    for i in prange(x.shape[0]):
        _quantize_row(x[i], q[i], scale[i], corr[i], k)


def _micro_tile_of(rows: int):  # type: ignore[no-untyped-def]
    """The intrinsic ``tile(out, out_at, out_stride, q, q_at, w, w_at, sw, sw_at, scale, corr, at, groups)``
    for ``rows`` rows: ``out.flat[out_at + r * out_stride : … + 16]`` (float32, or bf16 bits rounded to nearest
    even) = the grouped int8 products of row r (``q.flat[q_at + r * groups * 64 …]`` int8, its scales and
    corrections at ``scale/corr.flat[at + r * groups + g]``) with the 16 outputs whose packed weights start at
    ``w.flat[w_at]`` and scales at ``sw.flat[sw_at]``.

    Why LLVM IR: ``vpdpbusd`` has no numba spelling, and the 2 x ``rows`` accumulators must stay in registers.
    """

    @intrinsic
    def tile(typingctx, out, out_at, out_stride, q, q_at, w, w_at, ahead, sw, sw_at, scale, corr, at,
             groups):  # type: ignore[no-untyped-def]
        signature = types.void(out, types.intp, types.intp, q, types.intp, w, types.intp, types.intp, sw, types.intp,
                               scale, corr,
                               types.intp, types.intp)

        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            out_arr, out_at, out_stride, q_arr, q_at, w_arr, w_at, ahead, sw_arr, sw_at, scale_arr, corr_arr, at, count = args
            i16, i32, i64, f32 = ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
            ivec, fvec = ir.VectorType(i32, TILE), ir.VectorType(f32, TILE)
            dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ivec, [ivec, ivec, ivec]),
                                                 "llvm.x86.avx512.vpdpbusd.512")
            prefetch = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]), "llvm.prefetch.p0")
            c = lambda v: ir.Constant(i64, v)  # noqa: E731
            row_bytes = builder.mul(count, c(GROUP))
            qs = [builder.gep(_data(context, builder, sig.args[3], q_arr), [builder.add(q_at, builder.mul(row_bytes, c(r)))])
                  for r in range(rows)]
            weights = builder.gep(_data(context, builder, sig.args[5], w_arr), [w_at])
            wscales = builder.gep(_data(context, builder, sig.args[8], sw_arr), [sw_at])
            scales = [builder.gep(_data(context, builder, sig.args[10], scale_arr), [builder.add(at, builder.mul(count, c(r)))])
                      for r in range(rows)]
            corrs = [builder.gep(_data(context, builder, sig.args[11], corr_arr), [builder.add(at, builder.mul(count, c(r)))])
                     for r in range(rows)]
            entry, loop, done = _open_loop(builder, f"int8_tile_{rows}", count)
            g, accs = builder.phi(i64), [builder.phi(fvec) for _ in range(rows)]
            sums, odd_sums = [], []
            for r in range(rows):
                start = builder.insert_element(ir.Constant(ivec, ir.Undefined), builder.load(builder.gep(corrs[r], [g])),
                                               ir.Constant(i32, 0))
                sums.append(builder.shuffle_vector(start, ir.Constant(ivec, ir.Undefined),
                                                   ir.Constant(ivec, [0] * TILE)))
                odd_sums.append(ir.Constant(ivec, [0] * TILE))
            wg = builder.gep(weights, [builder.mul(g, c(GROUP * TILE))])
            later = builder.gep(wg, [ahead])  # the same group of a later tile: its lines, asked for now
            for line in range(GROUP * TILE // 64):
                builder.call(prefetch, [builder.gep(later, [c(line * 64)]), ir.Constant(i32, 0), ir.Constant(i32, 2),
                                        ir.Constant(i32, 1)])
            for quad in range(GROUP // 4):
                wv = builder.load(builder.bitcast(builder.gep(wg, [c(quad * 4 * TILE)]), ivec.as_pointer()), align=1)
                for r in range(rows):
                    at_q = builder.gep(qs[r], [builder.add(builder.mul(g, c(GROUP)), c(quad * 4))])
                    word = builder.load(builder.bitcast(at_q, i32.as_pointer()), align=1)
                    one = builder.insert_element(ir.Constant(ivec, ir.Undefined), word, ir.Constant(i32, 0))
                    splat = builder.shuffle_vector(one, ir.Constant(ivec, ir.Undefined), ir.Constant(ivec, [0] * TILE))
                    if quad % 2:
                        odd_sums[r] = builder.call(dot, [odd_sums[r], wv, splat])
                    else:
                        sums[r] = builder.call(dot, [sums[r], wv, splat])
            sums = [builder.add(a, b) for a, b in zip(sums, odd_sums)]
            swv = builder.load(builder.bitcast(builder.gep(wscales, [builder.mul(g, c(TILE))]), fvec.as_pointer()), align=4)
            totals = []
            for r in range(rows):
                both = builder.fmul(swv, _splat(builder, builder.load(builder.gep(scales[r], [g]))), flags=("fast",))
                term = builder.fmul(builder.sitofp(sums[r], fvec), both, flags=("fast",))
                totals.append(builder.fadd(accs[r], term, flags=("fast",)))
            results = _close_loop(builder, g, 1, count, accs, totals, entry, loop, done)
            target = builder.gep(_data(context, builder, sig.args[0], out_arr), [out_at])
            bf16 = sig.args[0].dtype == types.int16
            for r, result in enumerate(results):
                at_out = builder.gep(target, [builder.mul(out_stride, c(r))])
                if bf16:  # round to nearest even, keep the top half
                    bits = builder.bitcast(result, ivec)
                    odd = builder.and_(builder.lshr(bits, ir.Constant(ivec, [16] * TILE)), ir.Constant(ivec, [1] * TILE))
                    rounded = builder.add(builder.add(bits, ir.Constant(ivec, [0x7FFF] * TILE)), odd)
                    half = builder.trunc(builder.lshr(rounded, ir.Constant(ivec, [16] * TILE)), ir.VectorType(i16, TILE))
                    builder.store(half, builder.bitcast(at_out, ir.VectorType(i16, TILE).as_pointer()), align=2)
                else:
                    builder.store(result, builder.bitcast(at_out, fvec.as_pointer()), align=4)
            return context.get_dummy_value()

        return signature, codegen

    return tile


_tile_1, _tile_2, _tile_4, _tile_rows = (_micro_tile_of(rows) for rows in (1, 2, 4, ROWS))


@njit(inline="always", boundscheck=False)
def _tiles(m, t, ahead, out, q, packed, wscales, scale, corr):  # type: ignore[no-untyped-def]
    """Output tile ``t`` for all ``m`` rows: micro-tiles of ``ROWS`` rows, then 4, 2 and 1 for what is left."""
    n, groups = out.shape[1], wscales.shape[1]
    w_at, s_at = t * packed.shape[1] * TILE * 4, t * groups * TILE
    m0 = 0
    while m0 + ROWS <= m:
        _tile_rows(out, m0 * n + t * TILE, n, q, m0 * groups * GROUP, packed, w_at, ahead, wscales, s_at, scale, corr,
                m0 * groups, groups)
        m0 += ROWS
    if m - m0 >= 4:
        _tile_4(out, m0 * n + t * TILE, n, q, m0 * groups * GROUP, packed, w_at, ahead, wscales, s_at, scale, corr,
                m0 * groups, groups)
        m0 += 4
    if m - m0 >= 2:
        _tile_2(out, m0 * n + t * TILE, n, q, m0 * groups * GROUP, packed, w_at, ahead, wscales, s_at, scale, corr,
                m0 * groups, groups)
        m0 += 2
    if m - m0 == 1:
        _tile_1(out, m0 * n + t * TILE, n, q, m0 * groups * GROUP, packed, w_at, ahead, wscales, s_at, scale, corr,
                m0 * groups, groups)


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def _linear(x, packed, wscales, out, gated):  # type: ignore[no-untyped-def]
    """``out [M, N]`` = ``x [M, K]`` times the packed weight (float32, or bf16 bits as int16, both); ``gated``:
    ``x`` is ``[M, 2K]``, gate and up side by side, and the input is ``silu(gate) * up`` (in float32).
    The scratch is allocated here: each array made in Python costs ~1 us, and decode makes 120 of these
    calls a step."""
    m, k = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    tiles, groups = packed.shape[0], wscales.shape[1]
    q = np.empty((m, groups * GROUP), np.int8)
    scale = np.empty((m, groups), np.float32)
    corr = np.empty((m, groups), np.int32)
    for i in prange(m):
        if gated:
            values = np.empty(k, np.float32)
            for j in range(k):
                values[j] = _silu(_as_f32(x[i, j])) * _as_f32(x[i, k + j])
            _quantize_row(values, q[i], scale[i], corr[i], k)
        else:
            _quantize_row(x[i], q[i], scale[i], corr[i], k)
    w_tile = packed.shape[1] * TILE * 4
    for t in prange(tiles):
        _tiles(m, t, w_tile if t + 1 < tiles else 0, out, q, packed, wscales, scale, corr)
