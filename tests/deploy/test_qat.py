"""Quantization-aware training sees exactly the weights the GGUF export writes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from apiary.deploy.qat import fake_quant, quantize_dequantize

from .conftest import tiny_model


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1"])
def test_rounding_is_bit_for_bit_the_exports(qtype: str) -> None:
    import gguf
    from gguf.quants import dequantize, quantize

    torch.manual_seed(0)
    w = torch.randn(48, 576) * 0.05
    w[0, :32] = 0  # an all-zero block (scale 0)
    w[1, :32] = 0.01  # a constant block
    kind = getattr(gguf.GGMLQuantizationType, qtype.upper())
    expected = dequantize(quantize(w.numpy(), kind), kind)
    np.testing.assert_array_equal(quantize_dequantize(w, qtype).numpy(), expected)


def test_the_gradient_passes_straight_through() -> None:
    w = (torch.randn(8, 64) * 0.1).requires_grad_()
    out = fake_quant(w, "q4_0")
    assert not torch.equal(out.detach(), w.detach())
    (out * torch.arange(64.0)).sum().backward()
    torch.testing.assert_close(w.grad, torch.arange(64.0).expand(8, 64))


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="qtype"):
        quantize_dequantize(torch.zeros(2, 32), "q8_0")
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize_dequantize(torch.zeros(2, 40), "q4_0")


def test_a_student_in_qat_mode_is_the_exported_model_in_float() -> None:
    model = tiny_model(seed=1)
    ids = torch.randint(0, 49152, (2, 12))
    plain = model(ids)
    model.set_fake_quant("q4_0")
    seen = model(ids)
    assert not torch.allclose(seen, plain)
    rounded = tiny_model(seed=1)
    with torch.no_grad():
        for name, p in rounded.model.layers.named_parameters():
            if name.endswith("proj.weight"):
                p.copy_(quantize_dequantize(p, "q4_0"))
    torch.testing.assert_close(seen, rounded(ids))
    model.set_fake_quant(None)
    torch.testing.assert_close(model(ids), plain)
