"""The numba CPU decode-attention kernel (behind ``ops`` on CPU) against the dense float64 oracle and the torch reference."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from apiary.kernels import cpu_attention, ops, reference
from apiary.kernels.errors import KernelError
from tests.kernels.cases import dense_attention, make_case, quantize_case, tolerance

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ctx,hq,hkv,d,bs,window", [
    ([1, 16, 17, 100], 8, 2, 32, 16, None),  # block boundaries, GQA 4
    ([3, 64], 3, 1, 64, 16, None),           # one KV head for all queries
    ([33, 7, 90], 4, 4, 32, 16, 10),         # no GQA, sliding window
    ([30, 2], 9, 3, 24, 4, 1),               # window of one token, odd head_dim, small blocks
    ([5, 200, 41, 41, 1], 9, 3, 64, 16, None),  # SmolLM2's head layout
    ([9, 70, 33], 4, 1, 128, 16, None),       # Llama 3's head dim and GQA 4 (a specialised kernel)
])
def test_matches_dense_attention(ctx, hq, hkv, d, bs, window, dtype):
    case = make_case(ctx, [1] * len(ctx), hq, hkv, d, bs, dtype)  # tables padded with -1 past the blocks in use
    out = cpu_attention.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                               case.context_lens, case.scale, window)
    assert out.dtype == dtype and out.shape == case.q.shape
    torch.testing.assert_close(out.double(), dense_attention(case, window), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ctx,hq,hkv,d,bs,window", [
    ([1, 16, 17, 100], 8, 2, 32, 16, None),
    ([33, 7, 90], 4, 4, 32, 16, 10),
    ([5, 200, 41, 41, 1, 0], 9, 3, 64, 16, None),  # SmolLM2's head layout, and an empty sequence
])
def test_int8_caches_attend_over_the_rows_they_stand_for(ctx, hq, hkv, d, bs, window, dtype):
    """With int8 caches the kernel computes exact attention over the dequantized rows (the scales applied
    once per token, outside the inner loops), as the torch reference does, and lands near the float result."""
    case = make_case(ctx, [1] * len(ctx), hq, hkv, d, bs, dtype)
    q8 = quantize_case(case)
    args = (case.q, q8.k_cache, q8.v_cache, case.block_tables, case.context_lens, case.scale, window)
    out = cpu_attention.paged_decode_attention(*args, q8.k_scale, q8.v_scale)
    assert out.dtype == dtype and out.shape == case.q.shape
    torch.testing.assert_close(out.double(), dense_attention(q8.dequantized, window), **tolerance(dtype))
    ref = reference.paged_decode_attention(*args, q8.k_scale, q8.v_scale)
    torch.testing.assert_close(out, ref, **tolerance(dtype))
    assert (out.double() - dense_attention(case, window)).abs().max() < 0.05  # int8 rows: ~0.4% of the range


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 1, 128)])
def test_specialised_head_dims_match_the_generic_kernel(hq, hkv, d, dtype, monkeypatch):
    """The kernels compiled for a fixed head dim compute what the one that reads it from the query does."""
    case = make_case([1, 15, 16, 17, 250], [1] * 5, hq, hkv, d, 16, torch.bfloat16 if dtype == torch.int8 else dtype)
    caches = (case.k_cache, case.v_cache)
    scales: tuple = ()
    if dtype == torch.int8:
        q8 = quantize_case(case)
        caches, scales = (q8.k_cache, q8.v_cache), (q8.k_scale, q8.v_scale)
    args = (case.q, *caches, case.block_tables, case.context_lens, case.scale, None, *scales)
    assert d in cpu_attention.SPECIALISED_HEAD_DIMS
    fixed = cpu_attention.paged_decode_attention(*args)
    monkeypatch.setattr(cpu_attention, "SPECIALISED_HEAD_DIMS", ())
    generic = cpu_attention.paged_decode_attention(*args)
    # The two sum in different orders: float32 results within ~1e-6, which a bfloat16 output may round one ulp
    # apart (2^-7 relative; seen compiled for Haswell, in the AVX2 rehearsal).
    rtol = 2.0 ** -7 if case.q.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(fixed.float(), generic.float(), atol=1e-5, rtol=rtol)


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_grouped_kernels_match_the_generic_kernel_on_random_batches(data):
    """The kernels compiled per (head dim, group) walk a sequence by runs within its blocks, four keys at a time
    and the rest one by one: any lengths, block sizes, windows and groups give the generic kernel's result."""
    hkv, group = data.draw(st.sampled_from([1, 2, 3])), data.draw(st.sampled_from([1, 3, 4]))
    ctx = data.draw(st.lists(st.integers(0, 90), min_size=1, max_size=6))
    window = data.draw(st.one_of(st.none(), st.integers(1, 40)))
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int8]))
    case = make_case(ctx, [1] * len(ctx), hkv * group, hkv, 64, data.draw(st.sampled_from([4, 7, 16])),
                     torch.bfloat16 if dtype == torch.int8 else dtype, seed=data.draw(st.integers(0, 1000)))
    caches, scales = (case.k_cache, case.v_cache), ()
    if dtype == torch.int8:
        q8 = quantize_case(case)
        caches, scales = (q8.k_cache, q8.v_cache), (q8.k_scale, q8.v_scale)
    args = (case.q, *caches, case.block_tables, case.context_lens, case.scale, window, *scales)
    assert cpu_attention.decode_kernel_key(hkv * group, hkv, 64) == (64, group)
    grouped = cpu_attention.paged_decode_attention(*args)
    generic = cpu_attention._generic_decode
    out = np.empty(tuple(case.q.shape), np.float32)
    generic(case.q.float().numpy(), *(cpu_attention._cache_array(c) for c in caches),
            *(x.numpy() for x in scales) if scales else (cpu_attention._NO_SCALES,) * 2, bool(scales),
            case.block_tables.numpy(), case.context_lens.numpy(), np.float32(case.scale), window or 0, out)
    rtol = 2.0 ** -7 if case.q.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(grouped.float(), torch.from_numpy(out).to(case.q.dtype).float(), atol=1e-5, rtol=rtol)


