"""float32 rows times bf16 weights, float32 products and sums: the projections of a float32 engine on CPUs without
native bf16 (AVX2 + FMA), from half the bytes.

Why: where the CPU has no bf16 instructions the engine runs float32 (``cloud.engine.model_runner.resolve_dtype``),
and a decode step of SmolLM2-135M then streams 424 MB of float32 weights through torch's sgemm, which at decode's
1-16 rows is also far from its compute rate. Stored as bf16 the weights are 212 MB; widened in registers (a bf16
is the top half of a float32: one shift or one mask), every product and sum stays float32. The activations, the
KV cache, norms and attention are the float32 engine's; only the weights are rounded, to what the bf16 engine
holds on AVX-512-bf16 hosts.

Layout: ``cpu_bf16_gemm``'s (``pack``: ``[N / 16, K / 2, 16, 2]`` bf16 bits, N padded to 16 and K to 32): one
64-byte vector holds inputs ``2p`` and ``2p + 1`` of 16 outputs, as 16 words whose low half is input ``2p``.
Per row, each output's sum is one chain of fused multiply-adds in input order (``llvm.fma``), whatever the micro-tile
(4, 3, 2 or 1 rows) a row lands in: a row's outputs do not depend on the other rows of the call (the float32 engine
through sgemm does not promise that; docs/engine.md). The bias is added once after the sum.

Which hosts: any x86-64 CPU numba compiles AVX2 and FMA for (``available``).
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

from apiary.kernels.cpu_attention import LANES, _close_loop, _data, _numba_target_features, _open_loop, _splat
from apiary.kernels import cpu_bf16_gemm
from apiary.kernels.cpu_bf16_gemm import CHUNK, PackedBF16
from apiary.kernels.cpu_int8_gemm import TILE, _prefetch_group, _rows_next, _silu, _store_rows
from apiary.kernels.errors import KernelError

assert LANES == TILE
ROWS = 4  # rows per micro-tile at most (``cpu_int8_gemm._rows_next``): 4 accumulators of 16 lanes, 8 AVX2 registers
FEATURES = ("avx2", "fma")  # LLVM's names for what the widened products need

__all__ = ["Bound", "HeldBF16", "available", "linear", "pack", "reference"]


@dataclass(frozen=True, slots=True)
class HeldBF16(PackedBF16):
    """A float32 layer's weight held in bf16, in ``cpu_bf16_gemm``'s layout, its bias float32: the kind a run of layers
    in one call (``cpu_decode_layers``) tells apart from a bf16 layer's weight, whose rows are bf16."""


@functools.cache
def available() -> bool:
    """Whether numba compiles for a CPU with AVX2 and FMA (``NUMBA_CPU_FEATURES`` where set, else the host's)."""
    try:
        features = _numba_target_features()
    except Exception:  # noqa: BLE001 - no feature query: the caller keeps its other path
        return False
    return all(features.get(f, False) for f in FEATURES)


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> HeldBF16:
    """``weight [N, K]`` rounded to bf16 in ``cpu_bf16_gemm.pack``'s layout; ``bias [N]`` kept in float32 (it is added
    to float32 sums, as ``F.linear`` in float32 adds it)."""
    packed = cpu_bf16_gemm.pack(weight)
    exact = np.zeros_like(packed.bias)
    if bias is not None:
        exact[: packed.out_features] = bias.detach().float().numpy()
    return HeldBF16(packed.packed, exact, packed.out_features, packed.in_features)


