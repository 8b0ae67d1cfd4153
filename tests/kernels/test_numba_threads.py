"""numba's kernels on oneTBB's pool once ``prepare`` ran (int8 engines) where the tbb wheel is installed, on its
OpenMP layer otherwise, when told, or without the wheel."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from apiary.kernels import numba_threads

# In a fresh interpreter (numba picks its layer once per process): optionally prepare TBB, run one parallel
# kernel, report the layer it ran on, whether its result was right, and what describe() said.
PROBE = (
    "import json, sys, torch; from apiary.kernels import cpu_attention, numba_threads, reference; "
    "prepared = str(numba_threads.prepare()) if sys.argv[1] == 'prepare' else None; "
    "before = numba_threads.describe(); "
    "q = torch.randn(3, 4, 16); k = torch.randn(2, 16, 2, 16); v = torch.randn(2, 16, 2, 16); "
    "tables = torch.tensor([[0, 1]] * 3, dtype=torch.int32); lens = torch.tensor([5, 17, 32], dtype=torch.int32); "
    "got = cpu_attention.paged_decode_attention(q, k, v, tables, lens, 0.25); "
    "want = reference.paged_decode_attention(q, k, v, tables, lens, 0.25); "
    "print(json.dumps([numba_threads.layer(), bool(torch.allclose(got, want, atol=1e-5)), before, "
    "numba_threads.describe(), prepared]))"
)


def probe(mode: str, **env: str) -> list:
    environment = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"} | env
    done = subprocess.run([sys.executable, "-c", PROBE, mode], env=environment, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


needs_tbb = pytest.mark.skipif(numba_threads.tbb_library() is None, reason="the tbb package is not installed here")


@needs_tbb
def test_the_wheels_library_is_found() -> None:
    path = numba_threads.tbb_library()
    assert path is not None and path.name == numba_threads.LIBRARY and path.is_file()


@needs_tbb
def test_prepared_kernels_run_on_tbbs_pool() -> None:
    layer, right, before, after, prepared = probe("prepare")
    assert layer == "tbb" and right and prepared == str(numba_threads.tbb_library())
    assert before == f"oneTBB's pool ({prepared})" and after == "oneTBB's pool"


def test_unprepared_kernels_stay_on_libgomp() -> None:
    """Engines with bf16 or float32 weights: torch's oneDNN runs their projections on torch's libgomp."""
    import ctypes.util

    if ctypes.util.find_library("tbb"):
        pytest.skip("a system libtbb is on the loader's path here: numba takes it without prepare()")
    layer, right, before, after, prepared = probe("leave")
    assert layer == "omp" and right and prepared is None
    assert before == "numba's OpenMP layer" and after == "numba's OpenMP layer"


def test_an_operators_layer_wins() -> None:
    layer, right, before, after, prepared = probe("prepare", NUMBA_THREADING_LAYER="omp")
    assert layer == "omp" and right and prepared == "None" and before == "NUMBA_THREADING_LAYER=omp"


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


def test_a_library_that_will_not_load_is_reported_not_raised(fresh: pytest.MonkeyPatch, tmp_path: Path) -> None:
    broken = tmp_path / numba_threads.LIBRARY
    broken.write_bytes(b"not an ELF file")
    fresh.setattr(numba_threads, "tbb_library", lambda: broken)
    assert numba_threads.prepare() is None


def test_a_layer_named_by_the_operator_is_left_to_numba(fresh: pytest.MonkeyPatch) -> None:
    fresh.setenv("NUMBA_THREADING_LAYER", "workqueue")
    assert numba_threads.prepare() is None
