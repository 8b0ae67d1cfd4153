"""The numba RMSNorm, rotary and KV write against the torch references, and ``kernels.ops`` routing CPU steps to them."""
from __future__ import annotations

import pytest
import torch

from apiary.kernels import cpu_layers, ops, reference

DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: summation order only; bf16: at most one bf16 ulp (a product rounding the other way)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)
        assert (got != want).float().mean() < 0.02  # almost every element identical


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 37])
def test_rms_norm_with_and_without_residual(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x, res = (torch.randn(rows, 576, generator=g) * 3).to(dtype), torch.randn(rows, 576, generator=g).to(dtype)
    for weight in (torch.rand(576, generator=g).to(dtype) + 0.5, torch.rand(576, generator=g) + 0.5):
        _close(cpu_layers.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
        out, summed = cpu_layers.rms_norm(x, weight, 1e-5, res)
        want_out, want_summed = reference.rms_norm(x, weight, 1e-5, res)
        assert torch.equal(summed, want_summed)  # one rounded add, as the reference stores it
        _close(out, want_out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_on_strided_heads_as_the_engine_splits_them(dtype):
    g = torch.Generator().manual_seed(0)
    t, hq, hkv, d = 19, 9, 3, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hkv, d)
    assert not q.is_contiguous()
    positions = torch.randint(0, 500, (t,), generator=g)
    table = reference.rotary_cos_sin_cache(512, d, 100000.0)
    for got, want in zip(cpu_layers.apply_rotary(q, k, positions, table), reference.apply_rotary(q, k, positions, table)):
        assert got.is_contiguous()
        _close(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv_places_rows_and_skips_negative_slots(dtype):
    g = torch.Generator().manual_seed(1)
    key, value = torch.randn(6, 3, 64, generator=g).to(dtype), torch.randn(6, 3, 64, generator=g).to(dtype)
    slots = torch.tensor([5, -1, 0, 33, -1, 17])
    caches = [torch.randn(4, 16, 3, 64, generator=g).to(dtype) for _ in range(2)]
    caches += [c.clone() for c in caches]
    cpu_layers.write_kv(key, value, caches[0], caches[1], slots)
    reference.write_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_ops_route_cpu_steps_here_unless_the_torch_backend_is_forced(monkeypatch):
    calls = []
    for name in ("rms_norm", "apply_rotary", "write_kv"):
        real = getattr(cpu_layers, name)
        monkeypatch.setattr(cpu_layers, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    x, w = torch.randn(4, 64), torch.ones(64)
    q, k = torch.randn(4, 4, 16), torch.randn(4, 2, 16)
    table, cache = reference.rotary_cos_sin_cache(8, 16), torch.zeros(2, 4, 2, 16)
    previous = ops.get_backend()
    try:
        for backend, expected in (("auto", ["rms_norm", "apply_rotary", "write_kv"]), ("torch", [])):
            calls.clear()
            ops.set_backend(backend)
            ops.rms_norm(x, w, 1e-6)
            ops.apply_rotary(q, k, torch.arange(4), table)
            ops.write_kv(k, k, cache, cache.clone(), torch.arange(4))
            assert calls == expected, backend
        ops.set_backend("auto")
        calls.clear()
        ops.rms_norm(x.half(), w.half(), 1e-6)  # float16: the reference
        assert calls == []
    finally:
        ops.set_backend(previous)


def test_bad_input_is_a_kernel_error():
    with pytest.raises(ops.KernelError, match="rms_norm takes"):
        cpu_layers.rms_norm(torch.randn(2, 3, 4), torch.ones(4), 1e-6)
    with pytest.raises(ops.KernelError, match="write_kv takes"):
        cpu_layers.write_kv(torch.randn(1, 2, 4), torch.randn(1, 2, 4), torch.zeros(1, 4, 2, 4, dtype=torch.bfloat16),
                            torch.zeros(1, 4, 2, 4, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int64))
