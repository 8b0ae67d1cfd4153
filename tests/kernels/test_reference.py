"""The torch references (the CPU production path) against naive dense float64 computations."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from apiary.kernels import reference
from tests.kernels.cases import dense_attention, make_case, quantize_case, tolerance

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (context_lens, q_lens, Hq, Hkv, head_dim, block_size, sliding_window)
PREFILL_SHAPES = [
    ([1], [1], 4, 4, 32, 16, None),                      # length 1
    ([16], [16], 6, 2, 32, 16, None),                    # exactly one block, full prefill
    ([17, 33, 5], [3, 33, 5], 9, 3, 64, 16, None),       # ragged, crossing block boundaries, chunked
    ([40, 12, 64, 3], [1, 12, 4, 1], 8, 1, 16, 8, None),  # mixed decode + prefill, GQA 8
    ([50, 20], [7, 1], 4, 1, 32, 16, 8),                 # sliding window
    ([30], [5], 8, 2, 24, 4, 1),                         # window of one token, head_dim not a power of 2
    # chunks of >= SOLO_QUERIES run alone (fresh and continuing) beside bucketed short ones
    ([200, 150, 140, 20, 9], [200, 130, 128, 20, 1], 4, 2, 16, 16, None),
    ([160, 131], [140, 131], 4, 1, 8, 16, 33),           # solo chunks under a sliding window
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", PREFILL_SHAPES)
def test_prefill_reference_matches_dense(shape, dtype):
    ctx, q_lens, hq, hkv, d, bs, window = shape
    case = make_case(ctx, q_lens, hq, hkv, d, bs, dtype)
    out = reference.paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                            case.cu_seqlens_q, case.context_lens, case.scale, window)
    assert out.dtype == dtype and out.shape == case.q.shape
    torch.testing.assert_close(out.double(), dense_attention(case, window), **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", PREFILL_SHAPES)
def test_prefill_over_int8_caches_matches_dense_over_their_rows(shape, dtype):
    ctx, q_lens, hq, hkv, d, bs, window = shape
    case = make_case(ctx, q_lens, hq, hkv, d, bs, dtype)
    q8 = quantize_case(case)
    out = reference.paged_prefill_attention(case.q, q8.k_cache, q8.v_cache, case.block_tables, case.cu_seqlens_q,
                                            case.context_lens, case.scale, window, q8.k_scale, q8.v_scale)
    assert out.dtype == dtype and out.shape == case.q.shape
    torch.testing.assert_close(out.double(), dense_attention(q8.dequantized, window), **tolerance(dtype))


def test_write_kv_int8_keeps_each_row_within_half_a_step_of_its_scale():
    """Each token's row per KV head gets its own scale (absmax / 127): the stored int8 times the scale is
    within half a quantization step of the row; skipped slots stay untouched; a row of zeros stays zeros."""
    k_cache, v_cache = (torch.zeros(4, 4, 2, 8, dtype=torch.int8) for _ in range(2))
    k_scale, v_scale = (torch.zeros(4, 4, 2) for _ in range(2))
    key, value = torch.randn(3, 2, 8) * torch.tensor([1.0, 30.0])[:, None], torch.randn(3, 2, 8)
    key[2, 1] = 0.0
    reference.write_kv_int8(key, value, k_cache, v_cache, k_scale, v_scale, torch.tensor([13, -1, 0]))
    for token, (block, offset) in ((0, (3, 1)), (2, (0, 0))):
        for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
            step = x[token].abs().amax(-1).clamp(min=1e-8) / 127
            torch.testing.assert_close(scale[block, offset], step)
            assert ((cache[block, offset].float() * step[:, None] - x[token]).abs() <= step[:, None] / 2 + 1e-6).all()
    assert torch.equal(k_cache[0, 0, 1], torch.zeros(8, dtype=torch.int8))
    assert int((k_scale != 0).sum()) == int((v_scale != 0).sum()) == 4  # two tokens x two heads, nothing for slot -1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ctx,hq,hkv,window", [([1, 16, 17, 100], 8, 2, None), ([3, 64], 3, 1, None),
                                               ([33, 7, 90], 4, 4, 10)])
def test_decode_reference_matches_dense(ctx, hq, hkv, window, dtype):
    case = make_case(ctx, [1] * len(ctx), hq, hkv, 32, 16, dtype, pad_value=0)
    out = reference.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                           case.context_lens, case.scale, window)
    torch.testing.assert_close(out.double(), dense_attention(case, window), **tolerance(dtype))


def test_empty_sequences_yield_zeros():
    case = make_case([0, 5], [1, 1], 4, 2, 16)
    out = reference.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                           case.context_lens, case.scale)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1].double(), dense_attention(case)[1], **tolerance(torch.float32))


def test_prefill_skips_sequences_without_queries():
    case = make_case([9, 4, 12], [2, 0, 3], 4, 2, 16)
    out = reference.paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                            case.cu_seqlens_q, case.context_lens, case.scale)
    torch.testing.assert_close(out.double(), dense_attention(case), **tolerance(torch.float32))


def test_write_kv_scatters_and_skips_negative_slots():
    k_cache = torch.zeros(4, 4, 2, 8)
    v_cache = torch.zeros(4, 4, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    reference.write_kv(key, value, k_cache, v_cache, torch.tensor([13, -1, 0]))
    assert torch.equal(k_cache[3, 1], key[0]) and torch.equal(v_cache[3, 1], value[0])
    assert torch.equal(k_cache[0, 0], key[2]) and torch.equal(v_cache[0, 0], value[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2  # the skipped token landed nowhere


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reference(dtype):
    x, res, w = torch.randn(5, 48).to(dtype), torch.randn(5, 48).to(dtype), torch.randn(48)
    s = (x.double() + res.double()).to(dtype).double()
    expected = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    out, new_res = reference.rms_norm(x, w, 1e-6, res)
    assert out.dtype == dtype and new_res.dtype == dtype
    torch.testing.assert_close(new_res.double(), s)
    torch.testing.assert_close(out.double(), expected, **tolerance(dtype))
    plain = reference.rms_norm(x, w, 1e-6)
    xd = x.double()
    torch.testing.assert_close(plain.double(), xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double(),
                               **tolerance(dtype))


def test_rotary_reference_matches_complex_rotation():
    """Rotate-half RoPE is a complex rotation of the pairs (x[i], x[i + D/2]) by pos * theta_i."""
    head_dim, positions = 16, torch.tensor([0, 3, 7, 100])
    cache = reference.rotary_cos_sin_cache(128, head_dim)
    q, k = torch.randn(4, 3, head_dim), torch.randn(4, 1, head_dim)
    rq, rk = reference.apply_rotary(q, k, positions, cache)
    theta = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle = positions[:, None, None].double() * theta
    for x, rx in ((q, rq), (k, rk)):
        z = torch.complex(x[..., :head_dim // 2].double(), x[..., head_dim // 2:].double()) * torch.polar(
            torch.ones_like(angle), angle)
        torch.testing.assert_close(rx.double(), torch.cat((z.real, z.imag), -1), atol=1e-5, rtol=1e-5)
    assert torch.equal(rq[0], q[0])  # position 0 is the identity


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_prefill_reference_random_batches(data):
    """Random ragged batches: any mix of decodes, chunks and whole prompts, any GQA ratio, any window."""
    hkv = data.draw(st.integers(1, 3))
    hq = hkv * data.draw(st.sampled_from([1, 2, 3, 4, 8]))
    ctx = data.draw(st.lists(st.integers(0, 70), min_size=1, max_size=5))
    q_lens = [data.draw(st.integers(0, c)) for c in ctx]
    window = data.draw(st.none() | st.integers(1, 80))
    case = make_case(ctx, q_lens, hq, hkv, 8, data.draw(st.sampled_from([1, 4, 16])), seed=data.draw(st.integers(0, 9)))
    out = reference.paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                            case.cu_seqlens_q, case.context_lens, case.scale, window)
    torch.testing.assert_close(out.double(), dense_attention(case, window), **tolerance(torch.float32))


def test_gather_buffer_survives_switching_inference_mode() -> None:
    """The engine runs under inference_mode, other callers do not: the reused CPU buffer must serve both."""
    import torch

    from apiary.kernels import reference

    k_cache = torch.randn(4, 16, 2, 8)
    v_cache = torch.randn(4, 16, 2, 8)
    q = torch.randn(1, 4, 8)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    lens = torch.tensor([20], dtype=torch.int32)
    with torch.inference_mode():
        inside = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.35).clone()
    outside = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.35)
    torch.testing.assert_close(inside, outside)


def test_decode_plan_is_reused_per_step_but_never_stale():
    """Layers of one step share the block tables, so gather indices are built once; a table changed
    in place, or new tables, get a fresh plan."""
    case = make_case([20, 7, 33], [1, 1, 1], 4, 2, 16, block_size=4)
    bs, hkv = case.k_cache.shape[1], case.k_cache.shape[2]
    plan = reference._decode_plan(case.block_tables, case.context_lens, bs, hkv, None)
    assert reference._decode_plan(case.block_tables, case.context_lens, bs, hkv, None) is plan
    assert reference._decode_plan(case.block_tables, case.context_lens, bs, hkv, 5) is not plan
    unused = sorted(set(range(case.k_cache.shape[0])) - set(case.block_tables.flatten().tolist()))
    case.block_tables[0, 0] = unused[0]  # in place: sequence 0 now reads another block
    out = reference.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                           case.context_lens, case.scale)
    torch.testing.assert_close(out.double(), dense_attention(case), **tolerance(torch.float32))
    for _ in range(3):  # fresh tensors every time, as every engine step makes
        fresh = make_case([9, 30], [1, 1], 4, 2, 16, block_size=4, seed=_)
        out = reference.paged_decode_attention(fresh.q, fresh.k_cache, fresh.v_cache, fresh.block_tables,
                                               fresh.context_lens, fresh.scale)
        torch.testing.assert_close(out.double(), dense_attention(fresh), **tolerance(torch.float32))


def test_prefill_runs_long_chunks_alone_and_buckets_short_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Padding a 335-token prompt to a 512-token neighbour costs 2.3x its attention: chunks of
    >= SOLO_QUERIES queries get a call each; short ones still share power-of-two buckets."""
    groups: list[list[int]] = []
    real = reference._prefill_group

    def spy(q, out, seqs, *args):  # type: ignore[no-untyped-def]
        groups.append(sorted(seqs.tolist()))
        return real(q, out, seqs, *args)

    monkeypatch.setattr(reference, "_prefill_group", spy)
    n = reference.SOLO_QUERIES
    case = make_case([n + 200, n, 3 * n, 5, 6], [n + 200, n, n + 1, 5, 6], 2, 1, 8)
    reference.paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.cu_seqlens_q,
                                      case.context_lens, case.scale)
    assert sorted(groups) == [[0], [1], [2], [3, 4]]
