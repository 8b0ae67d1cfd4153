"""Linear layers: our bf16 kernel where numba compiles vdpbf16ps (F.linear's numbers to one rounding), oneDNN's
packed weight bit-identical to F.linear where it does not, plain F.linear elsewhere."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from apiary.cloud.engine.linear import Linear
from apiary.kernels import cpu, ops
from tests.kernels.test_cpu import AVX2_HOST

PACKABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
NO_NATIVE_BF16 = cpu.missing_bf16(cpu.host_flags())


def _bf16_kernel_runs() -> bool:
    if NO_NATIVE_BF16 is not None or not ops.numba_available():
        return False
    from apiary.kernels import cpu_bf16_gemm

    return cpu_bf16_gemm.available()


def _bf16_case(rows: int, with_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A bf16 weight [96, 80], maybe a bias, and ``rows`` input rows, seeded by ``rows``."""
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=g).to(torch.bfloat16)
    bias = torch.randn(96, generator=g).to(torch.bfloat16) if with_bias else None
    return weight, bias, torch.randn(rows, 80, generator=g).to(torch.bfloat16)


@pytest.fixture
def without_numba_kernels():  # type: ignore[no-untyped-def]
    """The torch backend forced, as ``APIARY_KERNELS=torch`` does: layers built now keep oneDNN's packing."""
    ops.set_backend("torch")
    yield
    ops.set_backend("auto")


@pytest.mark.skipif(not PACKABLE, reason="this torch build has no oneDNN linear packing")
@pytest.mark.skipif(NO_NATIVE_BF16 is not None, reason=f"packing needs native bf16: {NO_NATIVE_BF16}")
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_bfloat16_is_bit_identical_to_f_linear(rows: int, with_bias: bool, without_numba_kernels: None) -> None:
    weight, bias, x = _bf16_case(rows, with_bias)
    layer = Linear.of(weight, bias)
    assert layer.packed is not None and layer.kernel is None
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, weight, bias))


@pytest.mark.skipif(not _bf16_kernel_runs(), reason="numba does not compile vdpbf16ps here (or bf16 is not native)")
@pytest.mark.parametrize("rows", [1, 14, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bfloat16_takes_our_kernel_within_one_rounding_of_f_linear(rows: int, with_bias: bool) -> None:
    """Where the kernel runs, a bf16 layer holds it instead of oneDNN's packing (not both: one copy of the weight)."""
    from apiary.kernels import cpu_bf16_gemm

    weight, bias, x = _bf16_case(rows, with_bias)
    layer = Linear.of(weight, bias)
    assert layer.kernel is not None and layer.packed is None and layer.plain is None
    assert torch.equal(layer.weight, weight) and layer.dtype == torch.bfloat16  # unpacked from the kernel's copy
    with torch.inference_mode():
        got, ref = layer(x), F.linear(x, weight, bias)
        assert torch.equal(layer(x[None]), F.linear(x[None], weight, bias))  # 3-D: F.linear on the unpacked weight
    assert torch.equal(got, cpu_bf16_gemm.linear(x, cpu_bf16_gemm.pack(weight, bias)))
    ulp = 2.0 ** (torch.floor(torch.log2(ref.float().abs().clamp(min=1e-30))) - 7)
    assert ((got.float() - ref.float()).abs() <= ulp + 1e-5).all()  # oneDNN's sums in another order: one rounding apart


@pytest.mark.parametrize("rows", [1, 64])
def test_a_cpu_without_native_bfloat16_gets_plain_f_linear(rows: int) -> None:
    """The fallback, on every host: with an AVX2-only CPU's flags nothing is packed and bf16 is F.linear."""
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=g).to(torch.bfloat16)
    layer = Linear.of(weight, flags=cpu.parse_flags(AVX2_HOST))
    assert layer.packed is None and layer.kernel is None
    x = torch.randn(rows, 80, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, weight))


def test_float32_and_odd_inputs_use_plain_f_linear() -> None:
    weight = torch.randn(16, 8)
    layer = Linear.of(weight)
    assert layer.packed is None  # MKL's fp32 packing measured no gain
    x = torch.randn(3, 8)
    assert torch.equal(layer(x), F.linear(x, weight))
    packed = Linear.of(weight.to(torch.bfloat16))
    empty = torch.empty(0, 8, dtype=torch.bfloat16)
    assert packed(empty).shape == (0, 16)
    batched = torch.randn(2, 3, 8, dtype=torch.bfloat16)  # not 2-D: plain path
    assert torch.equal(packed(batched), F.linear(batched, packed.weight))
    assert [t.shape for t in Linear.of(weight, torch.zeros(16)).tensors()] == [(16, 8), (16,)]