def test_kernels_are_compiled_per_group_up_to_max_group_for_specialised_head_dims():
    assert cpu_attention.decode_kernel_key(9, 3, 64) == (64, 3)
    assert cpu_attention.decode_kernel_key(32, 8, 128) == (128, 4)
    assert cpu_attention.decode_kernel_key(16, 1, 64) == (0, 0)  # a group past MAX_GROUP: the generic kernel
    assert cpu_attention.decode_kernel_key(8, 2, 32) == (0, 0)
    assert cpu_attention._decode_kernel(0, 0) is cpu_attention._generic_decode
    # a name of its own per kernel: numba merges linked code by name, and the cache loads kernels compiled elsewhere
    names = {cpu_attention._decode_kernel(d, g).py_func.__qualname__ for d, g in ((64, 1), (64, 3), (128, 3))}
    assert names == {f"_decode_kernel.<locals>.decode_d{d}_g{g}" for d, g in ((64, 1), (64, 3), (128, 3))}


_COMPILE_AND_COUNT = """
import numpy as np
import apiary.cloud.engine  # the engine's thread settings first, as every caller has them
from apiary.kernels import cpu_attention as ca
kernel = ca._decode_kernel(64, 3)
q = np.zeros((2, 9, 64), np.float32)
cache = np.zeros((4, 16, 3, 64), np.int16)
kernel(q, cache, cache, ca._NO_SCALES, ca._NO_SCALES, False, np.zeros((2, 2), np.int32), np.array([5, 9], np.int32),
       np.float32(1.0), 0, q.copy())
print(sum(kernel.stats.cache_hits.values()), sum(kernel.stats.cache_misses.values()))
"""


def test_grouped_kernels_load_from_numbas_disk_cache_in_a_new_process():
    """The kernel compiled per group is cached on disk: a second process loads it, not compiles it again (it did,
    ~5.6 s per process, while the group's intrinsics were closure values)."""
    import subprocess
    import sys

    runs = [subprocess.run([sys.executable, "-c", _COMPILE_AND_COUNT], capture_output=True, text=True, check=True)
            for _ in range(2)]
    hits, misses = (int(x) for x in runs[1].stdout.split()[-2:])
    assert (hits, misses) == (1, 0), runs[1].stdout + runs[1].stderr


