"""The numba per-row int8 quantizer (behind ``ops.quantize_rows`` on CPU) and its fused int8 KV-cache write
(behind ``ops.write_kv`` into int8 caches) against the torch references."""
from __future__ import annotations

import pytest
import torch

from apiary.kernels import cpu_quant, ops, reference
from apiary.kernels.errors import KernelError


@pytest.fixture
def restore_backend():
    previous = ops._backend
    yield
    ops._backend = previous


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1, 16), (8, 576), (64, 1536), (300, 960)])
def test_identical_to_the_reference(rows: int, cols: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, cols)).to(dtype)  # columns of 1e-3..1e3
    x[0, :] = 0.0  # an all-zero row: scale 1e-8 / 127, all zeros
    x[-1, 3] = 0.5 * x[-1].float().abs().max().item() / 127 * 3  # an exact .5 tie after scaling: half to even
    q, scale = cpu_quant.quantize_rows(x)
    ref_q, ref_scale = reference.quantize_rows(x)
    assert q.dtype == torch.int8 and scale.shape == (rows, 1)
    assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale)
    assert torch.equal(q[0], torch.zeros(cols, dtype=torch.int8))
    assert (q.float() * scale - x.float()).abs().le(scale * 0.5001).all()  # half a step (ties exactly half)


def test_ops_dispatch(restore_backend, monkeypatch) -> None:
    """numba for CPU batches of >= NUMBA_QUANT_MIN_ROWS rows, the reference for single rows and when torch is forced."""
    calls = []
    real = cpu_quant.quantize_rows
    monkeypatch.setattr(cpu_quant, "quantize_rows", lambda x: calls.append(x.shape[0]) or real(x))
    ops.set_backend("auto")
    big, small = torch.randn(ops.NUMBA_QUANT_MIN_ROWS, 32), torch.randn(1, 32)
    assert torch.equal(ops.quantize_rows(big)[0], reference.quantize_rows(big)[0])
    ops.quantize_rows(small)
    ops.quantize_rows(big.half())  # fp16: the reference
    assert calls == [ops.NUMBA_QUANT_MIN_ROWS]
    ops.set_backend("torch")
    ops.quantize_rows(big)
    assert calls == [ops.NUMBA_QUANT_MIN_ROWS]


