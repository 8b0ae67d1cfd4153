"""Every Triton kernel, called through ``apiary.kernels.ops`` with the Triton backend forced, against the torch reference.

On CPU these run in the Triton interpreter; on CUDA, compiled. Shapes are small (the interpreter
is slow) but cover ragged lengths, block boundaries, GQA ratios 1/3/4/8, length 1, exactly one
block, head dims that are not powers of two, sliding windows, empty sequences, and split-K decode.
The expected values are the reference computed in fp32 from the very same (rounded) inputs, so the
tolerance only has to absorb the kernel's own rounding of probabilities and outputs.
"""
from __future__ import annotations

import random

import pytest
import torch

from apiary.kernels import ops, reference
from tests.kernels.cases import dense_attention, make_case, tolerance

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (context_lens, Hq, Hkv, head_dim, block_size, sliding_window, partition_size)
DECODE_SHAPES = [
    ([1], 4, 4, 32, 16, None, 512),                     # length 1, GQA 1
    ([16, 16], 6, 2, 32, 16, None, 512),                # exactly one block, GQA 3
    ([17, 1, 33, 100], 8, 2, 64, 16, None, 512),        # ragged, across block boundaries, GQA 4
    ([40, 7], 8, 1, 32, 8, None, 512),                  # GQA 8, block size 8
    ([90, 33, 7], 4, 4, 32, 16, 10, 512),               # sliding window
    ([200, 5, 64, 130], 9, 3, 64, 16, None, 32),        # split-K: many partitions, some past the end
    ([150, 20], 4, 1, 32, 16, 40, 16),                  # split-K with a window: leading partitions empty
    ([20, 3], 4, 2, 24, 4, None, 8),                    # head_dim 24 (padded to 32), block size 4, split
    ([0, 5], 4, 2, 16, 16, None, 512),                  # a padding row with no context yields zeros
]

# (context_lens, q_lens, Hq, Hkv, head_dim, block_size, sliding_window)
PREFILL_SHAPES = [
    ([1], [1], 4, 4, 32, 16, None),                      # length 1
    ([16], [16], 6, 2, 32, 16, None),                    # exactly one block, whole prompt
    ([17, 33, 5], [3, 33, 5], 9, 3, 64, 16, None),       # chunked prefill over a cached prefix, ragged
    ([40, 12, 64, 3], [1, 12, 4, 1], 8, 1, 16, 8, None),  # mixed decode/prefill/spec-verify (k+1=4), GQA 8
    ([50, 20], [7, 1], 4, 1, 32, 16, 8),                 # sliding window
    ([100], [70], 8, 2, 32, 16, None),                   # several query tiles and key tiles, GQA 4
    ([9, 4, 12], [2, 0, 3], 4, 2, 16, 16, None),         # a sequence with no new tokens
    ([30, 9], [5, 9], 8, 2, 24, 4, 1),                   # window of 1, head_dim 24, block size 4
]


def _rounding(dtype: torch.dtype, device: str) -> dict[str, float]:
    """Exact, except that the interpreter truncates fp32 -> bf16 casts (ignoring round-to-nearest): one ulp there."""
    if dtype == torch.bfloat16 and device == "cpu":
        return dict(atol=1e-30, rtol=2.0 ** -7)
    return dict(atol=0.0, rtol=0.0)


def _fp32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.float() for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: f"ctx{s[0]}-h{s[1]}x{s[2]}-d{s[3]}-w{s[5]}-p{s[6]}")
def test_paged_decode_attention(shape, dtype, device, triton_backend):
    from apiary.kernels import paged_attention

    ctx, hq, hkv, d, bs, window, partition = shape
    c = make_case(ctx, [1] * len(ctx), hq, hkv, d, bs, dtype, device)
    out = paged_attention.paged_decode_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.context_lens, c.scale,
                                                 window, partition_size=partition)
    q, kc, vc = _fp32(c.q, c.k_cache, c.v_cache)
    expected = reference.paged_decode_attention(q, kc, vc, c.block_tables, c.context_lens, c.scale, window)
    assert out.dtype == dtype and out.shape == c.q.shape
    torch.testing.assert_close(out.float(), expected, **tolerance(dtype))
    via_ops = ops.paged_decode_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.context_lens, c.scale, window)
    torch.testing.assert_close(via_ops.float(), expected, **tolerance(dtype))


def test_split_k_merge_is_exact_in_fp32(device, triton_backend):
    """Splitting one long context into 1, 2, 4, ... partitions must not change the answer beyond fp32 noise."""
    from apiary.kernels import paged_attention

    c = make_case([256, 255, 129], [1, 1, 1], 8, 2, 32, 16, torch.float32, device)
    gold = dense_attention(c)
    for partition in (512, 128, 64, 16):
        out = paged_attention.paged_decode_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.context_lens,
                                                     c.scale, partition_size=partition)
        torch.testing.assert_close(out.double().cpu(), gold, atol=2e-5, rtol=1e-4)


def test_decode_is_stable_with_huge_scores(device, triton_backend):
    """Scores of several hundred overflow a naive fp32 exp; the online softmax and the split merge must not."""
    from apiary.kernels import paged_attention

    c = make_case([70, 33], [1, 1], 4, 2, 32, 16, torch.float32, device)
    c.q.mul_(300.0)
    expected = reference.paged_decode_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.context_lens, c.scale)
    for partition in (512, 16):
        out = paged_attention.paged_decode_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.context_lens,
                                                     c.scale, partition_size=partition)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=lambda s: f"ctx{s[0]}-q{s[1]}-h{s[2]}x{s[3]}-d{s[4]}-w{s[6]}")