def test_exp_is_within_two_ulp_of_numpy_and_clamps_below_minus_87():
    """The softmax's exponential (plain arithmetic so that its loop vectorises) against float64 ``exp``."""
    from numba import njit

    @njit
    def exps(x):  # type: ignore[no-untyped-def]
        out = np.empty_like(x)
        for i in range(x.size):
            out[i] = cpu_attention._exp(x[i])
        return out

    x = np.concatenate([np.linspace(-87, 0, 400_001, dtype=np.float32),
                        np.float32([0.0, -0.0, -1e-30, -1e-7, -0.3465736, -0.3465737, -86.99])])
    relative = np.abs(exps(x) - np.exp(x.astype(np.float64))) / np.exp(x.astype(np.float64))
    assert relative.max() < 2 * 2.0 ** -23
    assert exps(np.float32([0.0]))[0] == 1.0
    tiny = exps(np.float32([-87.0, -100.0, -1e30]))
    assert (tiny == tiny[0]).all() and 0 < tiny[0] < 2e-38  # a normal float, never 0 or NaN: weights stay finite


def test_int8_caches_need_their_scales_and_float_caches_take_none():
    case = make_case([4], [1], 2, 1, 16)
    q8 = quantize_case(case)
    with pytest.raises(KernelError, match="int8 caches need k_scale and v_scale"):
        cpu_attention.paged_decode_attention(case.q, q8.k_cache, q8.v_cache, case.block_tables, case.context_lens,
                                             case.scale)
    with pytest.raises(KernelError, match="float caches take none"):
        cpu_attention.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens,
                                             case.scale, None, q8.k_scale, q8.v_scale)


def test_is_closer_to_exact_than_the_bf16_reference():
    """Scores and softmax stay fp32 end to end (the reference rounds scores to bf16)."""
    case = make_case([300, 120, 77], [1, 1, 1], 9, 3, 64, 16, torch.bfloat16)
    exact = dense_attention(case)
    ours = cpu_attention.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                                case.context_lens, case.scale)
    ref = reference.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                           case.context_lens, case.scale)
    assert (ours.double() - exact).abs().max() <= (ref.double() - exact).abs().max()


def test_empty_sequences_yield_zeros_and_empty_batches_work():
    case = make_case([0, 5], [1, 1], 4, 2, 16)
    out = cpu_attention.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                               case.context_lens, case.scale)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1].double(), dense_attention(case)[1], **tolerance(torch.float32))
    none = cpu_attention.paged_decode_attention(case.q[:0], case.k_cache, case.v_cache, case.block_tables[:0],
                                                case.context_lens[:0], case.scale)
    assert none.shape == (0, 4, 16)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_batches_match_the_reference(data):
    hkv = data.draw(st.sampled_from([1, 2, 3]))
    hq = hkv * data.draw(st.sampled_from([1, 3, 4]))
    ctx = data.draw(st.lists(st.integers(0, 80), min_size=1, max_size=6))
    window = data.draw(st.one_of(st.none(), st.integers(1, 40)))
    case = make_case(ctx, [1] * len(ctx), hq, hkv, 16, data.draw(st.sampled_from([4, 16])),
                     seed=data.draw(st.integers(0, 1000)))
    out = cpu_attention.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                               case.context_lens, case.scale, window)
    ref = reference.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                           case.context_lens, case.scale, window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_unsupported_caches_are_refused():
    case = make_case([4], [1], 2, 1, 16, dtype=torch.float16)
    assert not cpu_attention.supports(case.k_cache)
    with pytest.raises(KernelError, match="float16"):
        cpu_attention.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                             case.context_lens, case.scale)
    with pytest.raises(KernelError, match="sliding_window"):
        case = make_case([4], [1], 2, 1, 16)
        cpu_attention.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                             case.context_lens, case.scale, 0)


