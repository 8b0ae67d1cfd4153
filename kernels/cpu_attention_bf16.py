"""Prompt attention over bf16 caches with ``vdpbf16ps``: ``cpu_attention._runs``'s work in half the instructions.

Why: ``_runs`` widens every cached row to float32 and spends one FMA per key element per 16 query rows for the
scores, and one per value element per 16 rows for the weighted sums; at ~70% of the FMA rate those FMAs are most of
its time, and prompt attention was ~10% of the default (bf16) engine's run on the 2-CPU Zen 4 host
(docs/benchmarks.md). ``vdpbf16ps`` multiplies 16 lanes by two bf16 pairs at once, so on CPUs with
``avx512_bf16`` (``cpu_bf16_gemm.available``) the same products take half the instructions, and the keys need no
widening at all:

- scores: 16 rows (a KV head's (query, head) pairs, as in ``_runs``) hold their queries as bf16 pairs along the head
  dim (``[D / 2][16][2]``); each key's pair of elements is broadcast to every lane. Queries are bf16 in a bf16
  engine, so the pairs are exact; the scale multiplies the float32 scores afterwards.
- weighted sums: a sequence's values are copied as pairs of consecutive positions (``[rows / 2][Hkv][D]`` words), the
  probabilities rounded to bf16 in the same pairs along the keys, and each value pair broadcast to the 16 rows'
  lanes. The softmax's denominator sums the rounded probabilities, so each row's weights still sum to one.

Products of two bf16 are exact in float32 and every sum is float32, as in ``_runs``; what differs is the rounding of
the probabilities to bf16 (relative 2^-9 each, as FlashAttention's bf16 kernels and SDPA's bf16 path do before their
second matmul) and the order of the sums. The outputs agree with ``_runs``' to about one bf16 ulp
(``tests/kernels/test_cpu_attention_bf16.py``). Semantics, masking and causal skipping are ``_runs``'; int8 and float32
caches, and CPUs without ``vdpbf16ps``, keep ``_runs``.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from apiary.kernels.cpu_attention import (LANES, _as_f32, _bf16_dot, _close_loop, _data, _exp, _lane_max, _mask_run,
                                          _open_loop, _run_item, _run_layout, _splat, _store_vectors)
from apiary.kernels.cpu_bf16_gemm import available
from apiary.kernels.cpu_int8_gemm import _splat_word
from apiary.kernels.cpu_layers import _f32_as_bf16_bits

__all__ = ["available", "runs"]

DOT_TOKENS = 4  # keys per _pair_dots_tokens call; each key's sums run in two chains (even and odd pairs)


def _pair_dots_of(tokens: int):  # type: ignore[no-untyped-def]
    """The intrinsic ``dots(out, out_at, out_stride, qp, key, key_at, token_stride, pairs, scale)``: for each of
    ``tokens`` keys u (``token_stride`` elements apart, bf16 bits), ``out.flat[out_at + u * out_stride : … + 16] = scale *
    sum_{i < pairs} qp[i] . key[key_at + u * token_stride + 2i : … + 2]``, where ``qp[i]`` (``qp.flat[16 i : 16 i + 16]``, words
    of two bf16, ``_pair_word``) holds 16 rows' i-th query pairs: one ``vdpbf16ps`` per key pair for all 16 rows, each
    query vector loaded once for the ``tokens`` keys. Two chains per key (even and odd pairs) keep ``2 * tokens``
    products in flight; ``pairs`` must be even."""

    @intrinsic
    def dots(typingctx, out, out_at, out_stride, qp, key, key_at, token_stride, pairs, scale):  # type: ignore[no-untyped-def]
        signature = types.void(out, types.intp, types.intp, qp, key, types.intp, types.intp, types.intp, types.float32)

        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            out_arr, out_at, out_stride, qp_arr, key_arr, key_at, token_stride, count, scale = args
            i32, i64 = ir.IntType(32), ir.IntType(64)
            f32x = ir.VectorType(ir.FloatType(), LANES)
            dot, bfx = _bf16_dot(builder)
            queries = _data(context, builder, sig.args[3], qp_arr)
            keys = [builder.gep(_data(context, builder, sig.args[4], key_arr),
                                [builder.add(key_at, builder.mul(token_stride, ir.Constant(i64, u)))])
                    for u in range(tokens)]
            entry, loop, done = _open_loop(builder, f"pair_dots_{tokens}", count)
            i = builder.phi(i64)
            accs = [builder.phi(f32x) for _ in range(2 * tokens)]
            # two pairs per trip (count is even: head dims are multiples of 4), chains by the pair's parity
            totals = list(accs)
            for half in range(2):
                at = builder.add(i, ir.Constant(i64, half))
                qv = builder.load(builder.bitcast(builder.gep(queries, [builder.mul(at, ir.Constant(i64, LANES))]),
                                                  bfx.as_pointer()), align=4)
                for u, k in enumerate(keys):
                    word = builder.load(builder.bitcast(builder.gep(k, [builder.mul(at, ir.Constant(i64, 2))]),
                                                        i32.as_pointer()), align=2)
                    kv = builder.bitcast(_splat_word(builder, word, LANES), bfx)
                    totals[2 * u + half] = builder.call(dot, [totals[2 * u + half], qv, kv])
            results = _close_loop(builder, i, 2, count, accs, totals, entry, loop, done)
            target = builder.gep(_data(context, builder, sig.args[0], out_arr), [out_at])
            for u in range(tokens):
                at = builder.gep(target, [builder.mul(out_stride, ir.Constant(i64, u))])
                total = builder.fmul(builder.fadd(results[2 * u], results[2 * u + 1], flags=("fast",)),
                                     _splat(builder, scale), flags=("fast",))
                builder.store(total, builder.bitcast(at, f32x.as_pointer()), align=4)
            return context.get_dummy_value()

        return signature, codegen

    return dots


_pair_dots_tokens = _pair_dots_of(DOT_TOKENS)
_pair_dots = _pair_dots_of(1)


@njit(fastmath=True, cache=True, inline="always")
def _pair_word(low, high):  # type: ignore[no-untyped-def]
    """Two bf16 (int16 bits) as one int32 word, ``low`` in the low half: how ``vdpbf16ps`` reads a pair."""
    return np.int32((np.int32(high) << np.int32(16)) | (np.int32(low) & np.int32(0xFFFF)))


@intrinsic
def _pair_sums(typingctx, out, out_at, pp, value, v_at, pair_stride, pairs):  # type: ignore[no-untyped-def]
    """``out.flat[out_at + 16 e : … + 16] = sum_{i < pairs} pp[i] . value[v_at + i * pair_stride + e]`` for e < 16: the
    weighted sums of 16 value elements for 16 rows, where ``pp[i]`` (``pp.flat[16 i : 16 i + 16]``) holds the 16 rows'
    probabilities of keys 2i and 2i + 1 and each ``value`` word an element of those two keys, all as words of two
    bf16 (``_pair_word``); 16 accumulators, one ``vdpbf16ps`` per element and key pair."""
    signature = types.void(out, types.intp, pp, value, types.intp, types.intp, types.intp)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        out_arr, out_at, pp_arr, value_arr, v_at, pair_stride, count = args
        i32, i64 = ir.IntType(32), ir.IntType(64)
        f32x = ir.VectorType(ir.FloatType(), LANES)
        dot, bfx = _bf16_dot(builder)
        probs = _data(context, builder, sig.args[2], pp_arr)
        values = builder.gep(_data(context, builder, sig.args[3], value_arr), [v_at])
        entry, loop, done = _open_loop(builder, "pair_sums", count)
        i = builder.phi(i64)
        accs = [builder.phi(f32x) for _ in range(LANES)]
        pv = builder.load(builder.bitcast(builder.gep(probs, [builder.mul(i, ir.Constant(i64, LANES))]),
                                          bfx.as_pointer()), align=4)
        row = builder.gep(values, [builder.mul(i, pair_stride)])
        totals = []
        for e, acc in enumerate(accs):
            word = builder.load(builder.gep(row, [ir.Constant(i64, e)]), align=4)
            totals.append(builder.call(dot, [acc, pv, builder.bitcast(_splat_word(builder, word, LANES), bfx)]))
        results = _close_loop(builder, i, 1, count, accs, totals, entry, loop, done)
        _store_vectors(builder, _data(context, builder, sig.args[0], out_arr), out_at, results)
        return context.get_dummy_value()

    return signature, codegen


@njit(parallel=True, fastmath=True, cache=True, boundscheck=False, nogil=True)
def runs(q, k_cache, v_cache, k_scale, v_scale, quantized, block_tables, cu_seqlens, context_lens, seqs,
         scale, window, out):  # type: ignore[no-untyped-def]
    """``cpu_attention._runs``' contract (its arguments, so callers swap one for the other; the scales and
    ``quantized`` are unused) for bf16 caches (int16 bits): causal attention of query runs longer than
    ``SHORT_QUERIES`` in items of 16 rows of one KV head, each reading only the keys its last query may see."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    stride = num_kv_heads * head_dim
    pairs = head_dim // 2
    num_seqs = seqs.shape[0]
    firsts, row_at, item_at = _run_layout(seqs, cu_seqlens, context_lens, window, group, num_kv_heads, True)
    words = np.empty((q.shape[0], num_heads, pairs), np.int32)  # the runs' queries as bf16 pairs (_pair_word)
    keys = np.zeros((row_at[num_seqs], num_kv_heads, head_dim), np.int16)
    values = np.zeros((row_at[num_seqs] // 2, num_kv_heads, head_dim), np.int32)  # positions 2i and 2i + 1 as words
    for s in prange(num_seqs):
        b = seqs[s]
        for row in range(cu_seqlens[b], cu_seqlens[b + 1]):
            for hq in range(num_heads):
                for i in range(pairs):
                    words[row, hq, i] = _pair_word(_f32_as_bf16_bits(q[row, hq, 2 * i]),
                                                   _f32_as_bf16_bits(q[row, hq, 2 * i + 1]))
        for pos in range(firsts[s], context_lens[b], 2):  # rows r and r + 1 (r even): positions pos and pos + 1
            block, offset = block_tables[b, pos // block_size], pos % block_size
            r = row_at[s] + pos - firsts[s]
            second = pos + 1 < context_lens[b]  # else row r + 1 stays zero
            block2, offset2 = block_tables[b, (pos + 1) // block_size] if second else block, (pos + 1) % block_size
            for h in range(num_kv_heads):
                for d in range(head_dim):
                    keys[r, h, d] = k_cache[block, offset, h, d]
                for d in range(head_dim):
                    high = v_cache[block2, offset2, h, d] if second else np.int16(0)
                    values[r // 2, h, d] = _pair_word(v_cache[block, offset, h, d], high)
                if second:
                    for d in range(head_dim):
                        keys[r + 1, h, d] = k_cache[block2, offset2, h, d]
    num_items = item_at[num_seqs]
    masked = np.float32(-3.0e38)
    for index in prange(num_items):
        s, h, lo_row, hi_row, first, lo, hi = _run_item(index, num_items, item_at, seqs, cu_seqlens, context_lens,
                                                        firsts, group, window)
        row0, start = cu_seqlens[seqs[s]], firsts[s]
        lo -= lo % 2  # from a pair's first key: the one before the window is masked below
        n = hi - lo + (hi - lo) % 2  # whole pairs: a key past the last query's is masked below
        qp = np.zeros((pairs, LANES), np.int32)  # rows past hi_row stay zero; their outputs are not written
        for j in range(lo_row, hi_row):
            for i in range(pairs):
                qp[i, j - lo_row] = words[row0 + j // group, h * group + j % group, i]
        scores = np.empty((n, LANES), np.float32)
        base = row_at[s] + lo
        whole = n - n % DOT_TOKENS
        for t in range(0, whole, DOT_TOKENS):
            _pair_dots_tokens(scores, t * LANES, LANES, qp, keys, ((base + t) * num_kv_heads + h) * head_dim, stride,
                              pairs, scale)
        for t in range(whole, n):
            _pair_dots(scores, t * LANES, 0, qp, keys, ((base + t) * num_kv_heads + h) * head_dim, 0, pairs, scale)
        _mask_run(scores, n, start + lo, first, lo_row, hi_row, group, window, masked)
        top = np.full(LANES, masked, np.float32)
        _lane_max(top, scores, n)
        pp = np.empty((n // 2, LANES), np.int32)
        total = np.zeros(LANES, np.float32)
        for i in range(n // 2):
            for lane in range(LANES):
                low = _f32_as_bf16_bits(_exp(scores[2 * i, lane] - top[lane]))
                high = _f32_as_bf16_bits(_exp(scores[2 * i + 1, lane] - top[lane]))
                pp[i, lane] = _pair_word(low, high)
                total[lane] += _as_f32(low) + _as_f32(high)
        acc = np.empty((head_dim, LANES), np.float32)  # [d-slice of 16][element][lane], as _pair_sums writes
        for d in range(0, head_dim, LANES):
            _pair_sums(acc, d * LANES, pp, values, (base // 2 * num_kv_heads + h) * head_dim + d, stride, n // 2)
        for j in range(lo_row, hi_row):
            inv = np.float32(1.0) / total[j - lo_row]
            for d in range(head_dim):
                out[row0 + j // group, h * group + j % group, d] = acc[d, j - lo_row] * inv
