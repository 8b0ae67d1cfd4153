"""The dispatching interface: backend selection and clear errors for bad input."""
from __future__ import annotations

import pytest
import torch

from apiary.kernels import ops, reference
from apiary.kernels.errors import KernelError
from tests.kernels.cases import make_case, quantize_case


@pytest.fixture
def restore_backend():
    previous = ops._backend
    yield
    ops._backend = previous


def test_auto_uses_torch_on_cpu(restore_backend, monkeypatch):
    monkeypatch.delenv("APIARY_KERNELS", raising=False)
    ops.set_backend("auto")
    assert ops.get_backend() == "auto"
    assert ops.resolve_backend(torch.device("cpu")) == "torch"


def test_env_var_selects_backend_unless_overridden(restore_backend, monkeypatch):
    ops._backend = None
    monkeypatch.setenv("APIARY_KERNELS", "torch")
    assert ops.get_backend() == "torch"
    assert ops.resolve_backend(torch.device("cuda")) == "torch"
    ops.set_backend("auto")
    assert ops.get_backend() == "auto"
    ops._backend = None
    monkeypatch.setenv("APIARY_KERNELS", "cuda-please")
    with pytest.raises(KernelError, match="APIARY_KERNELS"):
        ops.get_backend()


def test_set_backend_rejects_unknown_names(restore_backend):
    with pytest.raises(KernelError, match="unknown kernel backend"):
        ops.set_backend("cuda")


def test_forced_triton_on_cpu_needs_the_interpreter(restore_backend, monkeypatch):
    ops.set_backend("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if ops.triton_available():
        with pytest.raises(KernelError, match="TRITON_INTERPRET=1"):
            ops.resolve_backend(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if ops.triton_available():
        assert ops.resolve_backend(torch.device("cpu")) == "triton"


def test_auto_on_cpu_is_the_reference_where_numba_does_not_serve(restore_backend):
    """Prefill attention on CPU: the reference for caches numba does not take (float16) and head dims its lanes
    do not divide; every run otherwise from the numba kernels (tests/kernels/test_cpu_attention.py), the same
    values."""
    ops.set_backend("auto")
    half = make_case([20, 3], [4, 3], 6, 2, 16, dtype=torch.float16)
    args = (half.q, half.k_cache, half.v_cache, half.block_tables, half.cu_seqlens_q, half.context_lens, half.scale)
    assert torch.equal(ops.paged_prefill_attention(*args), reference.paged_prefill_attention(*args))
    odd = make_case([40, 30], [40, 17], 6, 2, 24)
    args = (odd.q, odd.k_cache, odd.v_cache, odd.block_tables, odd.cu_seqlens_q, odd.context_lens, odd.scale)
    assert torch.equal(ops.paged_prefill_attention(*args), reference.paged_prefill_attention(*args))
    long = make_case([40, 30], [40, 17], 6, 2, 16)
    args = (long.q, long.k_cache, long.v_cache, long.block_tables, long.cu_seqlens_q, long.context_lens, long.scale)
    torch.testing.assert_close(ops.paged_prefill_attention(*args), reference.paged_prefill_attention(*args),
                               atol=1e-5, rtol=1e-5)
    c = make_case([20, 3], [4, 3], 6, 2, 16)
    args = (c.q, c.k_cache, c.v_cache, c.block_tables, c.cu_seqlens_q, c.context_lens, c.scale)
    torch.testing.assert_close(ops.paged_prefill_attention(*args), reference.paged_prefill_attention(*args),
                               atol=1e-5, rtol=1e-5)


def _decode_args(**overrides):
    c = make_case([20, 3], [1, 1], 6, 2, 16)
    args = dict(q=c.q, k_cache=c.k_cache, v_cache=c.v_cache, block_tables=c.block_tables,
                context_lens=c.context_lens, scale=c.scale)
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides,match", [
    (dict(q=torch.randn(2, 6)), "q must have 3 dims"),
    (dict(q=torch.randn(2, 5, 16)), "multiple of KV heads"),
    (dict(q=torch.randn(2, 6, 32)), "head_dim"),
    (dict(q=torch.randn(2, 6, 16).half()), "cache is torch.float32"),
    (dict(q=torch.randint(0, 3, (2, 6, 16))), "float32/float16/bfloat16"),
    (dict(block_tables=torch.zeros(3, 4, dtype=torch.int32)), "block_tables has 3 rows"),
    (dict(block_tables=torch.zeros(2, 4)), "block_tables must be an integer tensor"),
    (dict(context_lens=torch.tensor([5], dtype=torch.int32)), "context_lens has 1 entries"),
    (dict(scale=0.0), "scale must be a positive float"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(k_cache=torch.zeros(4, 16, 2, 16).transpose(1, 2)), "k_cache must have|differ|contiguous"),
    (dict(v_cache=torch.zeros(4, 16, 2, 16)), "differ"),
    (dict(q=[1, 2, 3]), "q must be a torch.Tensor"),
])
def test_decode_rejects_bad_input(overrides, match):
    with pytest.raises(KernelError, match=match):
        ops.paged_decode_attention(**_decode_args(**overrides))


