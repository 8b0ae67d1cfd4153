"""The grouped int8 GEMM (kernels/cpu_int8_gemm.py): quantization per 64 inputs, the VNNI and AVX2 products
against their float64 reference and each other, bf16 rounding, padding, threads, which kernel a CPU gets, and
refusals."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numba
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from apiary.kernels import ops
from apiary.kernels.errors import KernelError
from tests.kernels.cases import torch_threads

pytestmark = pytest.mark.skipif(not ops.grouped_int8_available(),
                                reason="neither AVX-512 VNNI nor AVX2 here: the grouped int8 kernel does not run")


@pytest.fixture(scope="module")
def gemm():  # type: ignore[no-untyped-def]
    from apiary.kernels import cpu_int8_gemm

    return cpu_int8_gemm


@pytest.fixture(scope="module", params=["avx512_vnni", "avx2"])
def kernel(request: pytest.FixtureRequest, gemm) -> str:  # type: ignore[no-untyped-def]
    """Each kernel this CPU runs (an AVX-512 VNNI host runs both)."""
    if request.param not in gemm.runnable():
        pytest.skip(f"this CPU does not run the {request.param} kernel (it runs: {gemm.runnable()})")
    return str(request.param)


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


@pytest.mark.parametrize("rows", [7, 9, 13, 14, 15, 16])
def test_each_row_alone_is_the_row_in_the_batch(gemm, kernel: str, rows: int) -> None:  # type: ignore[no-untyped-def]
    """A row's activations are quantized alone and its sums are its own, whatever micro-tile it lands in."""
    g = torch.Generator().manual_seed(rows)
    packed = gemm.quantize_weight(torch.randn(96, 576, generator=g) * 0.05)
    x = torch.randn(rows, 576, generator=g).bfloat16()
    batch = gemm.linear(x, packed, kernel=kernel)
    assert torch.equal(torch.cat([gemm.linear(x[i:i + 1], packed, kernel=kernel) for i in range(rows)]), batch)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 9, 14, 16, 17, 64])
@pytest.mark.parametrize("shape", [(16, 64), (40, 100), (96, 576), (48, 1536)])
def test_the_product_is_its_reference(gemm, kernel: str, rows: int, shape: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    """Every micro-tile height (VNNI: 1 to 6 rows, the rows split evenly; AVX2: 2, then 1), N and K with and
    without padding: float32 output equals the float64 reference up to float32 accumulation."""
    n, k = shape
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w, x = torch.randn(n, k, generator=g) * 0.05, torch.randn(rows, k, generator=g)
    packed = gemm.quantize_weight(w)
    got = gemm.linear(x, packed, kernel=kernel)
    ref = gemm.reference(x, packed)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-5)
    exact = x @ w.t()
    assert ((got - exact).norm() / exact.norm()).item() < 0.02  # and close to the float product


def test_bf16_output_is_the_float32_result_rounded_to_nearest_even(gemm, kernel: str) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, 200, generator=g), torch.randn(13, 200, generator=g).bfloat16()
    packed = gemm.quantize_weight(w)
    as_bf16 = gemm.linear(x, packed, kernel=kernel)
    assert as_bf16.dtype == torch.bfloat16
    assert torch.equal(as_bf16, gemm.linear(x.float(), packed, kernel=kernel).bfloat16())  # bf16 input is exact in float32