def linear(x: torch.Tensor, weight: PackedBF16, gated: bool = False) -> torch.Tensor:
    """``x [M, K] @ W.T + bias`` -> ``[M, N]`` float32, ``x`` a 2-D float32 CPU tensor, ``W`` bf16 (packed). ``gated``:
    ``x = [gate | up]`` (``[M, 2K]``) and the input is ``silu(gate) * up`` in float32 (``_swiglu``)."""
    k = weight.in_features
    width = 2 * k if gated else k
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != width or x.device.type != "cpu":
        raise KernelError(f"cpu_bf16w_gemm.linear takes a 2-D CPU float32 tensor of {width} columns, "
                          f"got {tuple(x.shape)} {x.dtype} on {x.device}")
    if not available():
        raise KernelError(f"cpu_bf16w_gemm: this CPU, as numba compiles for it, lacks {', '.join(FEATURES)}")
    m, n = x.shape[0], weight.packed.shape[0] * TILE
    if m == 0:
        return x.new_empty((0, weight.out_features))
    from apiary.kernels.cpu_attention import follow_torch_threads

    follow_torch_threads()
    rows = x.contiguous().numpy()
    padded = weight.packed.shape[1] * 2
    if padded != k and not gated:  # K not a multiple of 32: the kernel reads whole chunks (gated: its scratch is)
        wide = np.zeros((m, padded), np.float32)
        wide[:, :k] = rows
        rows = wide
    out = np.empty((m, n), np.float32)
    _linear(rows, weight.packed, weight.bias, out, gated)
    result = torch.from_numpy(out)
    return result if n == weight.out_features else result[:, : weight.out_features].contiguous()


