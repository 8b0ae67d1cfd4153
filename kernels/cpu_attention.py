"""Paged attention for CPUs in numba (decode, verifications, prompt chunks): each cached K/V row read once.

Why: the torch reference (``apiary.kernels.reference``) gathers every sequence's K/V into a padded
copy and then runs two batched matmuls over it: the whole cache is read, written, and read
again, padding included. On the 2-core dev machine a 63-sequence decode step spent ~40% of its
time there. This kernel walks each sequence's block table instead, and keeps scores, softmax
and the weighted sum in fp32 registers and a small per-sequence buffer: one pass over K, one
over V, no copy. Measured in isolation on 30 layers of a 63-sequence batch: ~2x faster than
the reference at 2 threads.

Why numba: Triton has no CPU backend, and a C++ extension would need a compiler wherever the
engine runs. numba compiles through its bundled LLVM (no toolchain) and caches the machine code
next to this file, so only the first process pays the ~3 s compile. ``apiary.kernels.ops`` serves
CPU decode attention from here (``decode_backend``) and imports this module only on first use, so
``import apiary.kernels`` loads no numba (the engine sets numba's and OpenMP's thread settings first).

Semantics are ``apiary.kernels.ops.paged_decode_attention``'s: caches ``[num_blocks, block_size, Hkv,
D]``, query head ``h`` reads KV head ``h // (Hq // Hkv)``, a sequence sees its
``context_lens[b]`` cached tokens (only the last ``sliding_window`` of them with a window), and
a sequence with no tokens yields zeros. bfloat16 and float32 caches are supported, and int8 caches
with their per-token, per-KV-head float32 scales (``EngineConfig(kv_cache_dtype="int8")``): a key's
scale multiplies its dot product once, a value's its probability, so the inner loops only widen
int8 to float32 and read a quarter of float32's bytes. Anything else (or a CUDA tensor)
``apiary.kernels.ops`` routes to the torch reference or Triton.
"""
from __future__ import annotations

import functools

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from apiary.kernels import numba_cache
from apiary.kernels.errors import KernelError

numba_cache.guard_disk_errors()  # every numba kernel module imports this one first

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32, torch.int8)
_NO_SCALES = np.ones((1, 1, 1), np.float32)  # float caches: the kernel never reads it


@intrinsic
def _bf16_bits_as_f32(typingctx, bits):  # type: ignore[no-untyped-def]
    """int16 holding bfloat16 bits -> the float32 with the same value (bf16 is fp32's top half)."""
    signature = types.float32(types.int16)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        wide = builder.shl(builder.sext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())

    return signature, codegen


def _as_f32(value):  # type: ignore[no-untyped-def]  # pragma: no cover - replaced by the overload in compiled code
    raise NotImplementedError


@overload(_as_f32)
def _as_f32_impl(value):  # type: ignore[no-untyped-def]
    if value == types.int16:
        return lambda value: _bf16_bits_as_f32(value)
    return lambda value: np.float32(value)


@intrinsic
def _i32_bits_as_f32(typingctx, bits):  # type: ignore[no-untyped-def]
    """int32 -> the float32 with the same bits."""
    signature = types.float32(types.int32)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.FloatType())

    return signature, codegen


def follow_torch_threads() -> None:
    """numba's thread count for this calling thread set to torch's (capped at numba's pool): the kernels run on as
    many threads as the engine gave torch. Per calling thread, as numba keeps it (the async engine steps in its own)."""
    want = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)


def _data(context, builder, array_type, array):  # type: ignore[no-untyped-def]
    """The data pointer of a numba array value (float32 elements)."""
    return context.make_array(array_type)(context, builder, array).data


LANES = 16  # one AVX-512 register of float32: the varlen kernel pads each KV head's query rows to a multiple


def _numba_target_features() -> dict[str, bool]:
    """The CPU features numba compiles for: ``NUMBA_CPU_FEATURES`` where the operator set it (``+a,-b``),
    else LLVM's view of the host (what numba itself passes to LLVM)."""
    if numba.config.CPU_FEATURES:
        return {name[1:]: name[0] == "+" for name in numba.config.CPU_FEATURES.split(",") if name[:1] in "+-"}
    from llvmlite import binding

    return dict(binding.get_host_cpu_features())


@functools.cache
def _vector_registers() -> int:
    """How many ``LANES``-lane float32 vectors the registers of the CPU numba compiles for hold: 32 with AVX-512 (32
    zmm), 8 without (AVX2's 16 ymm, two to a vector). The weighted sums keep as many accumulators as fit (see
    ``_lane_sums``): 16 vectors of sums are 32 ymm on AVX2, and LLVM spilled them, a load and a store per FMA."""
    try:
        return 32 if _numba_target_features().get("avx512f", False) else 8
    except Exception:  # noqa: BLE001 - no feature query: assume the narrow registers (correct either way)
        return 8


def _splat(builder, x):  # type: ignore[no-untyped-def]
    """A float32 broadcast to all ``LANES`` lanes of a vector."""
    i32, vec = ir.IntType(32), ir.VectorType(ir.FloatType(), LANES)
    one = builder.insert_element(ir.Constant(vec, ir.Undefined), x, ir.Constant(i32, 0))
    return builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined), ir.Constant(ir.VectorType(i32, LANES), [0] * LANES))


def _open_loop(builder, name, count):  # type: ignore[no-untyped-def]
    """Blocks for a counted loop that runs if ``count > 0``: returns (entry, loop, done), positioned in ``loop``."""
    entry = builder.block
    loop, done = builder.append_basic_block(f"{name}.loop"), builder.append_basic_block(f"{name}.done")
    builder.cbranch(builder.icmp_signed(">", count, ir.Constant(ir.IntType(64), 0)), loop, done)
    builder.position_at_end(loop)
    return entry, loop, done


def _close_loop(builder, counter, step, count, accs, totals, entry, loop, done):  # type: ignore[no-untyped-def]
    """Wire a counted loop's phis (``counter`` by ``step`` up to ``count``; each ``accs[i]`` from zero to
    ``totals[i]``), branch back or out, and return the totals as seen after the loop (zero if it never ran)."""
    i64 = ir.IntType(64)
    following = builder.add(counter, ir.Constant(i64, step))
    counter.add_incoming(ir.Constant(i64, 0), entry)
    counter.add_incoming(following, loop)
    for acc, total in zip(accs, totals):
        acc.add_incoming(ir.Constant(acc.type, None), entry)  # zeros of the accumulator's type
        acc.add_incoming(total, loop)
    builder.cbranch(builder.icmp_signed("<", following, count), loop, done)
    builder.position_at_end(done)
    results = [builder.phi(acc.type) for acc in accs]
    for result, total in zip(results, totals):
        result.add_incoming(ir.Constant(total.type, None), entry)
        result.add_incoming(total, loop)
    return results


