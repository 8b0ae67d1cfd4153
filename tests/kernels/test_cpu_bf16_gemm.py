"""The bf16 GEMM (kernels/cpu_bf16_gemm.py): every output the exact product rounded once (to it or a neighbour),
bias, padding, threads, the layout, which CPUs get it, and refusals."""
from __future__ import annotations

import functools

import numba
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from apiary.kernels import ops
from apiary.kernels.errors import KernelError
from tests.kernels.cases import micro_tiles, torch_threads

numba_missing = not ops.numba_available()


@pytest.fixture(scope="module")
def gemm():  # type: ignore[no-untyped-def]
    if numba_missing:
        pytest.skip("numba is not installed")
    from apiary.kernels import cpu_bf16_gemm

    if not cpu_bf16_gemm.available():
        pytest.skip(f"numba does not compile for {', '.join(cpu_bf16_gemm.FEATURES)} here: the bf16 kernel does not run")
    return cpu_bf16_gemm


def _within_one_rounding(got: torch.Tensor, exact: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """``got`` (bf16) is ``exact`` (float64) rounded once to bf16, give or take the float32 sums' own error: within
    one bf16 ulp of ``exact`` plus 2^-20 of the sum of the products' magnitudes."""
    ulp = torch.where(exact == 0, torch.zeros_like(exact), 2.0 ** (torch.floor(torch.log2(exact.abs())) - 7))
    slack = 2.0 ** -20 * (x.double().abs() @ w.double().abs().t())
    return bool(((got.double() - exact).abs() <= ulp + slack).all())


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 16, 32), (14, 960, 576), (13, 576, 1536), (64, 96, 80), (300, 100, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_output_is_the_exact_product_rounded_once(gemm, rows: int, n: int, k: int, with_bias: bool) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(rows * n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    x = torch.randn(rows, k, generator=g).bfloat16()
    packed = gemm.pack(w, bias)
    got = gemm.linear(x, packed)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    exact = gemm.reference(x, packed)
    assert _within_one_rounding(got, exact, x, w)
    # nearly always the exactly rounded value, and F.linear's (oneDNN sums in another order)
    assert (got == exact.to(torch.bfloat16)).float().mean() > 0.99
    assert (got == F.linear(x, w, bias)).float().mean() > 0.99


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 40), n=st.integers(1, 70), k=st.integers(1, 300), seed=st.integers(0, 99))
def test_any_shape_is_the_exact_product_rounded_once(gemm, rows: int, n: int, k: int, seed: int) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(rows, k, generator=g).bfloat16()
    packed = gemm.pack(w)
    got = gemm.linear(x, packed)
    assert got.shape == (rows, n)
    assert _within_one_rounding(got, gemm.reference(x, packed), x, w)


@pytest.mark.parametrize(("rows", "k"), [(1, 32), (14, 1536), (7, 40)])
def test_a_gated_input_is_silu_gate_times_up_rounded_as_torch_rounds(gemm, rows: int, k: int) -> None:  # type: ignore[no-untyped-def]
    """``gated``: ``x = [gate | up]`` and the product is of ``silu(gate) * up``, silu rounded to bf16 and then the
    product, as ``F.silu(gate) * up`` on bf16 tensors (to the ulp: our exp is not torch's; on the Zen 4 host they
    were equal bit for bit), zero-padded where K is not whole chunks of 32; the products are the plain call's."""
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(rows, 2 * k, generator=g) * 3).bfloat16()
    w = gemm.pack(torch.randn(48, k, generator=g) / k ** 0.5, torch.randn(48, generator=g))
    gate, up = x.chunk(2, dim=-1)
    want = F.silu(gate) * up
    ours = torch.zeros(rows, w.packed.shape[1] * 2, dtype=torch.int16)
    gemm._swiglu(x.view(torch.int16).numpy(), ours.numpy())
    assert not ours[:, k:].any()  # the padding stays zero
    ours = ours[:, :k].view(torch.bfloat16)
    ulp = 2.0 ** (torch.floor(torch.log2(want.float().abs().clamp_min(2.0 ** -126))) - 7)
    assert bool(((ours.float() - want.float()).abs() <= ulp).all())
    assert (ours == want).float().mean().item() >= 0.99
    assert torch.equal(gemm.linear(x, w, gated=True), gemm.linear(ours.contiguous(), w))
    with pytest.raises(KernelError, match=f"{2 * k} columns"):
        gemm.linear(gate.contiguous(), w, gated=True)


def test_the_layout_holds_the_weight_padded_with_zeros(gemm) -> None:  # type: ignore[no-untyped-def]
    w = torch.randn(20, 40).bfloat16()
    packed = gemm.pack(w, torch.ones(20))
    assert packed.packed.shape == (2, 32, 16, 2)  # N to 32, K to 64, in pairs
    assert torch.equal(packed.unpacked(), w)
    assert packed.bias[:20].tolist() == [1.0] * 20 and not packed.bias[20:].any()
    pairs = torch.from_numpy(packed.packed)
    assert not pairs[1, :, 4:].any() and not pairs[:, 20:].any()  # outputs past 20, inputs past 40: zeros


