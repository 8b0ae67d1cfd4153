"""The numba per-row int8 quantizer (behind ``ops.quantize_rows`` on CPU) against the torch reference."""
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