def _lane_dots_of(tokens: int):  # type: ignore[no-untyped-def]
    """The intrinsic ``dots(out, out_at, out_stride, q, q_at, q_stride, key, key_at, key_stride, token_stride, n)``:
    for each of ``tokens`` keys u (``token_stride`` elements apart),
    ``out.flat[out_at + u * out_stride : … + 16] = sum_d q.flat[q_at + d * q_stride : … + 16] * key.flat[key_at +
    u * token_stride + d * key_stride]`` for d < n, over C-contiguous float32 arrays: 16 dot products per key,
    one vector FMA per key element, each query vector loaded once for all the keys.

    Why LLVM IR: written as numba loops, the 16 sums either go through memory on every step (LLVM cannot
    prove a local array apart from the queries) or stay scalar; a vector value needs the IR. Why several
    keys: with one, every FMA needed its own load of the query vector, and two loads per FMA held the scores
    at about half the FMA rate; the keys' sums are also the independent chains that hide the FMA latency.
    The arrays themselves are passed (not their addresses) so numba keeps them alive across the call.
    """

    @intrinsic
    def dots(typingctx, out, out_at, out_stride, q, q_at, q_stride, key, key_at, key_stride, token_stride,
             n):  # type: ignore[no-untyped-def]
        signature = types.void(out, types.intp, types.intp, q, types.intp, types.intp, key, types.intp, types.intp,
                               types.intp, types.intp)

        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            out_arr, out_at, out_stride, q_arr, q_at, stride, key_arr, key_at, key_stride, token_stride, count = args
            i64, vec = ir.IntType(64), ir.VectorType(ir.FloatType(), LANES)
            queries = builder.gep(_data(context, builder, sig.args[3], q_arr), [q_at])
            keys = [builder.gep(_data(context, builder, sig.args[6], key_arr),
                                [builder.add(key_at, builder.mul(token_stride, ir.Constant(i64, u)))])
                    for u in range(tokens)]
            entry, loop, done = _open_loop(builder, f"lane_dots_{tokens}", count)
            d, accs = builder.phi(i64), [builder.phi(vec) for _ in range(tokens)]
            row = builder.load(builder.bitcast(builder.gep(queries, [builder.mul(d, stride)]), vec.as_pointer()),
                               align=4)
            offset = builder.mul(d, key_stride)
            totals = [builder.fadd(acc, builder.fmul(row, _splat(builder, builder.load(builder.gep(k, [offset]))),
                                                     flags=("fast",)), flags=("fast",)) for acc, k in zip(accs, keys)]
            results = _close_loop(builder, d, 1, count, accs, totals, entry, loop, done)
            target = builder.gep(_data(context, builder, sig.args[0], out_arr), [out_at])
            for u, result in enumerate(results):
                at = builder.gep(target, [builder.mul(out_stride, ir.Constant(i64, u))])
                builder.store(result, builder.bitcast(at, vec.as_pointer()), align=4)
            return context.get_dummy_value()

        return signature, codegen

    return dots


DOT_TOKENS = 4  # keys per _lane_dots_tokens call (eight measured the same)
_lane_dots_tokens = _lane_dots_of(DOT_TOKENS)
_lane_dots = _lane_dots_of(1)  # the keys left over


def _store_vectors(builder, data, at, vectors):  # type: ignore[no-untyped-def]
    """Store ``LANES``-lane float32 ``vectors`` one after another from ``data[at]`` (an array's element pointer)."""
    target = builder.bitcast(builder.gep(data, [at]), ir.VectorType(ir.FloatType(), LANES).as_pointer())
    for e, vector in enumerate(vectors):
        builder.store(vector, builder.gep(target, [ir.Constant(ir.IntType(64), e)]), align=4)


@intrinsic
def _lane_sums(typingctx, out, out_at, p, p_at, p_stride, v, v_at, v_stride, n):  # type: ignore[no-untyped-def]
    """``out.flat[out_at + 16 e : … + 16] = sum_t p.flat[p_at + t * p_stride : … + 16] * v.flat[v_at + t * v_stride
    + e]`` for e < 16, t < n, over C-contiguous float32 arrays: the weighted sums of 16 value elements for 16
    rows at once, in registers: all 16 in one pass over the tokens with AVX-512, 4 per pass without
    (``_vector_registers``).

    Why: the weighted sum over tokens, done per row, loads and stores its accumulator on every token. Why passes:
    16 vectors of sums are 32 of AVX2's 16 ymm registers, and LLVM spilled them; in passes of 4 (8 ymm) the sums
    stay in registers and each pass reloads the 16 probabilities, a load per two FMAs. Each sum adds the same
    products in the same order either way (bit for bit the same result under the AVX2 rehearsal); prompt attention
    over 16 prompts of ~410 tokens took 0.75x the time there (docs/kernels.md), and AVX-512 keeps its one pass.
    """
    signature = types.void(out, types.intp, p, types.intp, types.intp, v, types.intp, types.intp, types.intp)
    per_pass = LANES if _vector_registers() >= 2 * LANES else 4

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        out_arr, out_at, p_arr, p_at, p_stride, v_arr, v_at, v_stride, count = args
        f32, i64 = ir.FloatType(), ir.IntType(64)
        vec = ir.VectorType(f32, LANES)
        probs = builder.gep(_data(context, builder, sig.args[2], p_arr), [p_at])
        values = builder.gep(_data(context, builder, sig.args[5], v_arr), [v_at])
        results = []
        for first in range(0, LANES, per_pass):
            entry, loop, done = _open_loop(builder, f"lane_sums_{first}", count)
            t = builder.phi(i64)
            accs = [builder.phi(vec) for _ in range(per_pass)]
            p = builder.load(builder.bitcast(builder.gep(probs, [builder.mul(t, p_stride)]), vec.as_pointer()), align=4)
            row = builder.gep(values, [builder.mul(t, v_stride)])
            totals = [builder.fadd(acc, builder.fmul(p, _splat(builder, builder.load(builder.gep(
                row, [ir.Constant(i64, first + e)]))), flags=("fast",)), flags=("fast",)) for e, acc in enumerate(accs)]
            results += _close_loop(builder, t, 1, count, accs, totals, entry, loop, done)
        _store_vectors(builder, _data(context, builder, sig.args[0], out_arr), out_at, results)
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def _lane_max(typingctx, top, scores, n):  # type: ignore[no-untyped-def]
    """``top.flat[:16] = max(top.flat[:16], max_t scores.flat[16 t : 16 t + 16])`` over ``t < n``, lane by lane.

    Why: written as numba loops (``top[lane] = max(top[lane], scores[t, lane])``) the maximum stayed scalar, one
    compare per score: ~20% of ``_runs``' time for a 512-token prompt (docs/kernels.md)."""
    signature = types.void(top, scores, types.intp)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        top_arr, scores_arr, count = args
        i64, vec = ir.IntType(64), ir.VectorType(ir.FloatType(), LANES)
        maxnum = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, vec]), "llvm.maxnum.v16f32")
        target = builder.bitcast(_data(context, builder, sig.args[0], top_arr), vec.as_pointer())
        rows = _data(context, builder, sig.args[1], scores_arr)
        start = builder.load(target, align=4)
        entry, loop, done = _open_loop(builder, "lane_max", count)
        t = builder.phi(i64)
        acc = builder.phi(vec)
        row = builder.load(builder.bitcast(builder.gep(rows, [builder.mul(t, ir.Constant(i64, LANES))]), vec.as_pointer()),
                           align=4)
        following = builder.call(maxnum, [acc, row])
        nxt = builder.add(t, ir.Constant(i64, 1))
        t.add_incoming(ir.Constant(i64, 0), entry)
        t.add_incoming(nxt, loop)
        acc.add_incoming(start, entry)
        acc.add_incoming(following, loop)
        builder.cbranch(builder.icmp_signed("<", nxt, count), loop, done)
        builder.position_at_end(done)
        result = builder.phi(vec)
        result.add_incoming(start, entry)
        result.add_incoming(following, loop)
        builder.store(result, target, align=4)
        return context.get_dummy_value()

    return signature, codegen


@njit(fastmath=True, cache=True, inline="always")
def _exp(x):  # type: ignore[no-untyped-def]
    """exp(x) for x <= 0 in float32 (Cephes' expf: within 2 ulp of ``np.exp``), in plain arithmetic.

    Why: without Intel's SVML (not in numba's wheels) ``np.exp`` compiles to one libm call per element,
    and the softmax's exponentials took ~15% of the kernel. x = n ln 2 + r with |r| <= ln 2 / 2, exp(r)
    by a degree-7 polynomial, 2^n written into the exponent bits; the loop around it vectorises.
    Clamped at -87 (exp(-87) ~ 1.6e-38, still a normal float), far below any weight that counts.
    """
    x = max(x, np.float32(-87.0))
    n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
    r = x - n * np.float32(0.693359375) - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    return (p * r * r + r + np.float32(1.0)) * _i32_bits_as_f32((np.int32(n) + np.int32(127)) << np.int32(23))


PREFETCH_TOKENS = 24  # how far ahead of use a sequence's K/V rows are asked for


