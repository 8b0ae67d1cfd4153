"""Grouped int8 GEMM for CPUs with AVX-512 VNNI or AVX2: int8 weights and activations, one scale per 64 inputs.

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

AVX2 hosts (no ``vpdpbusd``) get a second kernel over the same layout and the same numbers, bit for bit
(``_avx2_micro_tile_of``: llama.cpp's sign trick into ``vpmaddubsw``, then ``vpmaddwd``): 8-bit weights
with scales per 64 inputs there too, where oneDNN's int8 needs 7-bit weights on such a CPU (91.8%
teacher-forced agreement against the 97% gate). Numba compiled for Haswell on the Zen 4 host
(``NUMBA_CPU_NAME=haswell``, ``NUMBA_CPU_FEATURES`` without AVX-512), 30 layers of this model's
projections, 2 threads: 3.2 / 17 / 62 / 248 ms at 1 / 16 / 64 / 256 rows, against float32 ``F.linear``
(oneDNN held to AVX2) 9.5 / 43 / 103 / 332 ms: 2.5-2.9x at decode sizes, 1.3-1.7x at prompt sizes
(docs/kernels.md "Grouped int8 GEMM"). Rows per micro-tile (1-4) made no difference there: the kernel is
bound by its ~9 vector ops per 64 products, not by loads.

Which kernel runs is ``isa()``: the best of ``runnable()``, read from the features numba compiles for
(``NUMBA_CPU_FEATURES`` where set, as in such rehearsals, else the host's).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from apiary.kernels import huge_pages
from apiary.kernels.cpu_attention import (_as_f32, _close_loop, _data, _exp, _numba_target_features, _open_loop, _splat,
                                          follow_torch_threads)
from apiary.kernels.errors import KernelError

GROUP = 64  # inputs per scale, both sides (32: no consistent gain in agreement, twice the float work per vpdpbusd)
TILE = 16  # outputs per vector: 16 int32 lanes
# Rows per micro-tile (at most 8; ``_rows_next`` splits the rows evenly): 2 x 6 int and 6 float accumulators beside the
# 16 weight vectors LLVM keeps for a group. With 8 rows LLVM spilled float accumulators every group: 30 layers of
# projections at 256 rows took 113-122 ms against 94-110 with 6 (and with 5), the same at 16 rows.
ROWS = 6
WEIGHT_ZERO_POINT = 128  # weights enter vpdpbusd as unsigned bytes
MIN_ABSMAX = 1e-8  # groups of zeros get this absmax: scale > 0, all-zero int8
QUANTIZE_ROWS = 4096  # outputs ``quantize_weight`` converts at a time (a multiple of TILE): ~40 MB of temporaries at K 576
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
ROWS_AVX2 = 2  # AVX2's 16 vector registers: 2 rows x 2 halves x (int + float) accumulators beside the weights
# LLVM's names for what each kernel's instructions need, best first
ISA_FEATURES = {"avx512_vnni": ("avx512f", "avx512bw", "avx512vnni"), "avx2": ("avx2",)}


@functools.cache
def runnable() -> tuple[str, ...]:
    """The kernels numba can compile here, best first: ``"avx512_vnni"`` (``vpdpbusd``), ``"avx2"``
    (``vpmaddubsw``). Calling one the CPU lacks would kill the process with an illegal instruction."""
    try:
        features = _numba_target_features()
    except Exception:  # noqa: BLE001 - no feature query: none, callers take another path
        return ()
    return tuple(name for name, needs in ISA_FEATURES.items() if all(features.get(f, False) for f in needs))


def isa() -> str | None:
    """The kernel ``linear`` runs by default: the best of ``runnable()``, or None."""
    return next(iter(runnable()), None)


def available() -> bool:
    """Whether numba compiles for a CPU with the instructions of one of the kernels."""
    return isa() is not None


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
    multiple of 16 and K to one of 64). ``QUANTIZE_ROWS`` outputs at a time: whole, an LM head's float32
    temporaries (SmolLM2's: 49,152 x 576) took ~350 MB at once, the peak of an engine's load."""
    rows, k = weight.shape
    n, padded = -(-rows // TILE) * TILE, -(-k // GROUP) * GROUP
    packed = huge_pages.empty((n // TILE, padded // 4, TILE, 4), np.uint8)
    scales = np.empty((n // TILE, padded // GROUP, TILE), np.float32)
    for start in range(0, n, QUANTIZE_ROWS):
        stop = min(n, start + QUANTIZE_ROWS)
        w = torch.zeros(stop - start, padded, dtype=torch.float32)
        w[: max(0, min(rows, stop) - start), :k] = weight[start:stop].float()
        grouped = w.view(stop - start, padded // GROUP, GROUP)
        scale = grouped.abs().amax(dim=2).clamp(min=MIN_ABSMAX) / 127
        q = torch.round(grouped / scale[:, :, None]).clamp(-127, 127).to(torch.int16) + WEIGHT_ZERO_POINT
        tiles = slice(start // TILE, stop // TILE)
        torch.from_numpy(packed[tiles]).copy_(q.to(torch.uint8).view(-1, TILE, padded // 4, 4).permute(0, 2, 1, 3))
        torch.from_numpy(scales[tiles]).copy_(scale.view(-1, TILE, padded // GROUP).permute(0, 2, 1))
    return GroupedWeight(packed, scales, rows, k)


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


def linear(x: torch.Tensor, weight: GroupedWeight, gated: bool = False, kernel: str | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T`` -> ``[M, N]`` in ``x``'s dtype (float32 or bfloat16, CPU), activations quantized
    per 64 inputs inside the call. ``gated``: ``x`` is ``[M, 2K]`` (a SwiGLU's gate and up projections side
    by side) and the product is ``(silu(gate) * up) @ W.T``, the elementwise part done in the same pass.
    ``kernel``: one of ``runnable()`` (default: ``isa()``, the best); both kernels give the same numbers."""
    return Bound(weight, kernel)(x, gated)


def compiled_kernel(kernel: str | None = None):  # type: ignore[no-untyped-def]
    """``(name, compiled GEMM)`` for one of ``runnable()`` (default: ``isa()``, the best); a clear error for a
    kernel this CPU cannot run, which would otherwise kill the process with an illegal instruction."""
    kernel = kernel or isa()
    if kernel not in runnable():
        raise KernelError(f"cpu_int8_gemm: kernel {kernel!r} does not run here (kernels: {', '.join(ISA_FEATURES)}; "
                          f"this CPU, as numba compiles for it, runs: {', '.join(runnable()) or 'none'})")
    return kernel, _linear if kernel == "avx512_vnni" else _linear_avx2


class Bound:
    """``linear(x, weight, gated)`` for one weight, the kernel chosen and checked once: what a model's layer
    holds. Why: a decode step makes ~110 int8 projections, and choosing the kernel, looking up the module and
    re-checking on every call cost ~5 us of Python each, against ~25 us for a 16-row projection of SmolLM2."""

    __slots__ = ("weight", "compiled")

    def __init__(self, weight: GroupedWeight, kernel: str | None = None) -> None:
        self.weight = weight
        self.compiled = compiled_kernel(kernel)[1]

    def __call__(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        weight = self.weight
        k = weight.in_features * (2 if gated else 1)
        if x.dtype not in SUPPORTED_DTYPES or x.dim() != 2 or x.shape[1] != k or x.device.type != "cpu":
            raise KernelError(f"cpu_int8_gemm.linear takes a 2-D CPU {SUPPORTED_DTYPES} tensor of {k} "
                              f"columns, got {tuple(x.shape)} {x.dtype} on {x.device}")
        m, n = x.shape[0], weight.packed.shape[0] * TILE
        if m == 0:
            return x.new_empty((0, weight.out_features))
        follow_torch_threads()
        x = x.contiguous()
        if x.dtype == torch.bfloat16:
            bits = np.empty((m, n), np.int16)
            self.compiled(x.view(torch.int16).numpy(), weight.packed, weight.scales, bits, gated)
            out = torch.from_numpy(bits).view(torch.bfloat16)
        else:
            out = torch.from_numpy(np.empty((m, n), np.float32))
            self.compiled(x.numpy(), weight.packed, weight.scales, out.numpy(), gated)
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


def _operands(context, builder, sig, args, rows):  # type: ignore[no-untyped-def]
    """A micro-tile's pointers: each row's int8 activations, the tile's packed weights and their scales, each
    row's activation scales and corrections (all indexed by group from there)."""
    _, _, _, q_arr, q_at, w_arr, w_at, _, sw_arr, sw_at, scale_arr, corr_arr, at, count = args
    c = lambda v: ir.Constant(ir.IntType(64), v)  # noqa: E731
    row_bytes = builder.mul(count, c(GROUP))
    qs = [builder.gep(_data(context, builder, sig.args[3], q_arr), [builder.add(q_at, builder.mul(row_bytes, c(r)))])
          for r in range(rows)]
    weights = builder.gep(_data(context, builder, sig.args[5], w_arr), [w_at])
    wscales = builder.gep(_data(context, builder, sig.args[8], sw_arr), [sw_at])
    scales = [builder.gep(_data(context, builder, sig.args[10], scale_arr), [builder.add(at, builder.mul(count, c(r)))])
              for r in range(rows)]
    corrs = [builder.gep(_data(context, builder, sig.args[11], corr_arr), [builder.add(at, builder.mul(count, c(r)))])
             for r in range(rows)]
    return qs, weights, wscales, scales, corrs


def _prefetch_group(builder, group_weights, ahead):  # type: ignore[no-untyped-def]
    """Ask for the same group of a later tile (``ahead`` bytes on): its 16 lines, while this one computes."""
    i32, i64 = ir.IntType(32), ir.IntType(64)
    prefetch = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]), "llvm.prefetch.p0")
    later = builder.gep(group_weights, [ahead])
    for line in range(GROUP * TILE // 64):
        builder.call(prefetch, [builder.gep(later, [ir.Constant(i64, line * 64)]), ir.Constant(i32, 0),
                                ir.Constant(i32, 2), ir.Constant(i32, 1)])


def _splat_word(builder, word, lanes):  # type: ignore[no-untyped-def]
    """An i32 broadcast to ``lanes`` lanes."""
    i32 = ir.IntType(32)
    vec = ir.VectorType(i32, lanes)
    one = builder.insert_element(ir.Constant(vec, ir.Undefined), word, ir.Constant(i32, 0))
    return builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined), ir.Constant(vec, [0] * lanes))


def _store_rows(context, builder, sig, args, results, lanes, offset):  # type: ignore[no-untyped-def]
    """Write row r's float32 ``results[r]`` (``lanes`` outputs) at ``out.flat[out_at + r * out_stride + offset]``,
    as float32 or as bf16 bits rounded to nearest even."""
    out_arr, out_at, out_stride = args[:3]
    i16, i32, i64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)
    ivec, fvec = ir.VectorType(i32, lanes), ir.VectorType(ir.FloatType(), lanes)
    target = builder.gep(_data(context, builder, sig.args[0], out_arr), [builder.add(out_at, ir.Constant(i64, offset))])
    bf16 = sig.args[0].dtype == types.int16
    for r, result in enumerate(results):
        at_out = builder.gep(target, [builder.mul(out_stride, ir.Constant(i64, r))])
        if bf16:  # round to nearest even, keep the top half
            bits = builder.bitcast(result, ivec)
            odd = builder.and_(builder.lshr(bits, ir.Constant(ivec, [16] * lanes)), ir.Constant(ivec, [1] * lanes))
            rounded = builder.add(builder.add(bits, ir.Constant(ivec, [0x7FFF] * lanes)), odd)
            half = builder.trunc(builder.lshr(rounded, ir.Constant(ivec, [16] * lanes)), ir.VectorType(i16, lanes))
            builder.store(half, builder.bitcast(at_out, ir.VectorType(i16, lanes).as_pointer()), align=2)
        else:
            builder.store(result, builder.bitcast(at_out, fvec.as_pointer()), align=4)


def _tile_signature(out, q, w, sw, scale, corr):  # type: ignore[no-untyped-def]
    return types.void(out, types.intp, types.intp, q, types.intp, w, types.intp, types.intp, sw, types.intp,
                      scale, corr, types.intp, types.intp)


def _micro_tile_of(rows: int):  # type: ignore[no-untyped-def]
    """The AVX-512 VNNI intrinsic ``tile(out, out_at, out_stride, q, q_at, w, w_at, ahead, sw, sw_at, scale, corr,
    at, groups)`` for ``rows`` rows: ``out.flat[out_at + r * out_stride : … + 16]`` (float32, or bf16 bits rounded
    to nearest even) = the grouped int8 products of row r (``q.flat[q_at + r * groups * 64 …]`` int8, its scales
    and corrections at ``scale/corr.flat[at + r * groups + g]``) with the 16 outputs whose packed weights start at
    ``w.flat[w_at]`` and scales at ``sw.flat[sw_at]``.

    Why LLVM IR: ``vpdpbusd`` has no numba spelling, and the 2 x ``rows`` accumulators must stay in registers.
    """

    @intrinsic
    def tile(typingctx, out, out_at, out_stride, q, q_at, w, w_at, ahead, sw, sw_at, scale, corr, at,
             groups):  # type: ignore[no-untyped-def]
        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            ahead, count = args[7], args[13]
            i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
            ivec, fvec = ir.VectorType(i32, TILE), ir.VectorType(f32, TILE)
            dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ivec, [ivec, ivec, ivec]),
                                                 "llvm.x86.avx512.vpdpbusd.512")
            c = lambda v: ir.Constant(i64, v)  # noqa: E731
            qs, weights, wscales, scales, corrs = _operands(context, builder, sig, args, rows)
            entry, loop, done = _open_loop(builder, f"int8_tile_{rows}", count)
            g, accs = builder.phi(i64), [builder.phi(fvec) for _ in range(rows)]
            sums, odd_sums = [], []
            for r in range(rows):
                sums.append(_splat_word(builder, builder.load(builder.gep(corrs[r], [g])), TILE))
                odd_sums.append(ir.Constant(ivec, [0] * TILE))
            wg = builder.gep(weights, [builder.mul(g, c(GROUP * TILE))])
            _prefetch_group(builder, wg, ahead)
            for quad in range(GROUP // 4):
                wv = builder.load(builder.bitcast(builder.gep(wg, [c(quad * 4 * TILE)]), ivec.as_pointer()), align=1)
                for r in range(rows):
                    at_q = builder.gep(qs[r], [builder.add(builder.mul(g, c(GROUP)), c(quad * 4))])
                    splat = _splat_word(builder, builder.load(builder.bitcast(at_q, i32.as_pointer()), align=1), TILE)
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
            _store_rows(context, builder, sig, args, results, TILE, 0)
            return context.get_dummy_value()

        return _tile_signature(out, q, w, sw, scale, corr), codegen

    return tile


def _avx2_micro_tile_of(rows: int):  # type: ignore[no-untyped-def]
    """The same product as ``_micro_tile_of``'s, in AVX2 instructions: each 16-output tile in two halves of 8
    int32 lanes. ``vpmaddubsw`` multiplies u8 by s8 and adds pairs into int16, which saturates for
    u8 weights (255 x 127 x 2), so this kernel takes llama.cpp's sign trick instead: the weight
    bytes back to s8 (``q + 128`` xor 0x80), the activation's sign moved onto them (``vpsignb``), and
    ``|x|`` (at most 127) as the unsigned side: |x| * sign(x) * w, pairs at most 2 x 127 x 127 < 2^15.
    ``vpmaddwd`` by ones then adds the pairs into int32. No corrections: nothing is offset, and the argument
    the VNNI tile takes them in brings ``|q|`` instead (``q``'s layout), computed once per call rather than
    by a ``vpabsb`` per row, quad and tile (5-7% of the kernel's time at 64-256 rows)."""

    @intrinsic
    def tile(typingctx, out, out_at, out_stride, q, q_at, w, w_at, ahead, sw, sw_at, scale, corr, at,
             groups):  # type: ignore[no-untyped-def]
        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            ahead, count = args[7], args[13]
            i8, i16, i32, i64, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
            half = TILE // 2
            bytes_, pairs, ivec, fvec = (ir.VectorType(i8, 32), ir.VectorType(i16, 16), ir.VectorType(i32, half),
                                         ir.VectorType(f32, half))
            fn = lambda name, ret, *params: cgutils.get_or_insert_function(  # noqa: E731
                builder.module, ir.FunctionType(ret, list(params)), name)
            madd_bytes = fn("llvm.x86.avx2.pmadd.ub.sw", pairs, bytes_, bytes_)
            madd_pairs = fn("llvm.x86.avx2.pmadd.wd", ivec, pairs, pairs)
            sign = fn("llvm.x86.avx2.psign.b", bytes_, bytes_, bytes_)
            ones, flip = ir.Constant(pairs, [1] * 16), ir.Constant(bytes_, [-WEIGHT_ZERO_POINT] * 32)
            c = lambda v: ir.Constant(i64, v)  # noqa: E731
            qs, weights, wscales, scales, _ = _operands(context, builder, sig, args, rows)
            mag_at = builder.gep(_data(context, builder, sig.args[11], args[11]), [args[4]])  # |q|: q's layout
            mags = [builder.gep(mag_at, [builder.mul(builder.mul(count, c(GROUP)), c(r))]) for r in range(rows)]
            entry, loop, done = _open_loop(builder, f"int8_avx2_tile_{rows}", count)
            g = builder.phi(i64)
            accs = [[builder.phi(fvec) for _ in range(2)] for _ in range(rows)]
            sums = [[ir.Constant(ivec, None) for _ in range(2)] for _ in range(rows)]
            wg = builder.gep(weights, [builder.mul(g, c(GROUP * TILE))])
            _prefetch_group(builder, wg, ahead)
            for quad in range(GROUP // 4):
                signed = [builder.xor(builder.load(builder.bitcast(builder.gep(wg, [c(quad * 4 * TILE + h * 32)]),
                                                                   bytes_.as_pointer()), align=1), flip)
                          for h in range(2)]
                for r in range(rows):
                    offset = builder.add(builder.mul(g, c(GROUP)), c(quad * 4))
                    xv, magnitude = (builder.bitcast(_splat_word(builder, builder.load(
                        builder.bitcast(builder.gep(base, [offset]), i32.as_pointer()), align=1), half), bytes_)
                        for base in (qs[r], mags[r]))
                    for h in range(2):
                        products = builder.call(madd_bytes, [magnitude, builder.call(sign, [signed[h], xv])])
                        sums[r][h] = builder.add(sums[r][h], builder.call(madd_pairs, [products, ones]))
            totals = []
            for h in range(2):
                swv = builder.load(builder.bitcast(builder.gep(wscales, [builder.add(builder.mul(g, c(TILE)), c(h * half))]),
                                                   fvec.as_pointer()), align=4)
                for r in range(rows):
                    scale_r = _splat_word(builder, builder.bitcast(builder.load(builder.gep(scales[r], [g])), i32), half)
                    both = builder.fmul(swv, builder.bitcast(scale_r, fvec), flags=("fast",))
                    term = builder.fmul(builder.sitofp(sums[r][h], fvec), both, flags=("fast",))
                    totals.append(builder.fadd(accs[r][h], term, flags=("fast",)))
            flat = [accs[r][h] for h in range(2) for r in range(rows)]
            results = _close_loop(builder, g, 1, count, flat, totals, entry, loop, done)
            for h in range(2):
                _store_rows(context, builder, sig, args, results[h * rows:(h + 1) * rows], half, h * half)
            return context.get_dummy_value()

        return _tile_signature(out, q, w, sw, scale, corr), codegen

    return tile


_tile_1, _tile_2, _tile_3, _tile_4, _tile_5, _tile_rows = (_micro_tile_of(rows) for rows in (1, 2, 3, 4, 5, ROWS))

@njit(inline="always")
def _rows_next(left, most):  # type: ignore[no-untyped-def]
    """Rows of the next micro-tile when ``left`` rows remain and a tile holds at most ``most``: full tiles, then the
    last three tiles' worth in as few tiles as that allows, as even as can be (14 rows by 6: 5, 5, 4; by 4: 4, 4, 3, 3).
    Why: a tile of one or two rows keeps few sums in flight and re-reads the weights for few rows, so it costs nearly
    what a full one does; with 6, 4, 2 and 1 only, the bf16 kernel's 9, 11 and 15 rows took 10-13% longer here, the
    bf16-held kernel's 3, 7 and 15 rows 9-17% longer, and this kernel's LM head (49,152 outputs) at 9-15 rows 6-11%
    longer (docs/kernels.md)."""
    if left > 3 * most:  # full tiles until the last few: two divisions a tile cost prompt chunks 2-5%
        return most
    return -(-left // -(-left // most))
_avx2_tile_1, _avx2_tile_rows = (_avx2_micro_tile_of(rows) for rows in (1, ROWS_AVX2))


@njit(inline="always", boundscheck=False)
def _tiles(m, t, ahead, out, q, packed, wscales, scale, corr):  # type: ignore[no-untyped-def]
    """Output tile ``t`` for all ``m`` rows, in micro-tiles of at most ``ROWS`` rows (``_rows_next``)."""
    n, groups = out.shape[1], wscales.shape[1]
    w_at, s_at = t * packed.shape[1] * TILE * 4, t * groups * TILE
    m0 = 0
    while m0 < m:
        take = _rows_next(m - m0, ROWS)
        at_out, at_q, at_scale = m0 * n + t * TILE, m0 * groups * GROUP, m0 * groups
        if take == ROWS:
            _tile_rows(out, at_out, n, q, at_q, packed, w_at, ahead, wscales, s_at, scale, corr, at_scale, groups)
        elif take == 5:
            _tile_5(out, at_out, n, q, at_q, packed, w_at, ahead, wscales, s_at, scale, corr, at_scale, groups)
        elif take == 4:
            _tile_4(out, at_out, n, q, at_q, packed, w_at, ahead, wscales, s_at, scale, corr, at_scale, groups)
        elif take == 3:
            _tile_3(out, at_out, n, q, at_q, packed, w_at, ahead, wscales, s_at, scale, corr, at_scale, groups)
        elif take == 2:
            _tile_2(out, at_out, n, q, at_q, packed, w_at, ahead, wscales, s_at, scale, corr, at_scale, groups)
        else:
            _tile_1(out, at_out, n, q, at_q, packed, w_at, ahead, wscales, s_at, scale, corr, at_scale, groups)
        m0 += take


@njit(inline="always", boundscheck=False)
def _avx2_tiles(m, t, ahead, out, q, packed, wscales, scale, magnitude):  # type: ignore[no-untyped-def]
    """``_tiles`` with the AVX2 micro-tiles: ``ROWS_AVX2`` rows at a time, then 1; they take ``|q|`` where the
    VNNI ones take the corrections."""
    n, groups = out.shape[1], wscales.shape[1]
    w_at, s_at = t * packed.shape[1] * TILE * 4, t * groups * TILE
    for m0 in range(0, m, ROWS_AVX2):
        if m - m0 >= ROWS_AVX2:
            _avx2_tile_rows(out, m0 * n + t * TILE, n, q, m0 * groups * GROUP, packed, w_at, ahead, wscales, s_at,
                            scale, magnitude, m0 * groups, groups)
        else:  # the last row or rows, one at a time
            for r in range(m0, m):
                _avx2_tile_1(out, r * n + t * TILE, n, q, r * groups * GROUP, packed, w_at, ahead, wscales, s_at,
                             scale, magnitude, r * groups, groups)


@njit(inline="always", fastmath={"nnan", "ninf", "nsz"}, boundscheck=False)
def _quantize_input(x, i, k, gated, q, scale, corr):  # type: ignore[no-untyped-def]
    """Row ``i`` of the GEMM's input into ``q``/``scale``/``corr``: ``x[i]``, or ``silu(gate) * up`` when gated."""
    if gated:
        values = np.empty(k, np.float32)
        for j in range(k):
            values[j] = _silu(_as_f32(x[i, j])) * _as_f32(x[i, k + j])
        _quantize_row(values, q[i], scale[i], corr[i], k)
    else:
        _quantize_row(x[i], q[i], scale[i], corr[i], k)


@njit(inline="always", boundscheck=False)
def _scratch(x, wscales, gated):  # type: ignore[no-untyped-def]
    """The quantized input's arrays, allocated inside the compiled call: each array made in Python costs ~1 us, and
    decode makes 120 of these calls a step. Returns ``(q, scale, corr, k)``."""
    m, k, groups = x.shape[0], x.shape[1] // 2 if gated else x.shape[1], wscales.shape[1]
    return (np.empty((m, groups * GROUP), np.int8), np.empty((m, groups), np.float32),
            np.empty((m, groups), np.int32), k)


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def _linear(x, packed, wscales, out, gated):  # type: ignore[no-untyped-def]
    """``out [M, N]`` = ``x [M, K]`` times the packed weight (float32, or bf16 bits as int16, both); ``gated``:
    ``x`` is ``[M, 2K]``, gate and up side by side, and the input is ``silu(gate) * up`` (in float32)."""
    q, scale, corr, k = _scratch(x, wscales, gated)
    for i in prange(x.shape[0]):
        _quantize_input(x, i, k, gated, q, scale, corr)
    for t in prange(packed.shape[0]):
        _tiles(x.shape[0], t, packed.shape[1] * TILE * 4 if t + 1 < packed.shape[0] else 0, out, q, packed, wscales,
               scale, corr)


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def _linear_avx2(x, packed, wscales, out, gated):  # type: ignore[no-untyped-def]
    """``_linear`` through the AVX2 micro-tiles (a function of its own: numba compiles all that a function calls,
    and LLVM cannot compile ``vpdpbusd`` for an AVX2-only CPU)."""
    q, scale, corr, k = _scratch(x, wscales, gated)
    magnitude = np.empty_like(q)  # |q|, vpmaddubsw's unsigned side: one pass here, not one vpabsb per row and tile
    for i in prange(x.shape[0]):
        _quantize_input(x, i, k, gated, q, scale, corr)
        for j in range(q.shape[1]):
            magnitude[i, j] = abs(q[i, j])
    for t in prange(packed.shape[0]):
        _avx2_tiles(x.shape[0], t, packed.shape[1] * TILE * 4 if t + 1 < packed.shape[0] else 0, out, q, packed,
                    wscales, scale, magnitude)
