"""The engine's CPU threads, decided in one place: how many, and how they wait.

Why: on a shared CPU the engine collapsed (docs/benchmarks.md, issue 21): with two busy
processes beside it, 51 tok/s fell to 9 while the process used ~145% CPU. Two OpenMP runtimes
run in the process, torch's bundled libgomp (matmuls, oneDNN, elementwise ops) and the system
libgomp that numba's ``omp`` threading layer loads for the decode-attention kernel, and libgomp's
default wait policy spins at every barrier and after every parallel region. When a busy
neighbour takes one core, the thread that still has work waits for it while its partner burns
the other core spinning. And thread counts came from ``os.cpu_count()``, which ignores the CPUs
this process may use (``sched_getaffinity``) and the container's CPU quota (cgroup).

So, before torch or numba load their OpenMP runtimes (``apiary.cloud.engine`` imports this module
first), ``configure_environment`` sets, unless the operator already did:
- ``OMP_WAIT_POLICY=PASSIVE``: idle OpenMP threads sleep at once (libgomp then spins 0 times),
  for both runtimes; ``KMP_BLOCKTIME=0`` does the same for Intel's OpenMP if that is the one loaded;
- ``OMP_NUM_THREADS`` and ``NUMBA_NUM_THREADS``: the CPUs available (affinity, cgroup quota).
libgomp reads these once, when it loads: if torch was imported before ``apiary.cloud.engine``, its pool
keeps whatever it started with, and ``report()`` says so. ``apply`` then sets the thread count
at engine load (``EngineConfig.num_threads``, else the CPUs available).

The price, measured (docs/benchmarks.md, issue 21): on an otherwise idle 2-core VM the passive
policy runs the engine at ~0.6x of libgomp's default (a sleeping thread's wake-up costs
more than the work between two ops), while with two busy processes beside it the default fell
to ~10 tok/s and passive kept ~55. Short spins (``GOMP_SPINCOUNT`` 2,000-100,000) measured in
between and under 40% of idle when shared. Where the CPU is known to be the engine's alone, an
operator can take libgomp's spinning back: ``GOMP_SPINCOUNT=300000`` (its default, ~3 ms) in the
environment overrides the policy's spin count, and any variable already set is left as it is.
"""
from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
WAIT_POLICY = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 ``cpu.max`` (``"QUOTA PERIOD"`` or ``"max PERIOD"``) -> CPUs allowed, or None for no limit."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    quota, period = int(parts[0]), int(parts[1]) if len(parts) > 1 else 100_000
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs(quota: str, period: str) -> float | None:
    """cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` -> CPUs allowed, or None (quota -1: no limit)."""
    q, p = int(quota.strip()), int(period.strip())
    return q / p if q > 0 and p > 0 else None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (v2 ``cpu.max``, else v1 CFS files), None if unlimited."""
    try:
        if (root / "cpu.max").is_file():
            return parse_cpu_max((root / "cpu.max").read_text())
        v1 = root / "cpu"
        if (v1 / "cpu.cfs_quota_us").is_file():
            return parse_cfs((v1 / "cpu.cfs_quota_us").read_text(), (v1 / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        pass
    return None


def affinity_cpus() -> int:
    """CPUs this process may run on (``sched_getaffinity``; ``os.cpu_count()`` where that does not exist)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_cpus(affinity: int, quota: float | None) -> int:
    """Threads to run: the CPUs in the affinity mask, capped by the quota rounded down (at least 1).

    Rounded down because OpenMP threads meet at barriers: with 1.5 CPUs of quota, two threads
    would both be throttled in every period and each wait for the other.
    """
    n = max(1, affinity)
    if quota is not None:
        n = min(n, max(1, math.floor(quota + 1e-9)))
    return n


@dataclass(slots=True)
class ThreadState:
    cpus: int = 0  # available_cpus() when configure_environment ran
    affinity: int = 0
    quota: float | None = None
    set_by_engine: dict[str, str] = field(default_factory=dict)  # env vars this module set
    from_environment: dict[str, str] = field(default_factory=dict)  # ones the operator had set
    late: list[str] = field(default_factory=list)  # runtimes loaded before the env was set
    threads: int | None = None  # what apply() chose


STATE = ThreadState()


def configure_environment(env: MutableMapping[str, str] | None = None, cpus: int | None = None,
                          loaded: Mapping[str, object] | None = None) -> ThreadState:
    """Set the wait policy and thread counts in ``env`` (default ``os.environ``) where unset.

    ``cpus``: the thread count to advertise (default: affinity and cgroup quota). ``loaded``: the
    modules already imported (default ``sys.modules``), to report runtimes that load too early.
    """
    env = os.environ if env is None else env
    loaded = sys.modules if loaded is None else loaded
    state = ThreadState(affinity=affinity_cpus(), quota=cgroup_cpu_limit())
    state.cpus = cpus or available_cpus(state.affinity, state.quota)
    wanted = {**WAIT_POLICY, "OMP_NUM_THREADS": str(state.cpus), "NUMBA_NUM_THREADS": str(state.cpus)}
    for name, value in wanted.items():
        if name in env:
            state.from_environment[name] = env[name]
        else:
            env[name] = value
            state.set_by_engine[name] = value
    state.late = [m for m in ("torch", "numba") if m in loaded]
    return state


def apply(num_threads: int | None) -> int:
    """At engine load on CPU: torch's intra-op threads, ``num_threads`` if given, else torch's current
    count capped at the CPUs available (a caller that chose fewer keeps them). numba's decode
    kernel follows torch's count (``apiary.kernels.cpu_attention``)."""
    import torch

    n = num_threads or min(torch.get_num_threads(), STATE.cpus or available_cpus(affinity_cpus(), cgroup_cpu_limit()))
    torch.set_num_threads(n)
    STATE.threads = n
    log.info("engine threads: %s", report())
    return n


def report(state: ThreadState | None = None) -> str:
    """One line: threads, where the count came from, the wait policy and who set it."""
    s = STATE if state is None else state
    quota = "none" if s.quota is None else f"{s.quota:g} CPUs"
    policy = (s.from_environment.get("OMP_WAIT_POLICY") or s.set_by_engine.get("OMP_WAIT_POLICY")
              or os.environ.get("OMP_WAIT_POLICY", "unset"))
    who = "environment" if "OMP_WAIT_POLICY" in s.from_environment else "engine"
    line = (f"{s.threads or s.cpus} threads (affinity {s.affinity} CPUs, cgroup quota {quota}); "
            f"OMP_WAIT_POLICY={policy} (set by the {who})")
    if "torch" in s.late:
        line += "; torch was imported before cloud.engine, so its OpenMP pool kept the policy it loaded with"
    return line


def install() -> None:
    """Run once, from ``cloud/engine/__init__.py``, before anything there imports torch or numba."""
    global STATE
    STATE = configure_environment()
