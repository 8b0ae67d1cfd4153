"""The numba RMSNorm, rotary and KV write against the torch references, and ``kernels.ops`` routing CPU steps to them."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from apiary.kernels import cpu_layers, ops, reference
from apiary.kernels.errors import KernelError

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


# ---------------------------------------------------------------- CpuStep: one pass's kernels, checked once

def _step(dtype, quantized=False, t=7, nd=4, hq=9, hkv=3, d=64, hidden=576, seed=0):
    """A CpuStep over a small paged cache (``nd`` decode rows first; int8 rows with scales if ``quantized``) and
    what it was built from."""
    g = torch.Generator().manual_seed(seed)
    if quantized:
        caches = [torch.randint(-127, 128, (6, 16, hkv, d), generator=g, dtype=torch.int8) for _ in range(2)]
        scales = [torch.rand(6, 16, hkv, generator=g) / 50 for _ in range(2)]
    else:
        caches, scales = [torch.randn(6, 16, hkv, d, generator=g).to(dtype) for _ in range(2)], [None, None]
    positions = torch.randint(0, 80, (t,), generator=g)
    slots = torch.randperm(96, generator=g)[:t]
    slots[1] = -1  # a padding row: written nowhere
    tables = torch.randint(0, 6, (nd, 6), generator=g, dtype=torch.int32)
    lens = torch.randint(1, 90, (nd,), generator=g, dtype=torch.int32)
    table = reference.rotary_cos_sin_cache(128, d, 10000.0)
    step = ops.cpu_step(t, hidden, hq, hkv, d, dtype, 1e-5, positions, slots, table, caches[0], caches[1], nd, tables,
                        lens, d ** -0.5, k_scale=scales[0], v_scale=scales[1])
    return SimpleNamespace(step=step, caches=caches, scales=scales, positions=positions, slots=slots, table=table,
                           tables=tables, lens=lens, g=g)


@pytest.mark.parametrize("quantized", [False, True], ids=["float-cache", "int8-cache"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_step_rotary_write_kv_is_rotary_then_the_kv_write(dtype, quantized):
    """Rotated queries, and the caches (int8 rows: with the scales ``ops.write_kv`` gives them) bit for bit."""
    t, hq, hkv, d = 7, 9, 3, 64
    s = _step(dtype, quantized)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=s.g) * 3).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    want_q, want_k = ops.apply_rotary(q.view(t, hq, d), k.view(t, hkv, d), s.positions, s.table)
    state = [x for x in (*s.caches, *s.scales) if x is not None]
    want = [x.clone() for x in state]
    ops.write_kv(want_k, v.reshape(t, hkv, d), *want[:2], s.slots, *want[2:])
    assert torch.equal(s.step.rotary_write_kv(qkv, *s.caches, *s.scales), want_q)
    for got, expected in zip(state, want):  # row 1 (slot -1) written nowhere
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_step_norms_the_residual_stream_as_the_per_call_kernel(dtype):
    """Three layers' worth of norms through the step's buffers give the per-call kernel's values bit for bit."""
    s = _step(dtype)
    weights = [torch.rand(576, generator=s.g).to(dtype) + 0.5 for _ in range(3)]
    xs = [torch.randn(7, 576, generator=s.g).to(dtype) for _ in range(4)]
    h, residual = s.step.rms_norm(xs[0], weights[0])
    assert torch.equal(h, cpu_layers.rms_norm(xs[0], weights[0], 1e-5)) and residual is xs[0]
    want_residual = xs[0]
    for x, w in zip(xs[1:], weights):
        h, residual = s.step.rms_norm(x, w, residual)
        want_h, want_residual = cpu_layers.rms_norm(x, w, 1e-5, want_residual)
        assert torch.equal(h, want_h) and torch.equal(residual, want_residual)


