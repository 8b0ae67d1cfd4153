"""numba's kernels on oneTBB's pool where the tbb wheel is installed, and on its OpenMP layer when told or without it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from apiary.kernels import numba_threads

# In a fresh interpreter (numba picks its layer once per process): import a kernel module, run one parallel
# kernel, report the layer it ran on, whether its result was right, and what describe() said.
PROBE = (
    "import json, numpy as np, torch; from apiary.kernels import cpu_attention, numba_threads; "
    "q = torch.randn(3, 4, 16); k = torch.randn(2, 16, 2, 16); v = torch.randn(2, 16, 2, 16); "
    "tables = torch.tensor([[0, 1]] * 3, dtype=torch.int32); lens = torch.tensor([5, 17, 32], dtype=torch.int32); "
    "from apiary.kernels import reference; "
    "got = cpu_attention.paged_decode_attention(q, k, v, tables, lens, 0.25); "
    "want = reference.paged_decode_attention(q, k, v, tables, lens, 0.25); "
    "print(json.dumps([numba_threads.layer(), bool(torch.allclose(got, want, atol=1e-5)), numba_threads.describe()]))"
)


def probe(**env: str) -> list:
    environment = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"} | env
    done = subprocess.run([sys.executable, "-c", PROBE], env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


needs_tbb = pytest.mark.skipif(numba_threads.tbb_library() is None, reason="the tbb package is not installed here")


@needs_tbb
def test_the_wheels_library_is_found_and_loads() -> None:
    path = numba_threads.tbb_library()
    assert path is not None and path.name == numba_threads.LIBRARY and path.is_file()
    assert numba_threads.prepare() == path
    assert str(path) in numba_threads.describe()


@needs_tbb
def test_kernels_run_on_tbbs_pool_by_default() -> None:
    layer, right, described = probe()
    assert layer == "tbb" and right and described.startswith("oneTBB's pool")


def test_an_operators_layer_wins() -> None:
    layer, right, described = probe(NUMBA_THREADING_LAYER="omp")
    assert layer == "omp" and right and described == "NUMBA_THREADING_LAYER=omp"


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """``prepare`` decides again, with no layer named by the environment (the library stays loaded)."""
    monkeypatch.delenv("NUMBA_THREADING_LAYER", raising=False)
    numba_threads.prepare.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    numba_threads.prepare.cache_clear()


def test_without_the_package_nothing_is_loaded(fresh: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    def missing(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    fresh.setattr(importlib.metadata, "files", missing)
    assert numba_threads.tbb_library() is None and numba_threads.prepare() is None
    assert numba_threads.describe() == "numba's OpenMP layer (the tbb package is not installed)"


def test_a_library_that_will_not_load_is_reported_not_raised(fresh: pytest.MonkeyPatch, tmp_path: Path) -> None:
    broken = tmp_path / numba_threads.LIBRARY
    broken.write_bytes(b"not an ELF file")
    fresh.setattr(numba_threads, "tbb_library", lambda: broken)
    assert numba_threads.prepare() is None
    assert numba_threads.describe() == "numba's OpenMP layer (libtbb would not load)"


def test_a_layer_named_by_the_operator_is_left_to_numba(fresh: pytest.MonkeyPatch) -> None:
    fresh.setenv("NUMBA_THREADING_LAYER", "workqueue")
    assert numba_threads.prepare() is None and numba_threads.describe() == "NUMBA_THREADING_LAYER=workqueue"