@intrinsic
def _prefetch(typingctx, array, at, count):  # type: ignore[no-untyped-def]
    """Ask for the cache lines of ``array.flat[at : at + count]`` ahead of use (``llvm.prefetch``, into L2).

    Why: a sequence's blocks lie anywhere in the pool, so the hardware prefetcher, which follows
    addresses, cannot run ahead into the next block. Over a 30-layer pool (16 sequences of 360 tokens,
    SmolLM2's heads, bf16) decode attention took 12-14 ms from memory against 7 ms with one layer's rows
    in cache. Asking for whole blocks two ahead took 11.0-11.6 ms (a block's K and V rows are 192 lines,
    more than a core keeps in flight); asking for each token's row ``PREFETCH_TOKENS`` tokens ahead
    took 7.6-9.0 ms (1,000 tokens: 30 -> 20 ms). 16, 32 and 48 tokens ahead and L1 or L3 as the target
    measured no better."""
    signature = types.void(array, types.intp, types.intp)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        arr, at, count = args
        i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        itemsize = sig.args[0].dtype.bitwidth // 8
        signature_ir = ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, signature_ir, "llvm.prefetch.p0")
        base = builder.bitcast(builder.gep(_data(context, builder, sig.args[0], arr), [at]), i8.as_pointer())
        nbytes = builder.mul(count, ir.Constant(i64, itemsize))
        entry, loop, done = _open_loop(builder, "prefetch", nbytes)
        offset = builder.phi(i64)
        builder.call(fn, [builder.gep(base, [offset]), ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])
        _close_loop(builder, offset, 64, nbytes, [], [], entry, loop, done)
        return context.get_dummy_value()

    return signature, codegen


@njit(fastmath=True, cache=True, boundscheck=False, inline="always")
def _prefetch_row(cache, scales, quantized, block_tables, b, pos):  # type: ignore[no-untyped-def]
    """Ask for sequence ``b``'s row at position ``pos`` (every KV head's, and its int8 scales)."""
    block_size, num_kv_heads = cache.shape[1], cache.shape[2]
    row = block_tables[b, pos // block_size] * block_size + pos % block_size
    _prefetch(cache, row * num_kv_heads * cache.shape[3], num_kv_heads * cache.shape[3])
    if quantized:
        _prefetch(scales, row * num_kv_heads, num_kv_heads)


@njit(fastmath=True, cache=True, boundscheck=False, inline="always")
def _run_at(cache, scales, quantized, block_tables, b, start, t, n):  # type: ignore[no-untyped-def]
    """Sequence ``b``'s run of rows from position ``start + t`` to the end of its block (or of its ``n``
    positions): ``(block, offset, count)``. Asks for the rows ``PREFETCH_TOKENS`` past the run, and at ``t == 0``
    for the first ``PREFETCH_TOKENS`` as well, so that a pass over the sequence by runs keeps its rows coming."""
    block_size = cache.shape[1]
    if t == 0:
        for u in range(min(n, PREFETCH_TOKENS)):
            _prefetch_row(cache, scales, quantized, block_tables, b, start + u)
    pos = start + t
    offset = pos % block_size
    count = min(block_size - offset, n - t)
    for ahead in range(t + PREFETCH_TOKENS, min(t + count + PREFETCH_TOKENS, n)):
        _prefetch_row(cache, scales, quantized, block_tables, b, start + ahead)
    return block_tables[b, pos // block_size], offset, count


def _widen(builder, array_type, at):  # type: ignore[no-untyped-def]
    """``LANES`` cache elements from the element pointer ``at`` as a float32 vector: bf16 bits (int16) shifted
    into a float's top half, int8 converted (its scale is applied outside), float32 loaded."""
    i32x, f32x = ir.VectorType(ir.IntType(32), LANES), ir.VectorType(ir.FloatType(), LANES)
    dtype = array_type.dtype
    if dtype == types.float32:
        return builder.load(builder.bitcast(at, f32x.as_pointer()), align=4)
    if dtype == types.int16:
        raw = builder.load(builder.bitcast(at, ir.VectorType(ir.IntType(16), LANES).as_pointer()), align=2)
        return builder.bitcast(builder.shl(builder.zext(raw, i32x), ir.Constant(i32x, [16] * LANES)), f32x)
    raw = builder.load(builder.bitcast(at, ir.VectorType(ir.IntType(8), LANES).as_pointer()), align=1)
    return builder.sitofp(raw, f32x)


def _shuffle(builder, a, b, lanes):  # type: ignore[no-untyped-def]
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), len(lanes)), lanes))


def _sums(builder, vectors):  # type: ignore[no-untyped-def]
    """The lane sums of one or four ``LANES``-lane vectors, as a vector of one or four.

    Why four together: one vector's sum is four halvings (a shuffle and an add each) that end in one lane;
    four vectors halve into each other's lanes, so the same shuffles and adds serve four sums (~3.75 operations
    a sum, not 8)."""
    add = functools.partial(builder.fadd, flags=("fast",))
    if len(vectors) == 1:
        v, width = vectors[0], LANES
        while width > 1:
            width //= 2
            v = add(_shuffle(builder, v, v, list(range(width))), _shuffle(builder, v, v, list(range(width, 2 * width))))
        return v
    a, b, c, d = vectors
    low, high = list(range(8)) + list(range(16, 24)), list(range(8, 16)) + list(range(24, 32))
    ab = add(_shuffle(builder, a, b, low), _shuffle(builder, a, b, high))  # lanes 0-7: a's, 8-15: b's
    cd = add(_shuffle(builder, c, d, low), _shuffle(builder, c, d, high))
    quarters = [[q * 8 + i for i in range(4)] for q in range(4)]  # ab's and cd's halves, by quarter
    low4 = [i for q in quarters for i in q]
    high4 = [i + 4 for i in low4]
    v = add(_shuffle(builder, ab, cd, low4), _shuffle(builder, ab, cd, high4))  # 4 lanes each: a, b, c, d
    v = add(_shuffle(builder, v, v, [0, 1, 4, 5, 8, 9, 12, 13]), _shuffle(builder, v, v, [2, 3, 6, 7, 10, 11, 14, 15]))
    return add(_shuffle(builder, v, v, [0, 2, 4, 6]), _shuffle(builder, v, v, [1, 3, 5, 7]))


def bf16_dots() -> bool:
    """Whether numba compiles ``vdpbf16ps`` here (``cpu_bf16_gemm.available``): bf16 caches' dot products then take it."""
    from apiary.kernels import cpu_bf16_gemm

    return cpu_bf16_gemm.available()


def _bf16_dot(builder):  # type: ignore[no-untyped-def]
    """``llvm.x86.avx512bf16.dpbf16ps.512`` in this module, and its ``<32 x bfloat>`` operand type."""
    from apiary.kernels.cpu_bf16_gemm import _BFloat

    f32x, bfx = ir.VectorType(ir.FloatType(), LANES), ir.VectorType(_BFloat(), 2 * LANES)
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32x, [f32x, bfx, bfx]),
                                          "llvm.x86.avx512bf16.dpbf16ps.512"), bfx


def _literal(value_type, name: str) -> int:
    """A compile-time argument of an intrinsic (a closure's constant, typed as a literal): its value."""
    if not isinstance(value_type, types.IntegerLiteral):
        raise numba.core.errors.TypingError(f"{name} must be a compile-time constant, got {value_type}")
    return value_type.literal_value


