"""bf16 GEMM for CPUs with AVX-512 BF16 (``vdpbf16ps``): the engine's bf16 projections, at every batch size.

Why: oneDNN's bf16 linear (weights prepacked, ``cloud.engine.linear``) reads a decode step's weights at
10-12 GB/s on the 2-core Zen 4 host with the engine's passive OpenMP waits: 30 layers of SmolLM2-135M's
projections at 14 rows took 19.4 ms, this kernel 11.7 ms (1.67x; 1.6-1.9x at 1-16 rows, 1.2x at 64:
``apiary bench gemm``, docs/kernels.md "bf16 GEMM"). Decode steps of a bf16 engine are mostly these
projections, so this is the default engine's decode speed. At prompt sizes (384 rows) both run at the
bf16 floor's rate (418 against 393 GFLOP/s), so one kernel serves every batch size.

The product: ``vdpbf16ps`` takes 16 float32 lanes (16 outputs) and adds to each two bf16 x bf16 products, a
weight pair and the same activation pair broadcast to every lane. Products of two bf16 are exact in
float32 and the sums stay float32 until the one rounding to bf16 at the end (nearest even), as oneDNN's
bf16 kernels do; the order of the sums differs, so about 0.02% of outputs land one bf16 ulp from
``F.linear``'s (never further: the tests bound each output by the exactly rounded result's neighbours).
Bias (float32, from the weight's dtype) is added once before that rounding, as ``F.linear`` does.

Layout: weights ``[N / 16, K / 2, 16, 2]`` bf16 bits (for each 16 outputs and 2 inputs, one 64-byte
vector), N padded to 16 and K to 32 with zeros. A work item is 16 outputs for every row, in micro-tiles
of at most ``ROWS`` rows, so a tile's weights are read from memory once per call; while 32 inputs of a
tile compute, the same 32 of the next tile are asked for (16 prefetches of 64 bytes), as in
``cpu_int8_gemm``. More rows per micro-tile (7, 8, 14, 16), two or four tiles ahead measured the same.

Which hosts: where numba compiles for ``avx512bf16`` (with ``avx512f`` and ``avx512bw``); elsewhere the
engine keeps oneDNN or ``F.linear`` (``available``).
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
from apiary.kernels.cpu_attention import (_as_f32, _close_loop, _data, _numba_target_features, _open_loop,
                                          follow_torch_threads)
from apiary.kernels.cpu_int8_gemm import GROUP, TILE, _prefetch_group, _rows_next, _silu, _splat_word, _store_rows
from apiary.kernels.cpu_layers import _store
from apiary.kernels.errors import KernelError

# inputs per step of a micro-tile's loop: 16 weight vectors (1 KB, as one group of the int8 kernel's tile), the
# unit of prefetching (``cpu_int8_gemm._prefetch_group``'s 16 lines)
CHUNK = 32
assert CHUNK * 2 == GROUP
ROWS = 6  # rows per micro-tile at most (``_rows_next``: 5 to 1 as well): 2 x 6 accumulators, two chains per row
FEATURES = ("avx512f", "avx512bw", "avx512bf16")  # LLVM's names for what vdpbf16ps needs


@functools.cache
def available() -> bool:
    """Whether numba compiles for a CPU with ``vdpbf16ps`` (``NUMBA_CPU_FEATURES`` where set, else the host's).
    Calling the kernel on a CPU without it would kill the process with an illegal instruction."""
    try:
        features = _numba_target_features()
    except Exception:  # noqa: BLE001 - no feature query: the caller keeps its other path
        return False
    return all(features.get(f, False) for f in FEATURES)


@dataclass(frozen=True, slots=True)
class PackedBF16:
    """A linear layer's bf16 weight (and bias) in the kernel's layout."""

    packed: np.ndarray  # [N / 16, Kp / 2, 16, 2] int16: bf16 bits
    bias: np.ndarray  # [Np] float32 (zeros without a bias)
    out_features: int
    in_features: int

    def unpacked(self) -> torch.Tensor:
        """The bf16 ``[N, K]`` weight (tests)."""
        tiles, pairs = self.packed.shape[:2]
        bits = torch.from_numpy(self.packed).permute(0, 2, 1, 3).reshape(tiles * TILE, pairs * 2)
        return bits.view(torch.bfloat16)[: self.out_features, : self.in_features].contiguous()


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedBF16:
    """``weight [N, K]`` (and ``bias [N]``) as bf16 in the kernel's layout (zeros pad N to 16, K to 32)."""
    rows, k = weight.shape
    n, padded = -(-rows // TILE) * TILE, -(-k // CHUNK) * CHUNK
    w = torch.zeros(n, padded, dtype=torch.bfloat16)
    w[:rows, :k] = weight.to(torch.bfloat16)
    packed = huge_pages.copy(w.view(torch.int16).view(n // TILE, TILE, padded // 2, 2).permute(0, 2, 1, 3))
    b = torch.zeros(n, dtype=torch.float32)
    if bias is not None:
        b[:rows] = bias.to(torch.bfloat16).float()  # F.linear adds the bias in the weight's dtype
    return PackedBF16(packed, b.numpy(), rows, k)


def linear(x: torch.Tensor, weight: PackedBF16, gated: bool = False) -> torch.Tensor:
    """``x [M, K] @ W.T + bias`` -> ``[M, N]`` bf16, ``x`` a 2-D bf16 CPU tensor. ``gated``: ``x = [gate | up]``
    (``[M, 2K]``) and the input is ``silu(gate) * up``, each rounded to bf16 as ``F.silu(gate) * up`` rounds."""
    k = weight.in_features
    width = 2 * k if gated else k
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != width or x.device.type != "cpu":
        raise KernelError(f"cpu_bf16_gemm.linear takes a 2-D CPU bfloat16 tensor of {width} columns, "
                          f"got {tuple(x.shape)} {x.dtype} on {x.device}")
    if not available():
        raise KernelError(f"cpu_bf16_gemm: this CPU, as numba compiles for it, lacks {', '.join(FEATURES)}")
    m, n = x.shape[0], weight.packed.shape[0] * TILE
    if m == 0:
        return x.new_empty((0, weight.out_features))
    follow_torch_threads()
    bits = x.contiguous().view(torch.int16).numpy()
    padded = weight.packed.shape[1] * 2
    if padded != k and not gated:  # K not a multiple of 32: the kernel reads whole chunks (gated: its scratch is)
        wide = np.zeros((m, padded), np.int16)
        wide[:, :k] = bits
        bits = wide
    out = np.empty((m, n), np.int16)
    _linear(bits, weight.packed, weight.bias, out, gated)
    result = torch.from_numpy(out).view(torch.bfloat16)
    return result if n == weight.out_features else result[:, : weight.out_features].contiguous()


class Bound:
    """``linear`` for one packed weight, called as ``f(x, gated=False)``: what a layer holds
    (``ops.bind_bf16_linear``), with the weight there for a run of layers to stack (``cpu_decode_layers``)."""

    __slots__ = ("weight",)

    def __init__(self, weight: PackedBF16) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        return linear(x, self.weight, gated)


def reference(x: torch.Tensor, weight: PackedBF16) -> torch.Tensor:
    """The exact product in float64 (before the kernel's one rounding to bf16), for tests."""
    w = weight.unpacked().double()
    return x.double() @ w.t() + torch.from_numpy(weight.bias[: weight.out_features]).double()


# ---------------------------------------------------------------- compiled parts


class _BFloat(ir.Type):
    """LLVM's ``bfloat``, which llvmlite's IR builder does not spell: ``vdpbf16ps``'s operands are ``<32 x bfloat>``."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


def _micro_tile_of(rows: int):  # type: ignore[no-untyped-def]
    """The intrinsic ``tile(out, out_at, out_stride, x, x_at, w, w_at, ahead, bias, bias_at, chunks)``:
    ``out.flat[out_at + r * out_stride : … + 16]`` (bf16 bits, rounded to nearest even) = row r of ``x`` (bf16
    bits from ``x.flat[x_at + r * chunks * 32]``, ``chunks * 32`` of them) times the 16 outputs whose packed
    weights start at ``w.flat[w_at]``, plus ``bias.flat[bias_at : … + 16]``; the same chunk of the tile
    ``ahead`` bytes on is prefetched.

    Why LLVM IR: ``vdpbf16ps`` has no numba spelling, and the accumulators must stay in registers. Two
    chains per row (even and odd input pairs) keep ``rows`` x 2 products in flight."""

    @intrinsic
    def tile(typingctx, out, out_at, out_stride, x, x_at, w, w_at, ahead, bias, bias_at,
             chunks):  # type: ignore[no-untyped-def]
        signature = types.void(out, types.intp, types.intp, x, types.intp, w, types.intp, types.intp, bias, types.intp,
                               types.intp)

        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            _, _, _, x_arr, x_at, w_arr, w_at, ahead, bias_arr, bias_at, count = args
            i8, i32, i64, f32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
            fvec, bvec = ir.VectorType(f32, TILE), ir.VectorType(_BFloat(), 2 * TILE)
            dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(fvec, [fvec, bvec, bvec]),
                                                 "llvm.x86.avx512bf16.dpbf16ps.512")
            c = lambda v: ir.Constant(i64, v)  # noqa: E731
            row_len = builder.mul(count, c(CHUNK))
            xs = [builder.gep(_data(context, builder, sig.args[3], x_arr), [builder.add(x_at, builder.mul(row_len, c(r)))])
                  for r in range(rows)]
            weights = builder.gep(_data(context, builder, sig.args[5], w_arr), [w_at])
            entry, loop, done = _open_loop(builder, f"bf16_tile_{rows}", count)
            chunk = builder.phi(i64)
            accs = [builder.phi(fvec) for _ in range(2 * rows)]  # row r: 2r (even pairs), 2r + 1 (odd pairs)
            wc = builder.gep(weights, [builder.mul(chunk, c(CHUNK * TILE))])
            _prefetch_group(builder, builder.bitcast(wc, i8.as_pointer()), ahead)  # this chunk of the next tile
            totals = list(accs)
            for pair in range(CHUNK // 2):
                wv = builder.load(builder.bitcast(builder.gep(wc, [c(pair * 2 * TILE)]), bvec.as_pointer()), align=2)
                for r in range(rows):
                    at = builder.gep(xs[r], [builder.add(builder.mul(chunk, c(CHUNK)), c(pair * 2))])
                    word = builder.load(builder.bitcast(at, i32.as_pointer()), align=2)
                    xv = builder.bitcast(_splat_word(builder, word, TILE), bvec)
                    slot = 2 * r + pair % 2
                    totals[slot] = builder.call(dot, [totals[slot], wv, xv])
            results = _close_loop(builder, chunk, 1, count, accs, totals, entry, loop, done)
            bias_v = builder.load(builder.bitcast(builder.gep(_data(context, builder, sig.args[8], bias_arr), [bias_at]),
                                                  fvec.as_pointer()), align=4)
            sums = [builder.fadd(builder.fadd(results[2 * r], results[2 * r + 1]), bias_v) for r in range(rows)]
            _store_rows(context, builder, sig, args, sums, TILE, 0)
            return context.get_dummy_value()

        return signature, codegen

    return tile


_tile_rows, _tile_5, _tile_4, _tile_3, _tile_2, _tile_1 = (_micro_tile_of(rows) for rows in (ROWS, 5, 4, 3, 2, 1))


@njit(cache=True, boundscheck=False, nogil=True)
def _linear(x, packed, bias, out, gated):  # type: ignore[no-untyped-def]
    """``out [M, Np]`` (bf16 bits) = ``x [M, Kp]`` (bf16 bits) times the packed weight, plus ``bias``. ``gated``:
    ``x`` is ``[M, 2K]``, gate and up side by side, and the input is ``silu(gate) * up`` (``_swiglu``)."""
    if gated:
        src = np.zeros((x.shape[0], packed.shape[1] * 2), np.int16)
        _swiglu(x, src)
        _tiles(src, packed, bias, out)
    else:
        _tiles(x, packed, bias, out)


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def _swiglu(x, out):  # type: ignore[no-untyped-def]
    """``out[:, :K]`` = ``silu(gate) * up`` for ``x = [gate | up]`` (bf16 bits): silu rounded to bf16, then the
    product, as ``F.silu(gate) * up`` rounds on bf16 tensors."""
    k = x.shape[1] // 2
    for i in prange(x.shape[0]):
        for j in range(k):
            silu = _as_f32(_store(out, _silu(_as_f32(x[i, j]))))
            out[i, j] = _store(out, silu * _as_f32(x[i, k + j]))


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def _tiles(x, packed, bias, out):  # type: ignore[no-untyped-def]
    """Every 16-output tile of ``out`` over all rows of ``x``, the tiles spread over the threads."""
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
            elif take == 5:
                _tile_5(out, m0 * n + t * TILE, n, x, m0 * x.shape[1], packed, w_at, ahead, bias, t * TILE, chunks)
            elif take == 4:
                _tile_4(out, m0 * n + t * TILE, n, x, m0 * x.shape[1], packed, w_at, ahead, bias, t * TILE, chunks)
            elif take == 3:
                _tile_3(out, m0 * n + t * TILE, n, x, m0 * x.shape[1], packed, w_at, ahead, bias, t * TILE, chunks)
            elif take == 2:
                _tile_2(out, m0 * n + t * TILE, n, x, m0 * x.shape[1], packed, w_at, ahead, bias, t * TILE, chunks)
            else:
                _tile_1(out, m0 * n + t * TILE, n, x, m0 * x.shape[1], packed, w_at, ahead, bias, t * TILE, chunks)
            m0 += take