def test_prefill_rejects_mismatched_offsets():
    c = make_case([20, 3], [4, 3], 6, 2, 16)
    with pytest.raises(KernelError, match="has 2 rows for 3 sequences"):
        ops.paged_prefill_attention(c.q, c.k_cache, c.v_cache, c.block_tables, torch.tensor([0, 2, 4, 7]),
                                    c.context_lens, c.scale)
    with pytest.raises(KernelError, match="cu_seqlens_q must have 1 dims"):
        ops.paged_prefill_attention(c.q, c.k_cache, c.v_cache, c.block_tables, torch.zeros(2, 2, dtype=torch.int32),
                                    c.context_lens, c.scale)


def test_write_kv_rejects_bad_input():
    k_cache, v_cache = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    key = torch.randn(3, 2, 8)
    with pytest.raises(KernelError, match="slot_mapping has 2 slots for 3 tokens"):
        ops.write_kv(key, key, k_cache, v_cache, torch.tensor([0, 1]))
    with pytest.raises(KernelError, match="cache holds"):
        ops.write_kv(torch.randn(3, 1, 8), torch.randn(3, 1, 8), k_cache, v_cache, torch.tensor([0, 1, 2]))
    with pytest.raises(KernelError, match="integer"):
        ops.write_kv(key, key, k_cache, v_cache, torch.tensor([0.0, 1.0, 2.0]))
    assert not k_cache.any()  # nothing was half-written


def test_rms_norm_and_rotary_reject_bad_input():
    with pytest.raises(KernelError, match="must match weight"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(KernelError, match="residual"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6, residual=torch.randn(3, 8))
    with pytest.raises(KernelError, match="eps"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(8), -1.0)
    cache = reference.rotary_cos_sin_cache(16, 8)
    with pytest.raises(KernelError, match="token count"):
        ops.apply_rotary(torch.randn(2, 4, 8), torch.randn(3, 2, 8), torch.tensor([0, 1]), cache)
    with pytest.raises(KernelError, match="head_dim"):
        ops.apply_rotary(torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.tensor([0, 1]),
                         reference.rotary_cos_sin_cache(16, 6))


def test_empty_batches_are_fine():
    out = ops.paged_decode_attention(**_decode_args(q=torch.randn(0, 6, 16), block_tables=torch.zeros(0, 2,
                                                    dtype=torch.int32), context_lens=torch.zeros(0, dtype=torch.int32)))
    assert out.shape == (0, 6, 16)
    k_cache = torch.zeros(2, 4, 2, 8)
    ops.write_kv(torch.randn(0, 2, 8), torch.randn(0, 2, 8), k_cache, k_cache.clone(), torch.zeros(0, dtype=torch.long))
    assert not k_cache.any()


def test_int8_caches_come_with_their_scales_and_stay_off_triton(restore_backend, monkeypatch):
    c = make_case([20, 3], [1, 1], 6, 2, 16)
    q8 = quantize_case(c)
    decode = (c.q, q8.k_cache, q8.v_cache, c.block_tables, c.context_lens, c.scale)
    with pytest.raises(KernelError, match="int8 caches need k_scale"):
        ops.paged_decode_attention(*decode)
    with pytest.raises(KernelError, match="k_scale must be contiguous float32"):
        ops.paged_decode_attention(*decode, k_scale=q8.k_scale.double(), v_scale=q8.v_scale)
    with pytest.raises(KernelError, match="v_scale must be contiguous float32"):
        ops.paged_decode_attention(*decode, k_scale=q8.k_scale, v_scale=q8.v_scale[:1])
    with pytest.raises(KernelError, match="go with int8 caches"):
        ops.paged_decode_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.context_lens, c.scale,
                                   k_scale=q8.k_scale, v_scale=q8.v_scale)
    with pytest.raises(KernelError, match="int8 caches need k_scale"):
        ops.write_kv(c.q[:, :2], c.q[:, :2], q8.k_cache, q8.v_cache, torch.tensor([0, 1]))
    scales = dict(k_scale=q8.k_scale, v_scale=q8.v_scale)
    assert torch.equal(ops.paged_decode_attention(*decode, backend="torch", **scales),
                       reference.paged_decode_attention(*decode, None, q8.k_scale, q8.v_scale))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if ops.triton_available():
        ops.set_backend("triton")
        with pytest.raises(KernelError, match="not by the Triton kernels"):
            ops.paged_decode_attention(*decode, **scales)
