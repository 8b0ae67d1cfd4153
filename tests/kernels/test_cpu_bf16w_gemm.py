"""bf16 weights, float32 rows and sums (kernels/cpu_bf16w_gemm.py): the product within float32's own error of the
exact one, a row's outputs whatever the other rows, the same bits when numba compiles for AVX2 only, the bias kept
in float32, padding, and refusals."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from apiary.kernels import ops
from apiary.kernels.errors import KernelError
from tests.kernels.cases import micro_tiles, torch_threads


@pytest.fixture(scope="module")
def gemm():  # type: ignore[no-untyped-def]
    if not ops.numba_available():
        pytest.skip("numba is not installed")
    from apiary.kernels import cpu_bf16w_gemm

    if not cpu_bf16w_gemm.available():
        pytest.skip(f"numba does not compile for {', '.join(cpu_bf16w_gemm.FEATURES)} here: the kernel does not run")
    return cpu_bf16w_gemm


def _within_float32_sums(got: torch.Tensor, exact: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                         bias: torch.Tensor | None) -> bool:
    """``got`` (float32) is the exact product up to a chain of ``k`` float32 roundings: ``(k + 2) * 2^-24`` of the sum
    of the terms' magnitudes."""
    k = x.shape[1]
    size = x.double().abs() @ w.double().abs().t() + (0 if bias is None else bias.double().abs())
    return bool(((got.double() - exact).abs() <= (k + 2) * 2.0 ** -24 * size + 1e-30).all())


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 16, 32), (14, 960, 576), (13, 576, 1536), (64, 96, 80), (300, 100, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_output_is_the_exact_product_within_float32_sums(gemm, rows: int, n: int, k: int, with_bias: bool) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(rows * n + k)
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    x = torch.randn(rows, k, generator=g)
    packed = gemm.pack(w, bias)
    got = gemm.linear(x, packed)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    rounded = w.bfloat16().float()  # the weights it holds
    assert torch.equal(packed.unpacked().float(), rounded)
    exact = gemm.reference(x, packed)
    assert _within_float32_sums(got, exact, x, rounded, bias)
    torch.testing.assert_close(got, F.linear(x, rounded, bias), rtol=1e-4, atol=2e-4)  # sgemm: other orders


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 40), n=st.integers(1, 70), k=st.integers(1, 300), seed=st.integers(0, 99))
def test_any_shape_and_each_row_alone_as_in_the_batch(gemm, rows: int, n: int, k: int, seed: int) -> None:  # type: ignore[no-untyped-def]
    """Padding of N to 16 and K to 32 adds nothing, and each row's outputs are one chain of sums in input order, so a
    row computed alone equals the same row in any batch, bit for bit (micro-tiles of 4, 3, 2 and 1 rows alike)."""
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    packed = gemm.pack(w)
    got = gemm.linear(x, packed)
    assert got.shape == (rows, n)
    if rows:
        assert _within_float32_sums(got, gemm.reference(x, packed), x, w.bfloat16().float(), None)
        alone = torch.cat([gemm.linear(x[i:i + 1], packed) for i in range(rows)])
        assert torch.equal(alone, got)


def test_the_bias_stays_float32(gemm) -> None:  # type: ignore[no-untyped-def]
    """The bias is added to float32 sums as ``F.linear`` in float32 adds it: not rounded to bf16 as the weights are."""
    bias = torch.full((16,), 1.0 + 2.0 ** -12)  # no bf16 holds it
    packed = gemm.pack(torch.zeros(16, 32), bias)
    assert torch.equal(gemm.linear(torch.ones(3, 32), packed), bias.expand(3, 16))


def test_threads_do_not_change_a_bit(gemm) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(3)
    packed = gemm.pack(torch.randn(960, 576, generator=g))
    x = torch.randn(37, 576, generator=g)
    with torch_threads(1):
        one = gemm.linear(x, packed)
    with torch_threads(2):
        two = gemm.linear(x, packed)
    assert torch.equal(one, two)


def test_bad_rows_are_refused(gemm) -> None:  # type: ignore[no-untyped-def]
    packed = gemm.pack(torch.randn(16, 32))
    with pytest.raises(KernelError, match="float32"):
        gemm.linear(torch.randn(2, 32).bfloat16(), packed)
    with pytest.raises(KernelError, match="32 columns"):
        gemm.linear(torch.randn(2, 31), packed)
    assert gemm.linear(torch.randn(0, 32), packed).shape == (0, 16)


def test_ops_binds_it_for_cpu_weights(gemm) -> None:  # type: ignore[no-untyped-def]
    w = torch.randn(48, 64)
    bound = ops.bind_bf16w_linear(w)
    assert bound is not None and bound.weight.in_features == 64
    x = torch.randn(5, 64)
    assert torch.equal(bound(x), gemm.linear(x, bound.weight))
    with pytest.raises(KernelError):
        ops.bind_bf16w_linear(w, torch.randn(47))


def test_an_avx2_build_gives_the_same_bits(gemm, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Under ``.ci/avx2-rehearsal`` (numba compiles for Haswell: 8-lane vectors, no AVX-512) the kernel runs and its
    outputs are this host's, bit for bit: the same fused multiply-adds in the same order."""
    code = (
        "import sys, torch\n"
        "from apiary.kernels import cpu_bf16w_gemm as gemm, cpu_int8_gemm\n"
        "assert not cpu_int8_gemm._numba_target_features().get('avx512f'), 'AVX-512 not hidden'\n"
        "g = torch.Generator().manual_seed(0)\n"
        "packed = gemm.pack(torch.randn(48, 130, generator=g), torch.randn(48, generator=g))\n"
        "x = torch.randn(7, 130, generator=g)\n"
        "torch.save(gemm.linear(x, packed), sys.argv[1])\n"
    )
    out = tmp_path / "avx2.pt"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    rehearsal = Path(__file__).resolve().parents[2] / ".ci" / "avx2-rehearsal"
    done = subprocess.run([str(rehearsal), sys.executable, "-c", code, str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    g = torch.Generator().manual_seed(0)
    packed = gemm.pack(torch.randn(48, 130, generator=g), torch.randn(48, generator=g))
    x = torch.randn(7, 130, generator=g)
    assert torch.equal(torch.load(out), gemm.linear(x, packed))


def test_rows_go_in_micro_tiles_as_even_as_can_be(gemm) -> None:  # type: ignore[no-untyped-def]
    """No 1- or 2-row micro-tile where a 3-row one can take the rows (each tile widens the weights again)."""
    split = functools.partial(micro_tiles, gemm._rows_next.py_func, gemm.ROWS)
    assert [split(m) for m in (1, 2, 3, 4, 5, 7, 13, 14, 16)] == [
        [1], [2], [3], [4], [3, 2], [4, 3], [4, 3, 3, 3], [4, 4, 3, 3], [4, 4, 4, 4]]
    assert all(max(split(m)) <= gemm.ROWS and sum(split(m)) == m for m in range(1, 300))
