"""Prepacked linear layers: bit-identical to F.linear wherever they are used, plain F.linear elsewhere."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from apiary.cloud.engine.linear import Linear
from apiary.kernels import cpu
from tests.kernels.test_cpu import AVX2_HOST

PACKABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
NO_NATIVE_BF16 = cpu.missing_bf16(cpu.host_flags())


@pytest.mark.skipif(not PACKABLE, reason="this torch build has no oneDNN linear packing")
@pytest.mark.skipif(NO_NATIVE_BF16 is not None, reason=f"packing needs native bf16: {NO_NATIVE_BF16}")
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_bfloat16_is_bit_identical_to_f_linear(rows: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=g).to(torch.bfloat16)
    bias = torch.randn(96, generator=g).to(torch.bfloat16) if with_bias else None
    layer = Linear.of(weight, bias)
    assert layer.packed is not None
    x = torch.randn(rows, 80, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, weight, bias))


@pytest.mark.parametrize("rows", [1, 64])
def test_a_cpu_without_native_bfloat16_gets_plain_f_linear(rows: int) -> None:
    """The fallback, on every host: with an AVX2-only CPU's flags nothing is packed and bf16 is F.linear."""
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=g).to(torch.bfloat16)
    layer = Linear.of(weight, flags=cpu.parse_flags(AVX2_HOST))
    assert layer.packed is None
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