class Bound(cpu_bf16_gemm.Bound):
    """``linear`` for one packed weight, called as ``f(x, gated=False)``: what a float32 layer with bf16 weights holds
    (``ops.bind_bf16w_linear``), with the weight there for a run of layers to stack (``cpu_decode_layers``)."""

    __slots__ = ()

    def __call__(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        return linear(x, self.weight, gated)


reference = cpu_bf16_gemm.reference  # the exact product in float64 (the bias as packed: float32 here), for tests


# ---------------------------------------------------------------- compiled parts


def _micro_tile_of(rows: int):  # type: ignore[no-untyped-def]
    """The intrinsic ``tile(out, out_at, out_stride, x, x_at, w, w_at, ahead, bias, bias_at, chunks)``:
    ``out.flat[out_at + r * out_stride : … + 16]`` (float32) = row r of ``x`` (float32 from ``x.flat[x_at + r *
    chunks * 32]``) times the 16 outputs whose packed weights start at ``w.flat[w_at]``, plus ``bias.flat[bias_at :
    … + 16]``; the same chunk of the tile ``ahead`` bytes on is prefetched.

    Why LLVM IR: the widening (a shift for the low bf16 of each word, a mask for the high one) and the fused
    multiply-adds must stay in registers, one chain per row in input order, which numba's loops would neither keep
    nor promise."""

    @intrinsic
    def tile(typingctx, out, out_at, out_stride, x, x_at, w, w_at, ahead, bias, bias_at,
             chunks):  # type: ignore[no-untyped-def]
        signature = types.void(out, types.intp, types.intp, x, types.intp, w, types.intp, types.intp, bias, types.intp,
                               types.intp)

        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            _, _, _, x_arr, x_at, w_arr, w_at, ahead, bias_arr, bias_at, count = args
            i8, i32, i64, f32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
            ivec, fvec = ir.VectorType(i32, TILE), ir.VectorType(f32, TILE)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(fvec, [fvec, fvec, fvec]),
                                                 f"llvm.fma.v{TILE}f32")
            c = lambda v: ir.Constant(i64, v)  # noqa: E731
            row_len = builder.mul(count, c(CHUNK))
            xs = [builder.gep(_data(context, builder, sig.args[3], x_arr), [builder.add(x_at, builder.mul(row_len, c(r)))])
                  for r in range(rows)]
            weights = builder.gep(_data(context, builder, sig.args[5], w_arr), [w_at])
            entry, loop, done = _open_loop(builder, f"bf16w_tile_{rows}", count)
            chunk = builder.phi(i64)
            accs = [builder.phi(fvec) for _ in range(rows)]
            wc = builder.gep(weights, [builder.mul(chunk, c(CHUNK * TILE))])
            _prefetch_group(builder, builder.bitcast(wc, i8.as_pointer()), ahead)  # this chunk of the next tile
            shift, high = ir.Constant(ivec, [16] * TILE), ir.Constant(ivec, [-65536] * TILE)  # 0xFFFF0000
            totals = list(accs)
            for pair in range(CHUNK // 2):
                words = builder.load(builder.bitcast(builder.gep(wc, [c(pair * 2 * TILE)]), ivec.as_pointer()), align=2)
                even = builder.bitcast(builder.shl(words, shift), fvec)  # input 2p of each output
                odd = builder.bitcast(builder.and_(words, high), fvec)  # input 2p + 1
                for r in range(rows):
                    at = builder.add(builder.mul(chunk, c(CHUNK)), c(pair * 2))
                    x0 = _splat(builder, builder.load(builder.gep(xs[r], [at])))
                    x1 = _splat(builder, builder.load(builder.gep(xs[r], [builder.add(at, c(1))])))
                    totals[r] = builder.call(fma, [odd, x1, builder.call(fma, [even, x0, totals[r]])])
            results = _close_loop(builder, chunk, 1, count, accs, totals, entry, loop, done)
            bias_v = builder.load(builder.bitcast(builder.gep(_data(context, builder, sig.args[8], bias_arr), [bias_at]),
                                                  fvec.as_pointer()), align=4)
            _store_rows(context, builder, sig, args, [builder.fadd(result, bias_v) for result in results], TILE, 0)
            return context.get_dummy_value()

        return signature, codegen

    return tile


_tile_rows, _tile_3, _tile_2, _tile_1 = (_micro_tile_of(rows) for rows in (ROWS, 3, 2, 1))


@njit(cache=True, boundscheck=False, nogil=True)
def _linear(x, packed, bias, out, gated):  # type: ignore[no-untyped-def]
    """``out [M, Np]`` = ``x [M, Kp]`` (float32) times the packed weight, plus ``bias``. ``gated``: ``x`` is ``[M, 2K]``,
    gate and up side by side, and the input is ``silu(gate) * up`` (``_swiglu``). The signature a run of layers calls
    (``cpu_decode_layers``), as ``cpu_bf16_gemm._linear``'s."""
    if gated:
        src = np.zeros((x.shape[0], packed.shape[1] * 2), np.float32)
        _swiglu(x, src)
        _tiles(src, packed, bias, out)
    else:
        _tiles(x, packed, bias, out)


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def _swiglu(x, out):  # type: ignore[no-untyped-def]
    """``out[:, :K]`` = ``silu(gate) * up`` for ``x = [gate | up]``, in float32 (``cpu_int8_gemm._silu``)."""
    k = x.shape[1] // 2
    for i in prange(x.shape[0]):
        for j in range(k):
            out[i, j] = _silu(x[i, j]) * x[i, k + j]


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def _tiles(x, packed, bias, out):  # type: ignore[no-untyped-def]
    """Every 16-output tile of ``out [M, Np]`` (float32) over all rows of ``x [M, Kp]`` (float32), the tiles spread
    over the threads."""
    m, n, tiles = x.shape[0], out.shape[1], packed.shape[0]
    chunks = x.shape[1] // CHUNK
    tile_elems = packed.shape[1] * TILE * 2
    for t in prange(tiles):
        w_at = t * tile_elems
        ahead = tile_elems * 2 if t + 1 < tiles else 0  # bytes to the next tile's same chunk
        m0 = 0
        while m0 < m:
            take = _rows_next(m - m0, ROWS)
            if take == ROWS:
                _tile_rows(out, m0 * n + t * TILE, n, x, m0 * x.shape[1], packed, w_at, ahead, bias, t * TILE, chunks)
            elif take == 3:
                _tile_3(out, m0 * n + t * TILE, n, x, m0 * x.shape[1], packed, w_at, ahead, bias, t * TILE, chunks)
            elif take == 2:
                _tile_2(out, m0 * n + t * TILE, n, x, m0 * x.shape[1], packed, w_at, ahead, bias, t * TILE, chunks)
            else:
                _tile_1(out, m0 * n + t * TILE, n, x, m0 * x.shape[1], packed, w_at, ahead, bias, t * TILE, chunks)
            m0 += take