def test_ops_serves_cpu_decode_from_this_kernel():
    """The one interface: on CPU, ``auto`` picks numba for float32/bfloat16 caches, the reference otherwise
    or when asked; forcing numba where it cannot serve names why."""
    cpu = torch.device("cpu")
    assert ops.decode_backend(cpu, torch.float32, "auto") == "numba"
    assert ops.decode_backend(cpu, torch.bfloat16, "auto") == "numba"
    assert ops.decode_backend(cpu, torch.int8, "auto") == "numba"
    assert ops.decode_backend(cpu, torch.float16, "auto") == "torch"
    assert ops.decode_backend(cpu, torch.float32, "torch") == "torch"
    with pytest.raises(KernelError, match="numba decode kernel"):
        ops.decode_backend(cpu, torch.float16, "numba")
    with pytest.raises(KernelError, match="unknown decode attention backend"):
        ops.decode_backend(cpu, torch.float32, "fortran")
    case = make_case([5, 40, 17], [1, 1, 1], 6, 2, 32, 16)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale)
    assert torch.equal(ops.paged_decode_attention(*args, backend="auto"), cpu_attention.paged_decode_attention(*args))
    assert torch.equal(ops.paged_decode_attention(*args, backend="torch"), reference.paged_decode_attention(*args))


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_float32_queries_attend_over_bf16_rows(backend):
    """``kv_cache_dtype="bf16"`` under a float32 engine: float32 queries over bf16 caches, one decode row per
    sequence and query runs (verifications, prompt chunks), through ``ops`` to the numba kernels and the torch
    reference alike: attention over the rows' values (the float64 oracle of the widened cache), float32 out. (Where
    the CPU has ``vdpbf16ps`` the numba kernels take the products in bf16, the query rounded: bf16's tolerance.)
    Queries of another dtype than float32 over bf16 rows are refused."""
    case = make_case([5, 200, 41, 41, 1], [1] * 5, 9, 3, 64, 16, torch.float32)
    rows = type(case)(case.q, case.k_cache.bfloat16(), case.v_cache.bfloat16(), case.block_tables,
                      case.context_lens, case.cu_seqlens_q, case.scale)
    widened = type(case)(case.q, rows.k_cache.float(), rows.v_cache.float(), case.block_tables, case.context_lens,
                         case.cu_seqlens_q, case.scale)
    out = ops.paged_decode_attention(rows.q, rows.k_cache, rows.v_cache, rows.block_tables, rows.context_lens,
                                     rows.scale, None, backend)
    assert out.dtype == torch.float32 and out.shape == case.q.shape
    torch.testing.assert_close(out.double(), dense_attention(widened), **tolerance(torch.bfloat16))
    assert (out.double() - dense_attention(widened)).abs().max() < (out.double() - dense_attention(case)).abs().max()
    runs = make_case([40, 17, 100, 9, 300], [5, 1, 9, 9, 300], 9, 3, 64, 16, torch.float32)
    rows = type(runs)(runs.q, runs.k_cache.bfloat16(), runs.v_cache.bfloat16(), runs.block_tables,
                      runs.context_lens, runs.cu_seqlens_q, runs.scale)
    widened = type(runs)(runs.q, rows.k_cache.float(), rows.v_cache.float(), runs.block_tables, runs.context_lens,
                         runs.cu_seqlens_q, runs.scale)
    out = _prefill(rows, backend=backend)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), dense_attention(widened), **tolerance(torch.bfloat16))
    with pytest.raises(KernelError, match="q is torch.float16 but the cache is torch.bfloat16"):
        ops.paged_decode_attention(case.q.half(), rows.k_cache, rows.v_cache, case.block_tables, case.context_lens,
                                   case.scale, None, backend)


def test_the_weighted_sums_fit_the_registers_numba_compiles_for(monkeypatch):
    """32 sixteen-lane vectors of registers with AVX-512 (one pass of the weighted sums), 8 without (AVX2: passes)."""
    for features, registers in (({"avx2": True, "avx512f": True}, 32), ({"avx2": True, "avx512f": False}, 8), ({}, 8)):
        monkeypatch.setattr(cpu_attention, "_numba_target_features", lambda: features)
        assert cpu_attention._vector_registers.__wrapped__() == registers