@pytest.mark.parametrize("quantized", [False, True], ids=["float-cache", "int8-cache"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_step_decode_attention_is_the_kernels(dtype, quantized):
    s = _step(dtype, quantized)
    q = torch.randn(4, 9, 64, generator=s.g).to(dtype)
    want = ops.paged_decode_attention(q, *s.caches, s.tables, s.lens, 64 ** -0.5, k_scale=s.scales[0],
                                      v_scale=s.scales[1])
    assert torch.equal(s.step.decode_attention(q, *s.caches, *s.scales), want)


@pytest.mark.parametrize("quantized", [False, True], ids=["float-cache", "int8-cache"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_step_attention_is_the_decode_kernel_then_the_prefill_kernels(dtype, quantized):
    """A step of 4 decode rows, a 3-query run (``_varlen``) and a 20-query one (``_runs``): one call, one buffer,
    the per-call kernels' rows bit for bit, and the same again for a second layer's caches."""
    g = torch.Generator().manual_seed(5)
    nd, runs, hq, hkv, d = 4, [3, 20], 9, 3, 64
    t = nd + sum(runs)
    if quantized:
        layers = [[torch.randint(-127, 128, (12, 16, hkv, d), generator=g, dtype=torch.int8) for _ in range(2)]
                  + [torch.rand(12, 16, hkv, generator=g) / 50 for _ in range(2)] for _ in range(2)]
    else:
        layers = [[torch.randn(12, 16, hkv, d, generator=g).to(dtype) for _ in range(2)] + [None, None]
                  for _ in range(2)]
    tables = torch.randperm(12, generator=g)[:12].view(6, 2).to(torch.int32)
    decode_lens = torch.tensor([5, 31, 1, 17], dtype=torch.int32)
    cu = torch.tensor([0, 3, 23], dtype=torch.int32)
    prefill_lens = torch.tensor([9, 28], dtype=torch.int32)  # a cached prefix of 6 and of 8 tokens
    table = reference.rotary_cos_sin_cache(64, d, 10000.0)
    step = ops.cpu_step(t, 576, hq, hkv, d, dtype, 1e-5, torch.zeros(t, dtype=torch.long), torch.arange(t),
                        table, *layers[0][:2], nd, tables[:nd], decode_lens, d ** -0.5, k_scale=layers[0][2],
                        v_scale=layers[0][3], prefill_block_tables=tables[nd:], prefill_cu_seqlens_q=cu,
                        prefill_context_lens=prefill_lens)
    assert step.attends_all
    for k, v, k_scale, v_scale in layers:
        q = torch.randn(t, hq, d, generator=g).to(dtype)
        want = torch.cat([ops.paged_decode_attention(q[:nd], k, v, tables[:nd], decode_lens, d ** -0.5,
                                                     k_scale=k_scale, v_scale=v_scale),
                          ops.paged_prefill_attention(q[nd:], k, v, tables[nd:], cu, prefill_lens, d ** -0.5,
                                                      k_scale=k_scale, v_scale=v_scale)])
        assert torch.equal(step.attention(q, k, v, k_scale, v_scale), want)


def test_cpu_step_refuses_query_runs_that_do_not_add_up():
    s = _step(torch.float32)
    tables, lens = torch.zeros(1, 6, dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    for cu, context in ((torch.tensor([0, 2], dtype=torch.int32), lens),  # 2 rows where the step has 3
                        (torch.tensor([0, 3], dtype=torch.int32), lens)):  # a context shorter than its run
        with pytest.raises(KernelError, match="prefill_cu_seqlens_q"):
            ops.cpu_step(7, 576, 9, 3, 64, torch.float32, 1e-5, s.positions, s.slots, s.table, *s.caches, 4, s.tables,
                         s.lens, 0.125, prefill_block_tables=tables, prefill_cu_seqlens_q=cu,
                         prefill_context_lens=context)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_prompt_steps_row_parallel_norm_and_rotary_are_the_serial_kernels(dtype):
    """From ``PARALLEL_ROWS`` rows the step spreads RMSNorm and rotary with the KV write over the threads: the
    serial kernels' values bit for bit (each row is the same loop), and every row's K/V in its slot."""
    import numpy as np

    g = torch.Generator().manual_seed(9)
    t, hq, hkv, d, hidden = 3 * cpu_layers.PARALLEL_ROWS + 5, 9, 3, 64, 576
    x, res = (torch.randn(t, hidden, generator=g) * 3).to(dtype), torch.randn(t, hidden, generator=g).to(dtype)
    w = torch.rand(hidden, generator=g).to(dtype) + 0.5
    as_np = cpu_layers._np
    for has_residual in (False, True):
        outs = [torch.empty(t, hidden, dtype=dtype) for _ in range(4)]
        for kernel, (out, summed) in ((cpu_layers._rms_norm, outs[:2]), (cpu_layers._rms_norm_rows, outs[2:])):
            kernel(as_np(x), as_np(res), has_residual, as_np(w), np.float32(1e-5), as_np(out), as_np(summed))
        assert torch.equal(outs[0], outs[2]) and (not has_residual or torch.equal(outs[1], outs[3]))
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    positions, slots = torch.randint(0, 500, (t,), generator=g), torch.randperm(t + 40, generator=g)[:t]
    slots[3] = -1
    table = reference.rotary_cos_sin_cache(512, d, 10000.0).numpy()
    results = []
    for kernel in (cpu_layers._rotary_write_kv, cpu_layers._rotary_write_kv_rows):
        q, k, v = torch.empty(t, hq, d, dtype=dtype), *(torch.zeros(t + 40, hkv, d, dtype=dtype) for _ in range(2))
        kernel(as_np(qkv), hq, hkv, positions.numpy(), table, as_np(q), as_np(k), as_np(v), slots.numpy())
        results.append((q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert torch.equal(results[1][2][slots[0]], qkv[0, (hq + hkv) * d:].view(hkv, d))


def test_cpu_step_serves_only_where_its_kernels_do():
    """None (the caller takes the per-call ops) off its path; a clear error for input that cannot be right."""
    assert _step(torch.float16).step is None  # no numba kernels for float16
    previous = ops.get_backend()
    try:
        ops.set_backend("torch")
        assert _step(torch.float32).step is None
    finally:
        ops.set_backend(previous)
    assert _step(torch.float32).step is not None
    t, d = 3, 64
    cache = torch.zeros(2, 16, 3, d, dtype=torch.int8)
    table = reference.rotary_cos_sin_cache(16, d)
    pos, slots = torch.arange(t), torch.arange(t)
    none = torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    with pytest.raises(ops.KernelError, match="int8 caches need k_scale"):
        ops.cpu_step(t, 576, 9, 3, d, torch.float32, 1e-5, pos, slots, table, cache, cache, 0, *none, 0.1)
    cache = torch.zeros(2, 16, 3, d)
    assert ops.cpu_step(t, 576, 9, 3, d, torch.float32, 1e-5, pos, slots, table, cache, cache, 0, *none, 0.1,
                        decode_backend_name="torch") is None  # the torch attention reference was asked for
    with pytest.raises(ops.KernelError, match="KV heads"):
        ops.cpu_step(t, 576, 8, 3, d, torch.float32, 1e-5, pos, slots, table, cache, cache, 0, *none, 0.1)
    with pytest.raises(ops.KernelError, match="need 4 entries"):
        ops.cpu_step(4, 576, 9, 3, d, torch.float32, 1e-5, pos, slots, table, cache, cache, 0, *none, 0.1)
    with pytest.raises(ops.KernelError, match="cos_sin_cache"):
        ops.cpu_step(t, 576, 9, 3, d, torch.float32, 1e-5, pos, slots, table.double(), cache, cache, 0, *none, 0.1)
    with pytest.raises(ops.KernelError, match="block_tables has"):
        ops.cpu_step(t, 576, 9, 3, d, torch.float32, 1e-5, pos, slots, table, cache, cache, 2, *none, 0.1)
