"""Which thread pool runs the numba kernels' parallel loops: oneTBB's for int8 weights, libgomp's otherwise.

Why: every ``prange`` loop is a parallel region, and a decode step with int8 weights runs ~270 of them
(two per projection, one per layer's attention). Under numba's ``omp`` layer with the passive waits the
engine needs on a shared CPU (``cloud.engine.threads``), each region parks the worker on a futex and
wakes it again: an empty region cost 41-75 us on the 2-CPU VM of docs/benchmarks.md, 1.7 us with
spinning waits, and the int8 projections of a 16-row decode step took 20.9 ms instead of 8.8. On
oneTBB's pool the same empty region costs 1.5-10 us, yet between regions the process uses no more than
its one busy thread (its workers pause and yield the CPU a while before they sleep), and the int8
projections take 8.9 ms: the engine alone ran 1.4x faster, and faster too beside two busy processes.
With bf16 or float32 weights torch's oneDNN runs the projections on torch's libgomp and numba only the
attention; there TBB gained ~5% on an idle host but its yielding workers took CPU from torch's threads
when the CPU was shared (68-92 tok/s against 104-135 with two busy processes), so those engines keep
numba on libgomp. The layer is per process, chosen at numba's first parallel loop: the first engine
decides (``cloud.engine.threads.apply``).

numba tries its layers in the order tbb, omp, workqueue, but finds TBB with ``dlopen("libtbb.so.12")``,
and pip puts the wheel's library in ``<prefix>/lib``, off the loader's search path. Loading it once by
its full path first is enough: the loader then answers that name with the library already loaded.
Nothing here imports numba before its layer is chosen.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

LIBRARY = "libtbb.so.12"
# NUMBA_THREADING_LAYER values under which numba would pick TBB when it can load it
TBB_CHOICES = ("", "default", "tbb", "safe", "threadsafe", "forksafe")


def tbb_library() -> Path | None:
    """The ``libtbb.so.12`` of the installed ``tbb`` distribution, or None without one."""
    try:
        files = importlib.metadata.files("tbb") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == LIBRARY:
            path = Path(str(file.locate())).resolve()
            return path if path.is_file() else None
    return None


@functools.cache
def prepare() -> Path | None:
    """Load the ``tbb`` wheel's library so that numba's kernels run on TBB's pool; the path loaded, or None
    (no wheel, a layer chosen by ``NUMBA_THREADING_LAYER``, or a library that would not load: numba then
    takes its OpenMP layer, and the reason is logged)."""
    chosen = os.environ.get("NUMBA_THREADING_LAYER", "").strip().lower()
    if chosen not in TBB_CHOICES:
        return None
    path = tbb_library()
    if path is None:
        log.info("the tbb package is not installed: numba's kernels run on its OpenMP layer")
        return None
    try:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        log.warning("could not load %s (%s): numba's kernels run on its OpenMP layer", path, e)
        return None
    return path


def describe() -> str:
    """Which pool numba's kernels use in this process (or will, at their first parallel loop), for logs and
    benchmark tables."""
    started = layer()
    if started != "not started":
        return {"tbb": "oneTBB's pool", "omp": "numba's OpenMP layer"}.get(started, f"numba's {started} layer")
    chosen = os.environ.get("NUMBA_THREADING_LAYER", "").strip().lower()
    if chosen not in TBB_CHOICES:
        return f"NUMBA_THREADING_LAYER={chosen}"
    if prepare.cache_info().currsize and prepare() is not None:
        return f"oneTBB's pool ({prepare()})"
    return "numba's OpenMP layer"


def layer() -> str:
    """The threading layer numba's parallel loops use in this process (``"tbb"``, ``"omp"``, ``"workqueue"``),
    or ``"not started"`` before the first one ran (or without numba)."""
    if "numba" not in sys.modules:
        return "not started"
    import numba

    try:
        return str(numba.threading_layer())
    except ValueError:
        return "not started"