def test_one_thread_and_two_give_the_same_bits(gemm) -> None:  # type: ignore[no-untyped-def]
    """Each output is one tile's own sum: no reduction order that a thread count could change."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(96, 320, generator=g).bfloat16(), torch.randn(37, 320, generator=g).bfloat16()
    packed = gemm.pack(w)
    with torch_threads(1):
        one = gemm.linear(x, packed)
    with torch_threads(2):
        assert torch.equal(gemm.linear(x, packed), one)


def test_the_input_is_left_alone(gemm) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(5, 40).bfloat16()
    before = x.clone()
    gemm.linear(x, gemm.pack(torch.randn(16, 40)))
    assert torch.equal(x, before)


@pytest.mark.parametrize("bad", [torch.randn(3, 63).bfloat16(), torch.randn(2, 3, 64).bfloat16(), torch.randn(3, 64),
                                 torch.randn(3, 64).half(), torch.randint(0, 9, (3, 64))])
def test_bad_inputs_are_refused(gemm, bad: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(KernelError, match="cpu_bf16_gemm.linear takes"):
        gemm.linear(bad, gemm.pack(torch.randn(16, 64)))


def test_ops_binds_the_kernel_where_it_runs(gemm) -> None:  # type: ignore[no-untyped-def]
    w, b, x = torch.randn(16, 64).bfloat16(), torch.randn(16).bfloat16(), torch.randn(3, 64).bfloat16()
    bound = ops.bind_bf16_linear(w, b)
    assert bound is not None and torch.equal(bound(x), gemm.linear(x, gemm.pack(w, b)))
    assert ops.bind_bf16_linear(w.float()) is None  # float32 weights keep their own path
    with pytest.raises(KernelError, match="bias has 15 values"):
        ops.bind_bf16_linear(w, b[:15])
    ops.set_backend("torch")
    try:
        assert ops.bind_bf16_linear(w) is None  # a forced backend: the torch path
    finally:
        ops.set_backend("auto")


@pytest.mark.skipif(numba_missing, reason="numba is not installed")
@pytest.mark.parametrize(("features", "expected"), [
    ("+avx2,+fma,+avx512f,+avx512bw,+avx512bf16", True),
    ("+avx2,+fma,+avx512f,+avx512bw,-avx512bf16", False),  # Skylake-X, Ice Lake: AVX-512 without BF16
    ("+avx2,+fma,-avx512f,-avx512bw,-avx512bf16", False),  # an AVX2 host, or a Haswell rehearsal
])
def test_the_kernel_follows_the_features_numba_compiles_for(monkeypatch: pytest.MonkeyPatch, features: str,
                                                            expected: bool) -> None:
    """``NUMBA_CPU_FEATURES`` is what LLVM may use, so it decides; where it says no, layers keep oneDNN."""
    from apiary.kernels import cpu_bf16_gemm

    monkeypatch.setattr(numba.config, "CPU_FEATURES", features)
    cpu_bf16_gemm.available.cache_clear()
    try:
        assert cpu_bf16_gemm.available() is expected
        assert (ops.bind_bf16_linear(torch.randn(16, 32).bfloat16()) is not None) is expected
        if not expected:
            with pytest.raises(KernelError, match="lacks avx512f, avx512bw, avx512bf16"):
                cpu_bf16_gemm.linear(torch.randn(2, 32).bfloat16(), cpu_bf16_gemm.pack(torch.randn(16, 32)))
    finally:
        monkeypatch.undo()
        cpu_bf16_gemm.available.cache_clear()


@pytest.mark.skipif(numba_missing, reason="numba is not installed")
def test_rows_go_in_micro_tiles_as_even_as_can_be() -> None:
    """No 1- or 2-row micro-tile where a larger one can take the rows: 14 rows as 5, 5, 4, not 6, 6, 2."""
    from apiary.kernels import cpu_bf16_gemm

    split = functools.partial(micro_tiles, cpu_bf16_gemm._rows_next.py_func, cpu_bf16_gemm.ROWS)
    assert [split(m) for m in (1, 2, 3, 6, 7, 9, 13, 14, 15, 16)] == [
        [1], [2], [3], [6], [4, 3], [5, 4], [5, 4, 4], [5, 5, 4], [5, 5, 5], [6, 5, 5]]
    assert all(max(split(m)) <= cpu_bf16_gemm.ROWS and sum(split(m)) == m for m in range(1, 300))


@pytest.mark.parametrize("rows", [7, 9, 13, 14, 15, 16])
def test_each_row_alone_is_the_row_in_the_batch(gemm, rows: int) -> None:  # type: ignore[no-untyped-def]
    """Each row's sums are its own two chains in input order, whatever micro-tile (1 to 6 rows) it lands in."""
    g = torch.Generator().manual_seed(rows)
    w = gemm.pack(torch.randn(96, 576, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16())
    x = torch.randn(rows, 576, generator=g).bfloat16()
    batch = gemm.linear(x, w)
    assert torch.equal(torch.cat([gemm.linear(x[i:i + 1], w) for i in range(rows)]), batch)