def test_paged_prefill_attention(shape, dtype, device, triton_backend):
    ctx, q_lens, hq, hkv, d, bs, window = shape
    c = make_case(ctx, q_lens, hq, hkv, d, bs, dtype, device)
    out = ops.paged_prefill_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.cu_seqlens_q, c.context_lens,
                                      c.scale, window)
    q, kc, vc = _fp32(c.q, c.k_cache, c.v_cache)
    expected = reference.paged_prefill_attention(q, kc, vc, c.block_tables, c.cu_seqlens_q, c.context_lens, c.scale,
                                                 window)
    assert out.dtype == dtype and out.shape == c.q.shape
    torch.testing.assert_close(out.float(), expected, **tolerance(dtype))


@pytest.mark.parametrize("seed", range(4))
def test_prefill_random_batches(seed, device, triton_backend):
    """Random ragged mixed batches (decodes, chunks, fresh prompts) with random GQA ratios and windows."""
    rng = random.Random(seed)
    hkv = rng.choice([1, 2, 3])
    hq = hkv * rng.choice([1, 3, 4, 8])
    ctx, q_lens = [], []
    for _ in range(rng.randint(1, 5)):
        c_len = rng.randint(1, 90)
        ctx.append(c_len)
        q_lens.append(rng.choice([1, c_len, rng.randint(1, c_len)]))
    window = rng.choice([None, rng.randint(1, 40)])
    c = make_case(ctx, q_lens, hq, hkv, 32, rng.choice([4, 8, 16]), torch.float32, device, seed=seed)
    out = ops.paged_prefill_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.cu_seqlens_q, c.context_lens,
                                      c.scale, window)
    torch.testing.assert_close(out.double().cpu(), dense_attention(c, window), **tolerance(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv(dtype, device, triton_backend):
    k_cache = torch.zeros(5, 4, 3, 24, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    fused = torch.randn(6, 2 * 3 * 24, device=device).to(dtype)
    key, value = fused[:, :72].view(6, 3, 24), fused[:, 72:].view(6, 3, 24)  # strided views, as from a QKV split
    slots = torch.tensor([19, -1, 0, 4, 7, -5], device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(key, value, k_ref, v_ref, slots)
    ops.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(k_cache.view(-1, 3, 24)[19], key[0])


def test_write_kv_converts_to_cache_dtype(device, triton_backend):
    """fp32 K/V into a bf16 cache. Compiled code rounds to nearest like torch; the interpreter truncates
    fp32 -> bf16 (its cast ignores the rounding mode), so there it is held to one bf16 ulp."""
    k_cache = torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16, device=device)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(3, 2, 16, device=device), torch.randn(3, 2, 16, device=device)
    ops.write_kv(key, value, k_cache, v_cache, torch.tensor([1, 2, 7], device=device))
    ulp = _rounding(torch.bfloat16, device)
    torch.testing.assert_close(k_cache.view(-1, 2, 16)[[1, 2, 7]].float(), key.bfloat16().float(), **ulp)
    torch.testing.assert_close(v_cache.view(-1, 2, 16)[[1, 2, 7]].float(), value.bfloat16().float(), **ulp)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [48, 576])
def test_rms_norm(hidden, dtype, device, triton_backend):
    x = torch.randn(2, 5, hidden, device=device).to(dtype)
    residual = torch.randn(2, 5, hidden, device=device).to(dtype)
    weight = torch.randn(hidden, device=device)
    out = ops.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out.float(), reference.rms_norm(x, weight, 1e-5).float(), **tolerance(dtype))
    out, new_residual = ops.rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_residual = reference.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(new_residual.float(), ref_residual.float(), **_rounding(dtype, device))
    torch.testing.assert_close(out.float(), ref_out.float(), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_apply_rotary(dtype, device, triton_backend):
    cache = reference.rotary_cos_sin_cache(512, 64, device=device)
    qkv = torch.randn(7, (9 + 3 + 3) * 64, device=device).to(dtype)
    q, k = qkv[:, :576].view(7, 9, 64), qkv[:, 576:768].view(7, 3, 64)  # strided views
    positions = torch.tensor([0, 1, 2, 15, 16, 300, 511], device=device)
    rq, rk = ops.apply_rotary(q, k, positions, cache)
    eq, ek = reference.apply_rotary(q, k, positions, cache)
    assert rq.dtype == dtype and rk.shape == k.shape
    torch.testing.assert_close(rq.float(), eq.float(), **tolerance(dtype))
    torch.testing.assert_close(rk.float(), ek.float(), **tolerance(dtype))


def test_attention_accepts_int64_indices_and_strided_queries(device, triton_backend):
    """Index tensors in int64, zero-padded block tables and q as a strided view of a fused projection."""
    c = make_case([37, 5, 16], [1, 1, 1], 8, 2, 32, 16, torch.float32, device, pad_value=0)
    fused = torch.randn(3, 8 * 32 + 64, device=device)
    q = fused[:, :256].view(3, 8, 32)
    expected = reference.paged_decode_attention(q, c.k_cache, c.v_cache, c.block_tables, c.context_lens, c.scale)
    out = ops.paged_decode_attention(q, c.k_cache, c.v_cache, c.block_tables.long(), c.context_lens.long(), c.scale)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    out = ops.paged_prefill_attention(q, c.k_cache, c.v_cache, c.block_tables.long(), c.cu_seqlens_q.long(),
                                      c.context_lens.long(), c.scale)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