def test_extreme_rows_stay_finite_and_exact(gemm, kernel: str) -> None:  # type: ignore[no-untyped-def]
    """Huge, tiny and zero groups side by side: each group's own scale keeps them apart."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 256, generator=g)
    x[0, :64] *= 1e4
    x[1, 64:128] *= 1e-6
    x[2] = 0.0
    x[3, 200] = -5e3  # one outlier spoils only its group
    packed = gemm.quantize_weight(torch.randn(32, 256, generator=g))
    got = gemm.linear(x, packed, kernel=kernel)
    assert torch.isfinite(got).all() and got[2].eq(0).all()
    torch.testing.assert_close(got.double(), gemm.reference(x, packed), atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_thread_counts_agree(gemm, threads: int) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(96, 320, generator=g), torch.randn(37, 320, generator=g)
    packed = gemm.quantize_weight(w)
    with torch_threads(threads):
        got = gemm.linear(x, packed)
    assert torch.equal(got, gemm.linear(x, packed))  # each output is one tile's own sum: no reduction order


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 40), n=st.integers(1, 70), k=st.integers(1, 300), bf16=st.booleans(), seed=st.integers(0, 99))
def test_any_shape_matches_the_reference(gemm, kernel: str, rows: int, n: int, k: int, bf16: bool, seed: int) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    x = x.bfloat16() if bf16 else x
    packed = gemm.quantize_weight(w)
    got = gemm.linear(x, packed, kernel=kernel)
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
    bound = ops.bind_grouped_int8(packed)  # what a layer holds: the same products, its checks still on
    assert torch.equal(bound(x), gemm.linear(x, packed))
    gate_up = torch.randn(3, 128)
    assert torch.equal(bound(gate_up, True), gemm.linear(gate_up, packed, gated=True))
    with pytest.raises(KernelError, match="cpu_int8_gemm.linear takes"):
        bound(torch.randn(3, 63))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gated_input_is_silu_of_gate_times_up(gemm, kernel: str, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """``gated``: the kernel takes a SwiGLU's gate and up side by side and multiplies ``silu(gate) * up`` (float32,
    gates far into both tails) by the weight: what the plain call gives on that product, up to a rounding step of
    the activations where the two exponentials differ in the last bits."""
    g = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(9, 2 * 150, generator=g) * 4).to(dtype)
    gate_up[0, :150] = torch.linspace(-100, 100, 150)
    packed = gemm.quantize_weight(torch.randn(40, 150, generator=g))
    got = gemm.linear(gate_up, packed, gated=True, kernel=kernel)
    assert got.dtype == dtype and got.shape == (9, 40)
    gate, up = gate_up.float().chunk(2, dim=-1)
    plain = gemm.linear(torch.nn.functional.silu(gate) * up, packed, kernel=kernel)
    assert ((got.float() - plain).norm() / plain.norm()).item() < 2e-3
    with pytest.raises(KernelError, match="of 300 columns"):
        gemm.linear(gate_up[:, :150], packed, gated=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
def test_the_avx2_kernel_gives_the_vnni_kernels_numbers_bit_for_bit(gemm, dtype: torch.dtype, gated: bool) -> None:  # type: ignore[no-untyped-def]
    """Both sum the same integer products exactly and scale them in the same order, so a host's answers do not
    depend on which kernel it has. Includes weights at +-127 and activations at +-127, where ``vpmaddubsw``'s
    int16 pair sums are largest (2 x 127 x 127)."""
    if set(gemm.runnable()) != {"avx512_vnni", "avx2"}:
        pytest.skip(f"needs a CPU that runs both kernels (this one runs: {gemm.runnable()})")
    g = torch.Generator().manual_seed(5)
    w = torch.randn(80, 200, generator=g)
    w[:, :64] = torch.where(torch.arange(64) % 2 == 0, 1.0, -1.0)  # a group all at +-127 after quantization
    packed = gemm.quantize_weight(w)
    for rows in (1, 2, 3, 7, 16):
        x = torch.randn(rows, 400 if gated else 200, generator=g) * 3
        x[:, :64] = torch.where(torch.arange(64) % 3 == 0, -2.0, 2.0)
        x = x.to(dtype)
        vnni = gemm.linear(x, packed, gated=gated, kernel="avx512_vnni")
        avx2 = gemm.linear(x, packed, gated=gated, kernel="avx2")
        assert torch.equal(vnni, avx2), rows


def test_a_kernel_the_cpu_lacks_is_refused_not_run(gemm, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Running ``vpdpbusd`` on a CPU without it would kill the process (SIGILL): the call says so instead."""
    monkeypatch.setattr(gemm, "runnable", lambda: ("avx2",))
    packed = gemm.quantize_weight(torch.randn(16, 64))
    with pytest.raises(KernelError, match="'avx512_vnni' does not run here.*runs: avx2"):
        gemm.linear(torch.randn(2, 64), packed, kernel="avx512_vnni")
    with pytest.raises(KernelError, match="'sse2' does not run here"):
        gemm.linear(torch.randn(2, 64), packed, kernel="sse2")


@pytest.mark.parametrize(("features", "expected"), [
    ("+avx2,+fma,+avx512f,+avx512bw,+avx512vnni", ("avx512_vnni", "avx2")),
    ("+avx2,+fma,-avx512f,-avx512bw,-avx512vnni", ("avx2",)),
    ("+avx2,+avx512f,+avx512bw,-avx512vnni", ("avx2",)),  # Skylake-X: AVX-512 without VNNI
    ("+sse4.2,-avx2", ()),
])
def test_the_kernels_follow_the_features_numba_compiles_for(gemm, monkeypatch: pytest.MonkeyPatch, features: str,
                                                            expected: tuple[str, ...]) -> None:  # type: ignore[no-untyped-def]
    """``NUMBA_CPU_FEATURES`` (an operator's, or an AVX2 rehearsal's) is what LLVM may use, so it decides."""
    monkeypatch.setattr(numba.config, "CPU_FEATURES", features)
    gemm.runnable.cache_clear()
    try:
        assert gemm.runnable() == expected
        assert gemm.isa() == (expected[0] if expected else None) and gemm.available() == bool(expected)
    finally:
        monkeypatch.undo()
        gemm.runnable.cache_clear()
    assert gemm.isa() is not None  # this host again


def test_an_avx2_build_runs_the_avx2_kernel_and_the_engine_probe_picks_it(gemm, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """In a fresh interpreter under ``.ci/avx2-rehearsal`` (numba compiles for Haswell: AVX2, FMA, no AVX-512, how an
    AVX2-only host looks to LLVM), the default kernel is the AVX2 one, its product is the reference's, and the int8 engine's probe takes
    it."""
    if "avx2" not in gemm.runnable():
        pytest.skip("this CPU does not run AVX2")
    code = (
        "import torch\n"
        "from apiary.kernels import cpu_int8_gemm as gemm\n"
        "from apiary.cloud.engine import int8\n"
        "assert gemm.isa() == 'avx2', gemm.runnable()\n"
        "g = torch.Generator().manual_seed(0)\n"
        "packed = gemm.quantize_weight(torch.randn(48, 130, generator=g))\n"
        "x = torch.randn(5, 130, generator=g)\n"
        "torch.testing.assert_close(gemm.linear(x, packed).double(), gemm.reference(x, packed), atol=1e-4, rtol=1e-5)\n"
        "choice = int8.gemm_choice()\n"
        "assert choice.backend == 'grouped' and 'grouped int8 kernel (avx2)' in choice.reason, choice\n"
        "print('ok', choice.reason)\n"
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    rehearsal = Path(__file__).resolve().parents[2] / ".ci" / "avx2-rehearsal"
    done = subprocess.run([str(rehearsal), sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok")