def test_bad_input_is_refused() -> None:
    with pytest.raises(KernelError, match="2 dims"):
        ops.quantize_rows(torch.randn(2, 3, 4))
    with pytest.raises(KernelError, match="float32/float16/bfloat16"):
        ops.quantize_rows(torch.ones(2, 3, dtype=torch.int32))
    with pytest.raises(KernelError, match="2-D CPU"):
        cpu_quant.quantize_rows(torch.randn(4, 4, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_int8_kv_write_is_identical_to_the_reference(dtype: torch.dtype) -> None:
    """Strided K/V (views into a fused qkv row, as the model passes them), a skipped slot, a zero row."""
    g = torch.Generator().manual_seed(3)
    qkv = (torch.randn(20, 9 * 16, generator=g) * 4).to(dtype)
    key, value = qkv[:, 3 * 16:6 * 16].view(20, 3, 16), qkv[:, 6 * 16:].view(20, 3, 16)
    assert not key.is_contiguous()
    key[5, 1] = 0.0
    slots = torch.randperm(40, generator=g)[:20]
    slots[7] = -1
    caches = [[torch.full((10, 4, 3, 16), 9, dtype=torch.int8) for _ in range(2)] +
              [torch.full((10, 4, 3), 2.0) for _ in range(2)] for _ in range(2)]
    cpu_quant.write_kv_int8(key, value, *caches[0], slots)
    reference.write_kv_int8(key, value, *caches[1], slots)
    for ours, ref in zip(*caches):
        assert torch.equal(ours, ref)
    assert int((caches[0][0] != 9).any(-1).any(-1).sum()) == 19  # every slot but the skipped one was written
    with pytest.raises(KernelError, match="write_kv_int8 takes CPU"):
        cpu_quant.write_kv_int8(key.half(), value.half(), *caches[0], slots)


def test_ops_writes_int8_caches_through_the_fused_kernel(restore_backend, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for module in (cpu_quant, reference):
        original = module.write_kv_int8
        monkeypatch.setattr(module, "write_kv_int8",
                            lambda *a, _f=original, _n=module.__name__: (calls.append(_n.rsplit(".", 1)[1]), _f(*a)))
    key = torch.randn(4, 2, 8)
    args = (key, key, torch.zeros(2, 4, 2, 8, dtype=torch.int8), torch.zeros(2, 4, 2, 8, dtype=torch.int8),
            torch.arange(4), torch.zeros(2, 4, 2), torch.zeros(2, 4, 2))
    ops.set_backend("auto")
    ops.write_kv(*args[:5], k_scale=args[5], v_scale=args[6])
    ops.set_backend("torch")
    ops.write_kv(*args[:5], k_scale=args[5], v_scale=args[6])
    assert calls == ["cpu_quant", "reference"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_int8_gather_is_identical_to_the_torch_ops(dtype: torch.dtype) -> None:
    """Rows picked out of order (and twice), every int8 value, scales over many magnitudes."""
    g = torch.Generator().manual_seed(5)
    cache = torch.randint(-128, 128, (6, 4, 3, 16), dtype=torch.int8, generator=g)
    cache.view(-1)[:256] = torch.arange(-128, 128, dtype=torch.int8)
    scale = torch.exp(torch.randn(6, 4, 3, generator=g) * 8)
    index = torch.randint(0, 6 * 4 * 3, (50,), generator=g)
    index[1] = index[0]
    out = torch.full((50, 16), 7.0, dtype=dtype)
    cpu_quant.gather_dequantize(cache, scale, index, out)
    expected = torch.mul(cache.view(-1, 16).index_select(0, index), scale.view(-1, 1).index_select(0, index)).to(dtype)
    assert torch.equal(out, expected)
    with pytest.raises(KernelError, match=r"contiguous \[50, 16\]"):
        cpu_quant.gather_dequantize(cache, scale, index, torch.empty(50, 16, dtype=torch.float16))
    with pytest.raises(KernelError, match="one float32 scale per row"):
        cpu_quant.gather_dequantize(cache.float(), scale, index, out)


def test_ops_prefills_over_int8_caches_through_the_fused_gather(restore_backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The auto backend gathers int8 rows with the numba kernel, the torch backend with torch ops: same output.
    (Head dim 24, which the numba attention kernels' 16 lanes do not divide: they read int8 rows themselves.)"""
    calls: list[int] = []
    original = cpu_quant.gather_dequantize
    monkeypatch.setattr(cpu_quant, "gather_dequantize", lambda *a: (calls.append(a[2].numel()), original(*a)))
    g = torch.Generator().manual_seed(8)
    k_cache, v_cache = (torch.randint(-127, 128, (12, 4, 2, 24), dtype=torch.int8, generator=g) for _ in range(2))
    k_scale, v_scale = (torch.rand(12, 4, 2, generator=g) for _ in range(2))
    tables = torch.tensor([[0, 3, 5, 8, 10, 6, -1], [2, 7, 9, 11, 1, -1, -1]], dtype=torch.int32)
    cu, ctx = torch.tensor([0, 17, 37], dtype=torch.int32), torch.tensor([22, 20], dtype=torch.int32)
    outs = []
    for backend in ("auto", "torch"):
        ops.set_backend(backend)
        for dtype in (torch.float32, torch.bfloat16):
            q = torch.randn(37, 4, 24, generator=torch.Generator().manual_seed(1)).to(dtype)
            outs.append(ops.paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, 0.25,
                                                    k_scale=k_scale, v_scale=v_scale))
    assert calls and len(calls) % 2 == 0  # K and V, for each group of sequences, on the auto backend only
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
