"""The numba CPU decode-attention kernel against the dense float64 oracle and the torch reference."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from apiary.cloud.engine import cpu_attention
from apiary.cloud.engine.config import EngineConfig
from apiary.cloud.engine.errors import EngineError
from apiary.kernels import reference
from tests.kernels.cases import dense_attention, make_case, tolerance

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ctx,hq,hkv,d,bs,window", [
    ([1, 16, 17, 100], 8, 2, 32, 16, None),  # block boundaries, GQA 4
    ([3, 64], 3, 1, 64, 16, None),           # one KV head for all queries
    ([33, 7, 90], 4, 4, 32, 16, 10),         # no GQA, sliding window
    ([30, 2], 9, 3, 24, 4, 1),               # window of one token, odd head_dim, small blocks
    ([5, 200, 41, 41, 1], 9, 3, 64, 16, None),  # SmolLM2's head layout
])
def test_matches_dense_attention(ctx, hq, hkv, d, bs, window, dtype):
    case = make_case(ctx, [1] * len(ctx), hq, hkv, d, bs, dtype)  # tables padded with -1 past the blocks in use
    out = cpu_attention.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                               case.context_lens, case.scale, window)
    assert out.dtype == dtype and out.shape == case.q.shape
    torch.testing.assert_close(out.double(), dense_attention(case, window), **tolerance(dtype))


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
    with pytest.raises(ValueError, match="float16"):
        cpu_attention.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                             case.context_lens, case.scale)
    with pytest.raises(ValueError, match="sliding_window"):
        case = make_case([4], [1], 2, 1, 16)
        cpu_attention.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                             case.context_lens, case.scale, 0)


def test_engine_config_names_the_backend():
    with pytest.raises(EngineError, match="cpu_attention"):
        EngineConfig(model_path="x.gguf", cpu_attention="fortran")  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_model_batched_tokens_match_the_torch_backend(real_engine, gguf_path):
    """16 mixed-length SmolLM2 requests decoded together: the numba kernel (the default on CPU) and
    the torch reference pick the same greedy tokens, or differ only at near-ties."""
    from apiary.cloud.engine import LLMEngine, SamplingParams
    from tests.cloud.engine.test_real_batching import check_same_or_near_tie, generate_all, make_prompts

    assert real_engine.runner.model.ragged_decode
    torch_engine = LLMEngine(EngineConfig(model_path=gguf_path, dtype="float32", kv_cache_bytes=128 << 20,
                                          cpu_attention="torch"))
    assert not torch_engine.runner.model.ragged_decode
    prompts = make_prompts(real_engine)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    real_engine.reset_prefix_cache()
    ours = generate_all(real_engine, prompts, params)
    theirs = generate_all(torch_engine, prompts, params)
    for p, ref, got in zip(prompts, theirs, ours):
        check_same_or_near_tie(torch_engine, p, ref, got)
    assert sum(a == b for a, b in zip(ours, theirs)) >= 14