@intrinsic
def _group_dots(typingctx, scores, s_at, s_stride, q, q_at, key, key_at, token_stride, n, group, head_dim,
                tokens, scale):  # type: ignore[no-untyped-def]
    """``_group_dots(scores, s_at, s_stride, q, q_at, key, key_at, token_stride, n, group, head_dim, tokens, scale)``:
    for each of ``n`` keys u (``token_stride`` elements apart; ``n`` a multiple of ``tokens``, 1 or 4) and each of
    the ``group`` query heads g that read them, ``scores.flat[s_at + g * s_stride + u] = scale * sum_d q.flat[q_at + g
    * head_dim + d] * key.flat[key_at + u * token_stride + d]``, keys widened to float32 (``_widen``). ``group``,
    ``head_dim`` (a multiple of ``LANES``) and ``tokens`` are compile-time constants.

    bf16 keys where numba compiles ``vdpbf16ps`` (``bf16_dots``) are not widened: the queries are rounded to bf16
    once (exact for a bf16 engine's, which are bf16 values) and each 32 products of a key come from one
    ``vdpbf16ps`` per query head (products exact, sums float32), against two widenings and two FMAs: decode
    attention's scores in about half the instructions (docs/kernels.md).

    Why: the group's queries stay in registers, each key row is widened once for all of them (the numba loops
    widened it per query head: LLVM cannot keep it across the stores to the scores), and ``tokens`` keys' sums
    are reduced together (``_sums``). Why constants as arguments, not a factory of intrinsics per group: numba's
    disk cache keys a closure by the values it closes over, and an intrinsic object's key changes with every
    process, so each process compiled the kernel again (5.6 s)."""
    groups, dim, keys_at_once = (_literal(group, "group"), _literal(head_dim, "head_dim"),
                                 _literal(tokens, "tokens"))
    chunks = dim // LANES
    signature = types.void(scores, types.intp, types.intp, q, types.intp, key, types.intp, types.intp, types.intp,
                           group, head_dim, tokens, types.float32)
    paired = key.dtype == types.int16 and dim % (2 * LANES) == 0 and bf16_dots()

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        scores_arr, s_at, s_stride, q_arr, q_at, key_arr, key_at, token_stride, count = args[:9]
        i64, vec = ir.IntType(64), ir.VectorType(ir.FloatType(), LANES)
        queries = builder.gep(_data(context, builder, sig.args[3], q_arr), [q_at])
        qs = [[builder.load(builder.bitcast(builder.gep(queries, [ir.Constant(i64, g * dim + c * LANES)]),
                                            vec.as_pointer()), align=4) for c in range(chunks)] for g in range(groups)]
        if paired:  # each 32 query elements as one vector of bf16 (nearest even), key elements in the same order
            dot, bfx = _bf16_dot(builder)
            qs = [[builder.fptrunc(_shuffle(builder, qs[g][c], qs[g][c + 1], list(range(2 * LANES))), bfx)
                   for c in range(0, chunks, 2)] for g in range(groups)]
        out = builder.gep(_data(context, builder, sig.args[0], scores_arr), [s_at])
        keys = builder.gep(_data(context, builder, sig.args[5], key_arr), [key_at])
        entry, loop, done = _open_loop(builder, f"group_dots_{keys_at_once}", count)
        u = builder.phi(i64)
        sums: list[list] = [[] for _ in range(groups)]
        for j in range(keys_at_once):
            row = builder.gep(keys, [builder.mul(builder.add(u, ir.Constant(i64, j)), token_stride)])
            if paired:
                halves = [builder.load(builder.bitcast(builder.gep(row, [ir.Constant(i64, c * 2 * LANES)]),
                                                       bfx.as_pointer()), align=2) for c in range(chunks // 2)]
                for g in range(groups):
                    acc = ir.Constant(vec, None)
                    for c, half in enumerate(halves):
                        acc = builder.call(dot, [acc, qs[g][c], half])
                    sums[g].append(acc)
                continue
            widened = [_widen(builder, sig.args[5], builder.gep(row, [ir.Constant(i64, c * LANES)]))
                       for c in range(chunks)]
            for g in range(groups):
                acc = builder.fmul(qs[g][0], widened[0], flags=("fast",))
                for c in range(1, chunks):
                    acc = builder.fadd(acc, builder.fmul(qs[g][c], widened[c], flags=("fast",)), flags=("fast",))
                sums[g].append(acc)
        scale_v = _splat(builder, args[12])
        for g in range(groups):
            at = builder.gep(out, [builder.add(builder.mul(s_stride, ir.Constant(i64, g)), u)])
            total = _sums(builder, sums[g])
            total = builder.fmul(total, _shuffle(builder, scale_v, scale_v, [0] * total.type.count), flags=("fast",))
            if keys_at_once > 1:
                builder.store(total, builder.bitcast(at, total.type.as_pointer()), align=4)
            else:
                builder.store(builder.extract_element(total, ir.Constant(ir.IntType(32), 0)), at, align=4)
        _close_loop(builder, u, keys_at_once, count, [], [], entry, loop, done)
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def _group_sums(typingctx, acc, acc_at, p, p_at, p_stride, value, v_at, token_stride, n, group,
                head_dim):  # type: ignore[no-untyped-def]
    """``_group_sums(acc, acc_at, p, p_at, p_stride, value, v_at, token_stride, n, group, head_dim)``: for each of the
    ``group`` query heads g, ``acc.flat[acc_at + g * head_dim + d] += sum_u p.flat[p_at + g * p_stride + u] *
    value.flat[v_at + u * token_stride + d]`` over ``n`` value rows ``token_stride`` elements apart (widened,
    ``_widen``); ``group`` and ``head_dim`` are compile-time constants (see ``_group_dots``).

    Why: the group's ``group x head_dim`` sums stay in registers across the rows and each value row is widened
    once for all of them; the numba loop loaded and stored every sum, and widened the row again, per query head.
    Without AVX-512 (``_vector_registers``: SmolLM2's 3 x 64 sums are 24 of AVX2's 16 ymm registers, spilled by
    LLVM) the rows are read in one pass per ``LANES`` elements of the head dim, the group's sums of those elements
    in registers: the same products in the same order, 0.79x the time for 30 layers of 14 sequences of ~330 tokens
    under the AVX2 rehearsal (docs/kernels.md)."""
    groups, dim = _literal(group, "group"), _literal(head_dim, "head_dim")
    chunks = dim // LANES
    passes = 1 if _vector_registers() >= 2 * LANES else chunks  # each pass: its chunks' sums
    signature = types.void(acc, types.intp, p, types.intp, types.intp, value, types.intp, types.intp, types.intp,
                           group, head_dim)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        acc_arr, acc_at, p_arr, p_at, p_stride, value_arr, v_at, token_stride, count = args[:9]
        i64, vec = ir.IntType(64), ir.VectorType(ir.FloatType(), LANES)
        probs = builder.gep(_data(context, builder, sig.args[2], p_arr), [p_at])
        values = builder.gep(_data(context, builder, sig.args[5], value_arr), [v_at])
        target = builder.gep(_data(context, builder, sig.args[0], acc_arr), [acc_at])
        width = chunks // passes
        for first in range(0, chunks, width):
            mine = range(first, first + width)
            entry, loop, done = _open_loop(builder, f"group_sums_{first}", count)
            u = builder.phi(i64)
            accs = [builder.phi(vec) for _ in range(groups * width)]
            row = builder.gep(values, [builder.mul(u, token_stride)])
            widened = [_widen(builder, sig.args[5], builder.gep(row, [ir.Constant(i64, c * LANES)])) for c in mine]
            totals = []
            for g in range(groups):
                at = builder.add(builder.mul(p_stride, ir.Constant(i64, g)), u)
                weight = _splat(builder, builder.load(builder.gep(probs, [at])))
                totals += [builder.fadd(accs[g * width + i], builder.fmul(weight, widened[i], flags=("fast",)),
                                        flags=("fast",)) for i in range(width)]
            results = _close_loop(builder, u, 1, count, accs, totals, entry, loop, done)
            for i, result in enumerate(results):
                offset = ir.Constant(i64, (i // width) * dim + (first + i % width) * LANES)
                at = builder.bitcast(builder.gep(target, [offset]), vec.as_pointer())
                builder.store(builder.fadd(builder.load(at, align=4), result, flags=("fast",)), at, align=4)
        return context.get_dummy_value()

    return signature, codegen


@njit(fastmath=True, cache=True, boundscheck=False, inline="always")
def _sequence_of(item, num_seqs, context_lens, window):  # type: ignore[no-untyped-def]
    """A decode kernel's work item -> ``(b, start, n)``: its sequence and the ``n`` positions from ``start`` it sees.

    Items alternate from both ends: callers order sequences by length, and prange hands each thread one contiguous
    chunk, so this pairs short sequences with long ones."""
    b = item // 2 if item % 2 == 0 else num_seqs - 1 - item // 2
    end = context_lens[b]
    start = max(0, end - window) if window > 0 else 0
    return b, start, end - start


@njit(fastmath=True, cache=True, boundscheck=False, inline="always")
def _scaled_queries(q, b, scale):  # type: ignore[no-untyped-def]
    """Sequence ``b``'s query ``[Hq, D]`` times ``scale``, as float32."""
    scaled = np.empty((q.shape[1], q.shape[2]), np.float32)
    for hq in range(q.shape[1]):
        for d in range(q.shape[2]):
            scaled[hq, d] = q[b, hq, d] * scale
    return scaled


@njit(fastmath=True, cache=True, boundscheck=False, inline="always")
def _softmax_rows(scores):  # type: ignore[no-untyped-def]
    """Each row of ``scores [Hq, n]`` (n >= 1) replaced by its softmax, in place."""
    n = scores.shape[1]
    for hq in range(scores.shape[0]):
        top = scores[hq, 0]
        for t in range(1, n):
            top = max(top, scores[hq, t])
        total = np.float32(0.0)
        for t in range(n):
            e = _exp(scores[hq, t] - top)
            scores[hq, t] = e
            total += e
        inv = np.float32(1.0) / total
        for t in range(n):
            scores[hq, t] *= inv


@njit(fastmath=True, cache=True, boundscheck=False, inline="always")
def _write_rows(out, b, acc):  # type: ignore[no-untyped-def]
    """``out[b] = acc`` (``[Hq, D]``; zeros for a sequence that sees no token)."""
    for hq in range(out.shape[1]):
        for d in range(out.shape[2]):
            out[b, hq, d] = acc[hq, d]


# Head dims with kernels of their own (SmolLM2 has 64; Llama, Mistral and Qwen2 128), compiled per query heads per
# KV head up to MAX_GROUP: the head dim and the group are constants, so a group's queries and sums fit registers.
SPECIALISED_HEAD_DIMS = (64, 128)
MAX_GROUP = 8


def decode_kernel_key(num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """``(head_dim, group)`` of the decode kernel compiled for these heads, ``(0, 0)`` for the generic one."""
    group = num_heads // num_kv_heads
    return (head_dim, group) if head_dim in SPECIALISED_HEAD_DIMS and group <= MAX_GROUP else (0, 0)


@functools.cache
def _decode_kernel(head_dim: int, group: int):  # type: ignore[no-untyped-def]
    """The decode kernel for ``decode_kernel_key``'s ``(head_dim, group)``: ``_generic_decode`` for ``(0, 0)``.

    Each is a function of its own name (``decode_d64_g3``), read from numba's disk cache after its first
    compilation (~5 s; loading it takes well under a second). Why the name: numba names compiled code by the
    function's qualified name and a counter that restarts in every process, and a function linked into another
    (the decode run of layers calls this one) is merged by name with a definition already loaded. When every
    group's kernel was a closure named ``decode``, two groups' kernels compiled in different processes carried the
    same symbol (seen); a cached copy then corrupted the heap in one test process (glibc's ``MALLOC_CHECK_=3``,
    "free(): invalid next size", 4 of 4 runs, never reproduced since; docs/kernels.md). Whether the shared symbol
    was the cause is not proven; with a name per kernel it cannot be."""
    if not head_dim:
        return _generic_decode

    def decode(q, k_cache, v_cache, k_scale, v_scale, quantized, block_tables, context_lens, scale, window,
               out):  # type: ignore[no-untyped-def]
        """``_generic_decode``'s contract, for queries of ``head_dim`` with ``group`` query heads per KV head.

        A sequence's tokens go by runs within a block (contiguous rows), each KV head's group at once: its
        scores by ``_group_dots`` (four keys at a time), its weighted sums by ``_group_sums``. Against the
        numba loops (``_generic_decode``, then compiled per head dim) on 30 layers of 16 sequences of 100-700
        tokens, SmolLM2's heads, bf16: see docs/kernels.md."""
        num_seqs, num_heads = q.shape[0], q.shape[1]
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        row_stride = num_kv_heads * head_dim
        for item in prange(num_seqs):
            b, start, n = _sequence_of(item, num_seqs, context_lens, window)
            acc = np.zeros((num_heads, head_dim), np.float32)  # flat offsets below: [hq, d] is hq * head_dim + d
            if n <= 0:
                _write_rows(out, b, acc)
                continue
            queries = _scaled_queries(q, b, np.float32(1.0))  # the scale multiplies the sums (_group_dots)
            scores = np.empty((num_heads, n), np.float32)
            key_scales = np.empty((num_kv_heads if quantized else 0, n), np.float32)
            value_scales = np.empty((num_kv_heads if quantized else 0, n), np.float32)
            t = 0
            while t < n:
                block, offset, count = _run_at(k_cache, k_scale, quantized, block_tables, b, start, t, n)
                whole = count - count % 4
                for h in range(num_kv_heads):
                    row = (block * block_size + offset) * row_stride + h * head_dim
                    _group_dots(scores, h * group * n + t, n, queries, h * group * head_dim, k_cache, row, row_stride,
                                whole, group, head_dim, 4, scale)
                    _group_dots(scores, h * group * n + t + whole, n, queries, h * group * head_dim, k_cache,
                                row + whole * row_stride, row_stride, count - whole, group, head_dim, 1, scale)
                    if quantized:  # the run's scales, for one pass over each score row below
                        for u in range(count):
                            key_scales[h, t + u] = k_scale[block, offset + u, h]
                            value_scales[h, t + u] = v_scale[block, offset + u, h]
                t += count
            if quantized:  # a key's scale multiplies its dot product
                for hq in range(num_heads):
                    for u in range(n):
                        scores[hq, u] *= key_scales[hq // group, u]
            _softmax_rows(scores)
            if quantized:  # a value's scale multiplies its probability
                for hq in range(num_heads):
                    for u in range(n):
                        scores[hq, u] *= value_scales[hq // group, u]
            t = 0
            while t < n:
                block, offset, count = _run_at(v_cache, v_scale, quantized, block_tables, b, start, t, n)
                for h in range(num_kv_heads):
                    _group_sums(acc, h * group * head_dim, scores, h * group * n + t, n, v_cache,
                                (block * block_size + offset) * row_stride + h * head_dim, row_stride, count, group,
                                head_dim)
                t += count
            _write_rows(out, b, acc)

    decode.__name__ = f"decode_d{head_dim}_g{group}"
    decode.__qualname__ = f"_decode_kernel.<locals>.{decode.__name__}"
    return njit(parallel=True, fastmath=True, cache=True, boundscheck=False, nogil=True)(decode)


@njit(parallel=True, fastmath=True, cache=True, boundscheck=False, nogil=True)
def _generic_decode(q, k_cache, v_cache, k_scale, v_scale, quantized, block_tables, context_lens, scale, window,
                    out):  # type: ignore[no-untyped-def]
    """The decode kernel for any head dim and group (``_decode_kernel(0, 0)``), in numba loops.

    q ``[B, Hq, D]`` fp32; caches int16 (bf16 bits), fp32 or int8 (``quantized``: with ``k_scale``/``v_scale``
    ``[blocks, block_size, Hkv]``); out ``[B, Hq, D]`` fp32.

    One work item per sequence, all heads together: a token's K (or V) row for every KV head is one
    contiguous run of memory, read whole (per-head items read a third of each run and measured
    ~25% slower; the hardware prefetcher fetches the rest anyway). Elements are indexed in place: a row
    view (``k_cache[block, offset, h]``) costs numba an atomic reference-count update on the whole cache
    per token and head, from every thread; dropping the views measured 5-9% faster on the whole kernel
    (13 sequences x 400 tokens: 346 -> 327 us; 16 x 700: 980 -> 900 us; outputs bit-identical).
    """
    num_seqs, num_heads = q.shape[0], q.shape[1]
    head_dim = q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    for item in prange(num_seqs):
        b, start, n = _sequence_of(item, num_seqs, context_lens, window)
        acc = np.zeros((num_heads, head_dim), np.float32)
        if n <= 0:
            _write_rows(out, b, acc)
            continue
        scaled_q = _scaled_queries(q, b, scale)
        scores = np.empty((num_heads, n), np.float32)
        t = 0
        while t < n:
            block, offset, count = _run_at(k_cache, k_scale, quantized, block_tables, b, start, t, n)
            for u in range(count):
                for h in range(num_kv_heads):
                    key_scale = k_scale[block, offset + u, h] if quantized else np.float32(1.0)
                    for hq in range(h * group, (h + 1) * group):
                        s = np.float32(0.0)
                        for d in range(head_dim):
                            s += scaled_q[hq, d] * _as_f32(k_cache[block, offset + u, h, d])
                        scores[hq, t + u] = s * key_scale
            t += count
        _softmax_rows(scores)
        t = 0
        while t < n:
            block, offset, count = _run_at(v_cache, v_scale, quantized, block_tables, b, start, t, n)
            for u in range(count):
                for h in range(num_kv_heads):
                    value_scale = v_scale[block, offset + u, h] if quantized else np.float32(1.0)
                    for hq in range(h * group, (h + 1) * group):
                        p = scores[hq, t + u] * value_scale
                        for d in range(head_dim):
                            acc[hq, d] += p * _as_f32(v_cache[block, offset + u, h, d])
            t += count
        _write_rows(out, b, acc)


# Query runs up to this long (speculative verifications: the last token and k <= 8 drafts; short prefill
# chunks) are served by the varlen kernel below, one item per sequence; longer ones by ``_runs``.
SHORT_QUERIES = 16


@njit(parallel=True, fastmath=True, cache=True, boundscheck=False, nogil=True)
def _varlen(q, k_cache, v_cache, k_scale, v_scale, quantized, block_tables, cu_seqlens, context_lens, seqs,
            scale, window, out):  # type: ignore[no-untyped-def]
    """Attention for a short run of queries per sequence (a verification: the last token and its drafts), each
    causal over the cache: every K/V row is read and widened once for all of a sequence's queries.

    Why: per query, the decode kernel's dot products end in a horizontal sum (8 dependent shuffles and
    adds for 64 products), and through the gather-and-SDPA reference a verification of 8 sequences x 4
    positions took ~0.9 ms a layer against 0.3 ms for a 16-sequence decode; speculation was then slower
    than plain decoding at 16 requests in flight (docs/speculative.md). Here the scores of all the query
    rows that share a KV head (queries x heads per KV head, padded to ``LANES``) are one vector: each
    widened key element multiplies a column of transposed queries, so no sum crosses lanes, and the
    softmax runs across those rows too.

    q ``[T, Hq, D]`` fp32; sequence ``b`` in ``seqs`` owns query rows ``cu_seqlens[b]:cu_seqlens[b+1]``, the last
    of its ``context_lens[b]`` positions; out ``[T, Hq, D]`` fp32 (only those rows written). One kernel for every
    head dim: its inner loops are the IR above, and a copy specialised to 64 measured no faster (and, loaded
    from numba's cache, 1.8x slower: numba/numba#10617's parallel cached-code anomaly).
    """
    num_heads = q.shape[1]
    head_dim = q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_items = seqs.shape[0]
    for item in prange(num_items):
        b = seqs[item // 2 if item % 2 == 0 else num_items - 1 - item // 2]
        row0, num_q = cu_seqlens[b], cu_seqlens[b + 1] - cu_seqlens[b]
        end = context_lens[b]
        first = end - num_q  # position of the first query
        start = max(0, first + 1 - window) if window > 0 else 0
        n = end - start
        rows = num_q * group  # per KV head, row j = c * LANES + lane: query j // group, head h * group + j % group
        chunks = (rows + LANES - 1) // LANES
        # The hot loops index arrays by loop variables only: a derived index (c * LANES + lane) gets numba's
        # negative-index wraparound, which LLVM cannot prove away, and the loads become gathers.
        q_t = np.zeros((num_kv_heads, head_dim, chunks, LANES), np.float32)
        for h in range(num_kv_heads):
            for j in range(rows):
                for d in range(head_dim):
                    q_t[h, d, j // LANES, j % LANES] = q[row0 + j // group, h * group + j % group, d] * scale
        scores = np.empty((num_kv_heads, n, chunks, LANES), np.float32)
        # The sequence's K/V rows widened to float32 (V scaled, for int8 caches).
        keys = np.empty((n, num_kv_heads, head_dim), np.float32)
        values = np.empty((n, num_kv_heads, head_dim), np.float32)
        for t in range(min(n, PREFETCH_TOKENS)):
            _prefetch_row(k_cache, k_scale, quantized, block_tables, b, start + t)
            _prefetch_row(v_cache, v_scale, quantized, block_tables, b, start + t)
        for t in range(n):
            pos = start + t
            block, offset = block_tables[b, pos // block_size], pos % block_size
            if t + PREFETCH_TOKENS < n:
                _prefetch_row(k_cache, k_scale, quantized, block_tables, b, pos + PREFETCH_TOKENS)
                _prefetch_row(v_cache, v_scale, quantized, block_tables, b, pos + PREFETCH_TOKENS)
            for h in range(num_kv_heads):
                key_scale = k_scale[block, offset, h] if quantized else np.float32(1.0)
                for d in range(head_dim):
                    keys[t, h, d] = _as_f32(k_cache[block, offset, h, d]) * key_scale
                value_scale = v_scale[block, offset, h] if quantized else np.float32(1.0)
                for d in range(head_dim):  # widened once, for the weighted sums below
                    values[t, h, d] = _as_f32(v_cache[block, offset, h, d]) * value_scale
        stride = num_kv_heads * head_dim
        whole = n - n % DOT_TOKENS
        for h in range(num_kv_heads):
            for c in range(chunks):
                # flat offsets, not views: a view costs numba two atomic reference-count updates
                for t in range(0, whole, DOT_TOKENS):
                    _lane_dots_tokens(scores, ((h * n + t) * chunks + c) * LANES, chunks * LANES, q_t,
                                      (h * head_dim * chunks + c) * LANES, chunks * LANES, keys,
                                      (t * num_kv_heads + h) * head_dim, 1, stride, head_dim)
                for t in range(whole, n):
                    _lane_dots(scores, ((h * n + t) * chunks + c) * LANES, 0, q_t, (h * head_dim * chunks + c) * LANES,
                               chunks * LANES, keys, (t * num_kv_heads + h) * head_dim, 1, 0, head_dim)
        # Causal (and window) mask: query i sees positions first + i - window + 1 .. first + i.
        masked = np.float32(-3.0e38)
        for t in range(n):
            pos = start + t
            lo_q = max(0, pos - first)
            hi_q = num_q if window <= 0 else min(num_q, pos + window - first)
            if lo_q > 0 or hi_q < num_q:
                for h in range(num_kv_heads):
                    for j in range(rows):
                        if j // group < lo_q or j // group >= hi_q:
                            scores[h, t, j // LANES, j % LANES] = masked
        top = np.full((num_kv_heads, chunks, LANES), masked, np.float32)
        total = np.zeros((num_kv_heads, chunks, LANES), np.float32)
        for h in range(num_kv_heads):
            for t in range(n):
                for c in range(chunks):
                    for lane in range(LANES):
                        top[h, c, lane] = max(top[h, c, lane], scores[h, t, c, lane])
            for t in range(n):
                for c in range(chunks):
                    for lane in range(LANES):
                        # a masked score's weight is exp(-87) ~ 1e-38 against at least 1: nothing in float32
                        e = _exp(scores[h, t, c, lane] - top[h, c, lane])
                        scores[h, t, c, lane] = e
                        total[h, c, lane] += e
        # The weighted sum the same way: per KV head, chunk and element d, the 16 rows' sums over tokens.
        acc = np.empty((num_kv_heads, chunks, head_dim, LANES), np.float32)
        for h in range(num_kv_heads):
            for c in range(chunks):
                for d in range(0, head_dim, LANES):
                    _lane_sums(acc, ((h * chunks + c) * head_dim + d) * LANES, scores, (h * n * chunks + c) * LANES,
                               chunks * LANES, values, h * head_dim + d, num_kv_heads * head_dim, n)
        for h in range(num_kv_heads):
            for j in range(rows):
                inv = np.float32(1.0) / total[h, j // LANES, j % LANES]
                for d in range(head_dim):
                    out[row0 + j // group, h * group + j % group, d] = acc[h, j // LANES, d, j % LANES] * inv


@njit(parallel=True, fastmath=True, cache=True, boundscheck=False, nogil=True)
def _runs(q, k_cache, v_cache, k_scale, v_scale, quantized, block_tables, cu_seqlens, context_lens, seqs,
          scale, window, out):  # type: ignore[no-untyped-def]
    """Causal attention of query runs of any length over the cache, in work items of 16 rows: a row is one
    (query, head) pair of a KV head's group, and the 16 rows' scores for a key are one vector (no horizontal
    sums, as in ``_varlen``).

    Why items of 16 rows: a prompt's rows split over both threads, and each item reads only the keys its
    last query may see (causal skipping: half the work of a fresh prompt). First every sequence's K/V rows
    are widened to float32 (int8 rows times their scales), then each item (sequence, KV head, 16 rows)
    computes its scores, softmax and weighted sums from them.

    q ``[T, Hq, D]`` fp32; sequence ``b`` in ``seqs`` owns query rows ``cu_seqlens[b]:cu_seqlens[b+1]``, the last
    of its ``context_lens[b]`` positions; out ``[T, Hq, D]`` fp32 (only those rows written).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    stride = num_kv_heads * head_dim
    num_seqs = seqs.shape[0]
    firsts, row_at, item_at = _run_layout(seqs, cu_seqlens, context_lens, window, group, num_kv_heads, False)
    keys = np.empty((row_at[num_seqs], num_kv_heads, head_dim), np.float32)
    values = np.empty((row_at[num_seqs], num_kv_heads, head_dim), np.float32)
    for s in prange(num_seqs):
        b = seqs[s]
        for pos in range(firsts[s], context_lens[b]):
            block, offset = block_tables[b, pos // block_size], pos % block_size
            r = row_at[s] + pos - firsts[s]
            for h in range(num_kv_heads):
                key_scale = k_scale[block, offset, h] if quantized else np.float32(1.0)
                value_scale = v_scale[block, offset, h] if quantized else np.float32(1.0)
                for d in range(head_dim):
                    keys[r, h, d] = _as_f32(k_cache[block, offset, h, d]) * key_scale
                for d in range(head_dim):
                    values[r, h, d] = _as_f32(v_cache[block, offset, h, d]) * value_scale
    num_items = item_at[num_seqs]
    masked = np.float32(-3.0e38)
    for index in prange(num_items):
        s, h, lo_row, hi_row, first, lo, hi = _run_item(index, num_items, item_at, seqs, cu_seqlens, context_lens,
                                                        firsts, group, window)
        row0, start = cu_seqlens[seqs[s]], firsts[s]
        n = hi - lo
        q_t = np.zeros((head_dim, LANES), np.float32)
        for j in range(lo_row, hi_row):
            for d in range(head_dim):
                q_t[d, j - lo_row] = q[row0 + j // group, h * group + j % group, d] * scale
        scores = np.empty((n, LANES), np.float32)
        base = row_at[s] + lo
        whole = n - n % DOT_TOKENS
        for t in range(0, whole, DOT_TOKENS):
            _lane_dots_tokens(scores, t * LANES, LANES, q_t, 0, LANES, keys, ((base + t) * num_kv_heads + h) * head_dim,
                              1, stride, head_dim)
        for t in range(whole, n):
            _lane_dots(scores, t * LANES, 0, q_t, 0, LANES, keys, ((base + t) * num_kv_heads + h) * head_dim, 1, 0,
                       head_dim)
        _mask_run(scores, n, start + lo, first, lo_row, hi_row, group, window, masked)
        top = np.full(LANES, masked, np.float32)
        _lane_max(top, scores, n)
        total = np.zeros(LANES, np.float32)
        for t in range(n):
            for lane in range(LANES):
                e = _exp(scores[t, lane] - top[lane])
                scores[t, lane] = e
                total[lane] += e
        acc = np.empty((head_dim, LANES), np.float32)  # [d-slice of 16][element][lane], as _lane_sums writes
        for d in range(0, head_dim, LANES):
            _lane_sums(acc, d * LANES, scores, 0, LANES, values, (base * num_kv_heads + h) * head_dim + d, stride, n)
        for j in range(lo_row, hi_row):
            inv = np.float32(1.0) / total[j - lo_row]
            for d in range(head_dim):
                out[row0 + j // group, h * group + j % group, d] = acc[d, j - lo_row] * inv


def long_runs_kernel(k_cache: np.ndarray):  # type: ignore[no-untyped-def]
    """The kernel for query runs longer than ``SHORT_QUERIES`` over caches like ``k_cache`` (a ``_cache_array`` view):
    ``cpu_attention_bf16.runs`` (``vdpbf16ps``, half the instructions) for bf16 caches where numba compiles for
    ``avx512_bf16``, ``_runs`` otherwise. Both take the same arguments."""
    if k_cache.dtype == np.int16 and k_cache.shape[3] % LANES == 0:
        from apiary.kernels import cpu_attention_bf16

        if cpu_attention_bf16.available():
            return cpu_attention_bf16.runs
    return _runs


@njit(fastmath=True, cache=True, boundscheck=False, inline="always")
def _run_layout(seqs, cu_seqlens, context_lens, window, group, num_kv_heads, paired):  # type: ignore[no-untyped-def]
    """Per sequence of a prompt kernel's ``seqs``: its first cached position read, its first row in the kernel's copy
    of the rows it reads (``paired``: an even row, and a zero pair after its rows, for ``cpu_attention_bf16``, whose
    items may read one key past their last), and its first work item (16 rows of one KV head)."""
    num_seqs = seqs.shape[0]
    firsts = np.empty(num_seqs, np.int64)
    row_at = np.zeros(num_seqs + 1, np.int64)
    item_at = np.zeros(num_seqs + 1, np.int64)
    for s in range(num_seqs):
        b = seqs[s]
        num_q = cu_seqlens[b + 1] - cu_seqlens[b]
        first = context_lens[b] - num_q
        firsts[s] = max(0, first + 1 - window) if window > 0 else 0
        rows = context_lens[b] - firsts[s]
        row_at[s + 1] = row_at[s] + (rows + rows % 2 + 2 if paired else rows)
        item_at[s + 1] = item_at[s] + num_kv_heads * ((num_q * group + LANES - 1) // LANES)
    return firsts, row_at, item_at


@njit(fastmath=True, cache=True, boundscheck=False, inline="always")
def _run_item(index, num_items, item_at, seqs, cu_seqlens, context_lens, firsts, group, window):  # type: ignore[no-untyped-def]
    """A prompt kernel's work item (``_runs``, ``cpu_attention_bf16.runs``) -> ``(s, h, lo_row, hi_row, first, lo,
    hi)``: its sequence's index in ``seqs``, its KV head, its rows ``[lo_row, hi_row)`` of the head's ``num_q * group``
    (query, head) rows, the run's first query position, and the keys ``[lo, hi)`` (from ``firsts[s]``) any of its
    rows may see. Later items of a prompt see more keys: items alternate from both ends to even out the threads'
    shares (prange hands each thread one contiguous chunk)."""
    item = index // 2 if index % 2 == 0 else num_items - 1 - index // 2
    s = 0
    while item_at[s + 1] <= item:
        s += 1
    b = seqs[s]
    num_q = cu_seqlens[b + 1] - cu_seqlens[b]
    first = context_lens[b] - num_q  # position of the run's first query
    local = item - item_at[s]
    chunks = (num_q * group + LANES - 1) // LANES
    h, c = local // chunks, local % chunks
    lo_row, hi_row = c * LANES, min(num_q * group, (c + 1) * LANES)
    lo_q, hi_q = lo_row // group, (hi_row - 1) // group  # the item's first and last query
    lo = max(0, first + lo_q + 1 - window) - firsts[s] if window > 0 else 0
    return s, h, lo_row, hi_row, first, lo, first + hi_q + 1 - firsts[s]


@njit(fastmath=True, cache=True, boundscheck=False, inline="always")
def _mask_run(scores, n, pos0, first, lo_row, hi_row, group, window, masked):  # type: ignore[no-untyped-def]
    """Causal (and window) mask of an item's ``scores [n, 16]`` over the keys from position ``pos0``, only where its
    rows disagree: keys after its first query, and before its last query's window."""
    lo_q, hi_q = lo_row // group, (hi_row - 1) // group
    for t in range(max(0, first + lo_q + 1 - pos0), n):
        for j in range(lo_row, hi_row):
            if pos0 + t > first + j // group:
                scores[t, j - lo_row] = masked
    if window > 0:
        for t in range(0, min(n, first + hi_q + 1 - window - pos0)):
            for j in range(lo_row, hi_row):
                if pos0 + t <= first + j // group - window:
                    scores[t, j - lo_row] = masked


def supports(k_cache: torch.Tensor) -> bool:
    """True if this kernel can serve a cache like ``k_cache`` (a CPU tensor of a supported dtype)."""
    return k_cache.device.type == "cpu" and k_cache.dtype in SUPPORTED_DTYPES


def _cache_array(cache: torch.Tensor) -> np.ndarray:
    # numpy has no bfloat16: hand numba the raw bits (zero-copy) and convert in the kernel.
    return (cache.view(torch.int16) if cache.dtype == torch.bfloat16 else cache).numpy()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence ``q[B, Hq, D]`` over its ``context_lens[b]`` cached tokens -> ``[B, Hq, D]``.

    int8 caches need their ``k_scale``/``v_scale``. For the best thread balance, order sequences by
    context length (the runner does).
    """
    if not (supports(k_cache) and v_cache.dtype == k_cache.dtype):
        raise KernelError(f"cpu_attention serves CPU caches of {SUPPORTED_DTYPES}, got {k_cache.dtype} on {k_cache.device}")
    quantized = k_cache.dtype == torch.int8
    if quantized != (k_scale is not None and v_scale is not None):
        raise KernelError("int8 caches need k_scale and v_scale, float caches take none")
    if sliding_window is not None and sliding_window < 1:
        raise KernelError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    out = np.empty(tuple(q.shape), np.float32)
    if q.shape[0]:
        follow_torch_threads()
        scales = (k_scale.numpy(), v_scale.numpy()) if quantized else (_NO_SCALES, _NO_SCALES)
        kernel = _decode_kernel(*decode_kernel_key(q.shape[1], k_cache.shape[2], q.shape[2]))
        kernel(q.float().contiguous().numpy(), _cache_array(k_cache), _cache_array(v_cache), *scales, quantized,
                       block_tables.to(torch.int32).contiguous().numpy(),
                       context_lens.to(torch.int32).contiguous().numpy(),
                       np.float32(scale), int(sliding_window or 0), out)
    return torch.from_numpy(out).to(q.dtype)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            seqs: torch.Tensor, scale: float, sliding_window: int | None = None,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the query runs of sequences ``seqs`` over their cache -> float32 ``[T, Hq, D]`` with
    those sequences' rows written and every other row zero. Runs of at most ``SHORT_QUERIES`` (speculative
    verifications) go to ``_varlen``, one item per sequence; longer ones (prompt chunks) to ``_runs``, items of
    16 rows that skip the keys their queries cannot see.

    Semantics are ``apiary.kernels.ops.paged_prefill_attention``'s; the caller checked the inputs.
    """
    out = np.zeros(tuple(q.shape), np.float32)
    if seqs.numel():
        follow_torch_threads()
        quantized = k_cache.dtype == torch.int8
        scales = (k_scale.numpy(), v_scale.numpy()) if quantized else (_NO_SCALES, _NO_SCALES)
        cu = cu_seqlens_q.to(torch.int32).contiguous()
        lens = cu[1:][seqs.long()] - cu[:-1][seqs.long()]
        args = (q.float().contiguous().numpy(), _cache_array(k_cache), _cache_array(v_cache), *scales, quantized,
                block_tables.to(torch.int32).contiguous().numpy(), cu.numpy(),
                context_lens.to(torch.int32).contiguous().numpy())
        for kernel, mine in ((_varlen, lens <= SHORT_QUERIES), (long_runs_kernel(args[1]), lens > SHORT_QUERIES)):
            if bool(mine.any()):
                kernel(*args, seqs[mine].to(torch.int32).contiguous().numpy(), np.float32(scale),
                       int(sliding_window or 0), out)
    return torch.from_numpy(out)


class Prepared:
    """``paged_decode_attention`` for the decode rows of one step, whose every layer shares the block tables,
    lengths, scale and window: those are converted once, not per layer. The caller (``cpu_layers.CpuStep``)
    sets numba's thread count and hands in the caches' numpy views (and an int8 pair's scales)."""

    __slots__ = ("tables", "lens", "scale", "window", "kernel")

    def __init__(self, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 sliding_window: int | None) -> None:
        self.tables = block_tables.to(torch.int32).contiguous().numpy()
        self.lens = context_lens.to(torch.int32).contiguous().numpy()
        self.scale, self.window = np.float32(scale), int(sliding_window or 0)
        self.kernel = None

    def __call__(self, q: torch.Tensor, k_cache: np.ndarray, v_cache: np.ndarray,
                 scales: tuple[np.ndarray, np.ndarray] | None = None, into: torch.Tensor | None = None) -> torch.Tensor:
        """``q [B, Hq, D]`` (B = the step's decode rows) over caches given as ``_cache_array`` views; int8 caches
        with their ``(k_scale, v_scale)``. The result in ``q``'s dtype, written to ``into`` where given."""
        if self.kernel is None:
            self.kernel = _decode_kernel(*decode_kernel_key(q.shape[1], k_cache.shape[2], q.shape[2]))
        out = np.empty(tuple(q.shape), np.float32)
        if q.shape[0]:
            k_scale, v_scale = scales if scales is not None else (_NO_SCALES, _NO_SCALES)
            self.kernel(q.float().contiguous().numpy(), k_cache, v_cache, k_scale, v_scale, scales is not None,
                        self.tables, self.lens, self.scale, self.window, out)
        if into is None:
            return torch.from_numpy(out).to(q.dtype)
        return into.copy_(torch.from_numpy(out))


class PreparedPrefill:
    """``paged_prefill_attention`` for the query runs of one step (prompt chunks, verifications), whose every layer
    shares the block tables, offsets, lengths, scale and window: those are converted and the runs split by length
    (``_varlen`` or ``long_runs_kernel``'s) once, and the float32 query and output buffers are reused by every layer.

    Why: around a 380-token chunk's 1.31 ms of kernel the per-call path spent 0.57 ms (the checks, the tensor ops
    that split the runs, a 2.4 MB query widened into a fresh array, a zeroed output, its rounding), in every
    layer of every prompt step. Every run has at least one query, so each call rewrites every output row and the
    buffer is zeroed once. The values are the per-call path's bit for bit. The caller (``cpu_layers.CpuStep``)
    checked the inputs (``ops.cpu_step``), sets numba's thread count and hands in the caches' numpy views."""

    __slots__ = ("tables", "cu", "lens", "scale", "window", "runs", "q32", "out")

    def __init__(self, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 sliding_window: int | None, num_heads: int, head_dim: int) -> None:
        cu = cu_seqlens_q.to(torch.int32).contiguous()
        lens = (cu[1:] - cu[:-1]).long()
        seqs = torch.nonzero(lens > 0).flatten()
        self.runs = [(kernel, seqs[mine].to(torch.int32).contiguous().numpy())
                     for kernel, mine in ((_varlen, lens[seqs] <= SHORT_QUERIES), (None, lens[seqs] > SHORT_QUERIES))
                     if bool(mine.any())]
        self.tables = block_tables.to(torch.int32).contiguous().numpy()
        self.cu, self.lens = cu.numpy(), context_lens.to(torch.int32).contiguous().numpy()
        self.scale, self.window = np.float32(scale), int(sliding_window or 0)
        rows = int(cu[-1])
        self.q32 = torch.empty((rows, num_heads, head_dim), dtype=torch.float32)
        self.out = torch.zeros((rows, num_heads, head_dim), dtype=torch.float32)

    def __call__(self, q: torch.Tensor, k_cache: np.ndarray, v_cache: np.ndarray,
                 scales: tuple[np.ndarray, np.ndarray] | None, into: torch.Tensor) -> torch.Tensor:
        """``q [T, Hq, D]`` (the step's query-run rows) over caches given as ``_cache_array`` views (int8 ones with
        their ``(k_scale, v_scale)``), rounded into ``into`` (``q``'s shape and dtype)."""
        self.q32.copy_(q)
        k_scale, v_scale = scales if scales is not None else (_NO_SCALES, _NO_SCALES)
        query, out = self.q32.numpy(), self.out.numpy()
        for kernel, seqs in self.runs:
            if kernel is None:  # the long runs: the kernel for these caches
                kernel = long_runs_kernel(k_cache)
            kernel(query, k_cache, v_cache, k_scale, v_scale, scales is not None, self.tables, self.cu, self.lens,
                   seqs, self.scale, self.window, out)
        return into.copy_(self.out)