def test_an_avx2_build_attends_right(tmp_path):
    """Under ``.ci/avx2-rehearsal`` (numba compiles for Haswell: 16 ymm registers) the weighted sums run in passes
    (``_lane_sums``, ``_group_sums``): prompt runs over bf16 rows and decode rows over float32 and bf16 rows, SmolLM2's
    heads (the specialised decode kernel), against the float64 oracle."""
    code = (
        "import sys, torch\n"
        "from apiary.kernels import cpu_attention, ops\n"
        "from tests.kernels.cases import make_case\n"
        "assert cpu_attention._vector_registers() == 8, 'AVX-512 not hidden'\n"
        "outs = {}\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    c = make_case([5, 200, 41, 300], [1] * 4, 9, 3, 64, 16, dtype)\n"
        "    outs[f'decode {dtype}'] = ops.paged_decode_attention(c.q, c.k_cache, c.v_cache, c.block_tables,\n"
        "                                                         c.context_lens, c.scale)\n"
        "c = make_case([40, 300, 97], [40, 60, 97], 9, 3, 64, 16, torch.bfloat16)\n"
        "outs['runs'] = ops.paged_prefill_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.cu_seqlens_q,\n"
        "                                           c.context_lens, c.scale)\n"
        "torch.save(outs, sys.argv[1])\n"
    )
    out = tmp_path / "avx2.pt"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PYTHONPATH": str(root)}
    done = subprocess.run([str(root / ".ci" / "avx2-rehearsal"), sys.executable, "-c", code, str(out)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    outs = torch.load(out)
    for dtype in (torch.float32, torch.bfloat16):
        case = make_case([5, 200, 41, 300], [1] * 4, 9, 3, 64, 16, dtype)
        torch.testing.assert_close(outs[f"decode {dtype}"].double(), dense_attention(case), **tolerance(dtype))
    case = make_case([40, 300, 97], [40, 60, 97], 9, 3, 64, 16, torch.bfloat16)
    torch.testing.assert_close(outs["runs"].double(), dense_attention(case), **tolerance(torch.bfloat16))


def test_float32_rows_are_written_into_bf16_caches_rounded():
    """``ops.write_kv`` of float32 rows into bf16 caches: each row rounded as torch's cast rounds (ties to even);
    skipped slots untouched."""
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(5, 3, 64, generator=g), torch.randn(5, 3, 64, generator=g)
    k_cache, v_cache = torch.zeros(4, 4, 3, 64, dtype=torch.bfloat16), torch.zeros(4, 4, 3, 64, dtype=torch.bfloat16)
    slots = torch.tensor([9, 0, -1, 15, 4])
    ops.write_kv(key, value, k_cache, v_cache, slots)
    keep = slots >= 0
    assert torch.equal(k_cache.view(16, 3, 64)[slots[keep]], key[keep].bfloat16())
    assert torch.equal(v_cache.view(16, 3, 64)[slots[keep]], value[keep].bfloat16())
    assert int(torch.count_nonzero(k_cache.view(16, -1).abs().sum(-1))) == 4


# ---------------------------------------------------------------- query runs (verifications, prompt chunks)

def _prefill(case, window=None, scales=(), backend=None):  # type: ignore[no-untyped-def]
    return ops.paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.cu_seqlens_q,
                                       case.context_lens, case.scale, window, *scales, backend=backend)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ctx,q_lens,hq,hkv,d,window", [
    ([40, 17, 100, 9], [5, 1, 9, 9], 9, 3, 64, None),   # SmolLM2's heads: a verification batch (k = 4 / 0 / 8)
    ([33, 200, 16], [16, 3, 16], 8, 2, 32, None),       # the longest short run, two lane chunks
    ([90, 31, 60], [7, 2, 40], 4, 4, 16, 10),           # sliding window, a 40-token chunk beside short runs
    ([30, 18, 70], [4, 1, 30], 9, 3, 64, 1),            # a window of one token
    ([9, 70, 33], [2, 8, 33], 4, 1, 128, None),         # Llama 3's head dim; a fresh 33-token prompt beside them
    ([300, 140, 97], [300, 60, 17], 9, 3, 64, None),    # a fresh prompt, a chunk over a cached prefix, 17 queries
    ([260, 75], [200, 75], 6, 2, 32, 50),               # long runs under a window
])
def test_query_runs_match_dense_attention(ctx, q_lens, hq, hkv, d, window, dtype):
    """Verifications and prompt chunks (each query causal over the cache) from the numba kernels, put back in
    their rows: all against the float64 oracle."""
    case = make_case(ctx, q_lens, hq, hkv, d, 16, dtype)
    out = _prefill(case, window)
    assert out.dtype == dtype and out.shape == case.q.shape
    torch.testing.assert_close(out.double(), dense_attention(case, window), **tolerance(dtype))


