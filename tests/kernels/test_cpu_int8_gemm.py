"""The grouped int8 GEMM (kernels/cpu_int8_gemm.py): quantization per 64 inputs, the VNNI product against its
float64 reference, bf16 rounding, padding, threads and refusals."""
from __future__ import annotations

import numba
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from apiary.kernels import ops
from apiary.kernels.errors import KernelError

pytestmark = pytest.mark.skipif(not ops.grouped_int8_available(),
                                reason="no AVX-512 VNNI here: the grouped int8 kernel does not run")


@pytest.fixture(scope="module")
def gemm():  # type: ignore[no-untyped-def]
    from apiary.kernels import cpu_int8_gemm

    return cpu_int8_gemm


def test_weights_quantize_per_64_inputs(gemm) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(20, 150, generator=g) * torch.logspace(-3, 1, 150)  # groups of very different size
    w[3] = 0.0
    packed = gemm.quantize_weight(w)
    assert packed.packed.shape == (2, 192 // 4, 16, 4) and packed.scales.shape == (2, 3, 16)  # N to 32, K to 192
    back = packed.dequantized()
    assert back.shape == w.shape and torch.equal(back[3], torch.zeros(150))
    scales = torch.from_numpy(packed.scales).permute(0, 2, 1).reshape(32, 3)[:20]
    bound = scales.repeat_interleave(64, dim=1)[:, :150] / 2 + 1e-7
    assert ((back - w).abs() <= bound).all()  # rounding error at most half a step of its own group
    grouped = torch.nn.functional.pad(w, (0, 42)).view(20, 3, 64).abs().amax(-1)
    torch.testing.assert_close(scales[grouped > 0], grouped[grouped > 0] / 127)  # each group uses its full range


def test_activations_quantize_per_64_inputs(gemm) -> None:  # type: ignore[no-untyped-def]
    x = torch.zeros(2, 100)
    x[0, :64] = torch.linspace(-2.0, 1.0, 64)
    x[0, 64:] = 300.0
    q, scale = gemm.quantize_activations(x, groups=2)
    assert q.shape == (2, 128) and scale.shape == (2, 2)
    assert q[0, 0] == -127 and q[0, 64] == 127 and q[0, 100:].eq(0).all()  # padding is zeros
    assert q[1].eq(0).all() and (scale[1] > 0).all()  # a row of zeros: zeros, with a positive scale
    torch.testing.assert_close(scale[0], torch.tensor([2.0 / 127, 300.0 / 127]))
    back = (q.float().view(2, 2, 64) * scale[:, :, None]).view(2, 128)[:, :100]
    assert ((back - x).abs() <= scale.repeat_interleave(64, dim=1)[:, :100] / 2 + 1e-6).all()


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 9, 16, 17, 64])
@pytest.mark.parametrize("shape", [(16, 64), (40, 100), (96, 576), (48, 1536)])
def test_the_product_is_its_reference(gemm, rows: int, shape: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    """Every micro-tile height (6 rows, then 4, 2 and 1 for what is left), N and K with and without padding: float32 output
    equals the float64 reference up to float32 accumulation."""
    n, k = shape
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w, x = torch.randn(n, k, generator=g) * 0.05, torch.randn(rows, k, generator=g)
    packed = gemm.quantize_weight(w)
    got = gemm.linear(x, packed)
    ref = gemm.reference(x, packed)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-5)
    exact = x @ w.t()
    assert ((got - exact).norm() / exact.norm()).item() < 0.02  # and close to the float product


def test_bf16_output_is_the_float32_result_rounded_to_nearest_even(gemm) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, 200, generator=g), torch.randn(13, 200, generator=g).bfloat16()
    packed = gemm.quantize_weight(w)
    as_bf16 = gemm.linear(x, packed)
    assert as_bf16.dtype == torch.bfloat16
    assert torch.equal(as_bf16, gemm.linear(x.float(), packed).bfloat16())  # bf16 input is exact in float32


def test_extreme_rows_stay_finite_and_exact(gemm) -> None:  # type: ignore[no-untyped-def]
    """Huge, tiny and zero groups side by side: each group's own scale keeps them apart."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 256, generator=g)
    x[0, :64] *= 1e4
    x[1, 64:128] *= 1e-6
    x[2] = 0.0
    x[3, 200] = -5e3  # one outlier spoils only its group
    packed = gemm.quantize_weight(torch.randn(32, 256, generator=g))
    got = gemm.linear(x, packed)
    assert torch.isfinite(got).all() and got[2].eq(0).all()
    torch.testing.assert_close(got.double(), gemm.reference(x, packed), atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_thread_counts_agree(gemm, threads: int) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(96, 320, generator=g), torch.randn(37, 320, generator=g)
    packed = gemm.quantize_weight(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        got = gemm.linear(x, packed)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, gemm.linear(x, packed))  # each output is one tile's own sum: no reduction order


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 40), n=st.integers(1, 70), k=st.integers(1, 300), bf16=st.booleans(), seed=st.integers(0, 99))
def test_any_shape_matches_the_reference(gemm, rows: int, n: int, k: int, bf16: bool, seed: int) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    x = x.bfloat16() if bf16 else x
    packed = gemm.quantize_weight(w)
    got = gemm.linear(x, packed)
    assert got.shape == (rows, n) and got.dtype == x.dtype
    tol = {"atol": 0.1, "rtol": 0.01} if bf16 else {"atol": 1e-3, "rtol": 1e-5}
    torch.testing.assert_close(got.double(), gemm.reference(x, packed), **tol)


def test_the_input_is_left_alone(gemm) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(5, 128)
    before = x.clone()
    gemm.linear(x, gemm.quantize_weight(torch.randn(16, 128)))
    assert torch.equal(x, before)


@pytest.mark.parametrize("bad", [torch.randn(3, 63), torch.randn(2, 3, 64), torch.randn(3, 64).half(),
                                 torch.randint(0, 9, (3, 64))])
def test_bad_inputs_are_refused(gemm, bad: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(KernelError, match="cpu_int8_gemm.linear takes"):
        gemm.linear(bad, gemm.quantize_weight(torch.randn(16, 64)))


def test_ops_serves_the_kernel(gemm) -> None:  # type: ignore[no-untyped-def]
    w, x = torch.randn(16, 64), torch.randn(3, 64)
    packed = ops.pack_grouped_int8(w)
    assert torch.equal(ops.grouped_int8_linear(x, packed), gemm.linear(x, packed))
    torch.testing.assert_close(ops.grouped_int8_reference(x, packed), gemm.reference(x, packed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gated_input_is_silu_of_gate_times_up(gemm, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """``gated``: the kernel takes a SwiGLU's gate and up side by side and multiplies ``silu(gate) * up`` (float32,
    gates far into both tails) by the weight: what the plain call gives on that product, up to a rounding step of
    the activations where the two exponentials differ in the last bits."""
    g = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(9, 2 * 150, generator=g) * 4).to(dtype)
    gate_up[0, :150] = torch.linspace(-100, 100, 150)
    packed = gemm.quantize_weight(torch.randn(40, 150, generator=g))
    got = gemm.linear(gate_up, packed, gated=True)
    assert got.dtype == dtype and got.shape == (9, 40)
    gate, up = gate_up.float().chunk(2, dim=-1)
    plain = gemm.linear(torch.nn.functional.silu(gate) * up, packed)
    assert ((got.float() - plain).norm() / plain.norm()).item() < 2e-3
    with pytest.raises(KernelError, match="of 300 columns"):
        gemm.linear(gate_up[:, :150], packed, gated=True)