def test_query_runs_over_int8_caches_attend_over_the_rows_they_stand_for():
    case = make_case([40, 17, 100, 5, 150], [5, 1, 9, 5, 150], 9, 3, 64, 16, torch.bfloat16)
    q8 = quantize_case(case)
    int8_case = type(case)(case.q, q8.k_cache, q8.v_cache, case.block_tables, case.context_lens,
                           case.cu_seqlens_q, case.scale)
    out = _prefill(int8_case, None, (q8.k_scale, q8.v_scale))
    torch.testing.assert_close(out.double(), dense_attention(q8.dequantized), **tolerance(torch.bfloat16))


def test_short_runs_go_to_the_varlen_kernel_long_ones_to_the_chunked_one(monkeypatch):
    """The routing: numba (``auto`` on CPU) sends runs of at most ``SHORT_QUERIES`` to ``_varlen`` (one item per
    sequence) and longer ones to ``_runs`` (items of 16 rows); the ``torch`` backend and head dims the kernels'
    lanes do not divide go to the reference whole."""
    served: dict[str, list[list[int]]] = {"_varlen": [], "_runs": []}
    for name in served:
        kernel = getattr(cpu_attention, name)

        def spy(*args, _name=name, _kernel=kernel):  # type: ignore[no-untyped-def]
            served[_name].append(args[9].tolist())
            return _kernel(*args)

        monkeypatch.setattr(cpu_attention, name, spy)
    case = make_case([30, 200, 17, 60, 5], [4, 100, 17, 16, 0], 6, 2, 32, 16)
    out = _prefill(case)
    assert served == {"_varlen": [[0, 3]], "_runs": [[1, 2]]}  # 17 queries is one past the limit; 0 runs nowhere
    torch.testing.assert_close(out.double(), dense_attention(case), **tolerance(torch.float32))
    ref = reference.paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                            case.cu_seqlens_q, case.context_lens, case.scale)
    assert torch.equal(_prefill(case, backend="torch"), ref)
    odd = make_case([30, 9], [4, 2], 4, 2, 24, 16)  # 24 is not a multiple of the 16 lanes
    _prefill(odd)
    assert len(served["_varlen"]) == 1 and len(served["_runs"]) == 1


def test_query_runs_need_their_tokens_counted_in_the_context():
    case = make_case([3, 20], [4, 2], 4, 2, 32, 16)
    with pytest.raises(KernelError, match="context_lens must count"):
        _prefill(case)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_query_runs_match_the_reference(data):
    hkv = data.draw(st.sampled_from([1, 2, 3]))
    hq = hkv * data.draw(st.sampled_from([1, 3, 4]))
    q_lens = data.draw(st.lists(st.integers(0, 70), min_size=1, max_size=6))
    ctx = [q + data.draw(st.integers(0, 60)) for q in q_lens]
    window = data.draw(st.one_of(st.none(), st.integers(1, 40)))
    case = make_case(ctx, q_lens, hq, hkv, data.draw(st.sampled_from([16, 32])), data.draw(st.sampled_from([4, 16])),
                     seed=data.draw(st.integers(0, 1000)))
    ref = reference.paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                            case.cu_seqlens_q, case.context_lens, case.scale, window)
    torch.testing.assert_close(_prefill(case, window), ref, atol=1e-5, rtol=1e-5)


def test_query_runs_are_right_on_every_thread_count():
    """Sequences and 16-row items run in parallel (numba's prange): each thread's scratch arrays must be its own.
    Two threads caught a buffer freed while the kernel still wrote to it through its address."""
    import numba

    case = make_case([40, 17, 100, 9, 60, 33, 150, 90], [5, 1, 9, 9, 16, 3, 150, 40], 9, 3, 64, 16)
    threads = torch.get_num_threads()
    try:
        for n in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            torch.set_num_threads(n)  # the kernel runs on min(torch's, numba's) threads
            torch.testing.assert_close(_prefill(case).double(), dense_attention(case), **tolerance(torch.float32))
    finally:
        torch.set_num_threads(threads)
