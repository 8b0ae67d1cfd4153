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
first), ``configure_environment`` sets ``OMP_NUM_THREADS`` and ``NUMBA_NUM_THREADS`` to the CPUs
available (affinity, cgroup quota), and the wait policy that ``APIARY_CPU_WAITS`` names, unless the
operator set the variables already:
- ``passive`` (default): ``OMP_WAIT_POLICY=PASSIVE`` and ``KMP_BLOCKTIME=0`` for both runtimes;
  idle threads sleep at once. Robust when the CPU is shared (it keeps ~73% of its idle throughput
  with two busy processes beside it), but a futex wake-up per op costs it on an idle VM: 86 tok/s
  where spinning waits give 126-144 (docs/benchmarks.md, session 9).
- ``adaptive``: torch's libgomp keeps its spinning waits; numba's, which loads at the first decode,
  gets ``PASSIVE`` from ``apply`` (its threads spinning through torch's ops took cores from torch's:
  126-129 tok/s both spinning, 137-144 numba passive); and ``ThreadGovernor`` watches between steps
  how much CPU other processes use, and ``SpinThrottle`` makes torch's threads sleep while one
  does. Idle it runs at the spinning speed; shared it measured 45-58 tok/s against passive's 63
  (spinning alone: 13-26), so it is for hosts whose cores are mostly the engine's.
libgomp reads these once, when it loads: if torch was imported before ``apiary.cloud.engine``, its
pool keeps whatever it started with, and ``report()`` says so.

Where numba's kernels run the projections (int8 weights; bf16 ones on CPUs numba compiles ``vdpbf16ps``
for, ``kernels.cpu_bf16_gemm``), their loops go to oneTBB's pool where the ``tbb`` wheel is installed
(``kernels.numba_threads``): there a parallel loop's start and end cost microseconds without spinning,
where numba's libgomp with passive waits cost ~50 us each (such a decode step runs ~270 of them). Other
engines (torch's GEMMs: float32, bf16 through oneDNN) keep numba on its libgomp with the policies above:
TBB's yielding workers took CPU from torch's threads when the CPU was shared.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
WAIT_POLICY = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}  # waits = passive: for both runtimes
NUMBA_WAIT_POLICY = {"OMP_WAIT_POLICY": "PASSIVE"}  # waits = adaptive: numba's libgomp, once torch's has loaded
WAITS = ("passive", "adaptive")


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


def own_cgroups(membership: str) -> list[tuple[str, str]]:
    """``/proc/self/cgroup`` text -> ``(hierarchy, path)`` of this process's cgroups that can hold a CPU quota:
    ``("v2", path)`` for the unified hierarchy, ``(controllers, path)`` (e.g. ``"cpu,cpuacct"``) for a v1 one with
    the ``cpu`` controller. Lines of other controllers, and malformed ones, are left out."""
    found = []
    for line in membership.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            found.append(("v2", path))
        elif "cpu" in controllers.split(","):
            found.append((controllers, path))
    return found


def _up_from(mount: Path, path: str) -> list[Path]:
    """``mount`` joined with ``path`` and each of its ancestors up to ``mount`` itself: a limit set on any of them
    applies to the process."""
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    return [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _limit_in(folder: Path, v2: bool) -> float | None:
    """The quota that ``folder``'s own files set (v2 ``cpu.max``, v1 CFS files), None where none is set or readable."""
    try:
        if v2:
            return parse_cpu_max((folder / "cpu.max").read_text()) if (folder / "cpu.max").is_file() else None
        if (folder / "cpu.cfs_quota_us").is_file():
            return parse_cfs((folder / "cpu.cfs_quota_us").read_text(), (folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        pass
    return None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, membership: str | None = None) -> float | None:
    """The CPU quota this process runs under, in CPUs: the smallest limit set on its own cgroup or any ancestor, in
    the unified hierarchy (v2 ``cpu.max``) and the v1 ``cpu`` one (CFS files); None where none is set or readable.

    Why its own cgroup and not only the mount's root: a container with a cgroup namespace sees its cgroup at the
    root, but a systemd unit with ``CPUQuota=``, a job placed in a child cgroup, or a container without a namespace
    has its limit at the path ``/proc/self/cgroup`` (``membership``) names, where the root's files say "no limit"
    (found by a drill: a process in a v1 child cgroup with a one-CPU quota was given two threads and reported no
    quota). The root's own files are always read too (a namespaced container's limit lives there)."""
    if membership is None:
        try:
            membership = Path("/proc/self/cgroup").read_text()
        except OSError:
            membership = ""
    folders: list[tuple[Path, bool]] = [(root, True), (root / "cpu", False)]
    for hierarchy, path in own_cgroups(membership):
        if hierarchy == "v2":
            folders += [(f, True) for f in _up_from(root, path)]
        else:
            for mount in dict.fromkeys((root / "cpu", root / hierarchy)):
                folders += [(f, False) for f in _up_from(mount, path)]
    limits = [limit for folder, v2 in dict.fromkeys(folders) if (limit := _limit_in(folder, v2)) is not None]
    return min(limits) if limits else None


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
    waits: str = "passive"  # APIARY_CPU_WAITS: "passive" (every runtime sleeps) or "adaptive" (see module doc)


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
    state.waits = env.get("APIARY_CPU_WAITS", "passive").strip().lower() or "passive"
    if state.waits not in WAITS:
        log.warning("APIARY_CPU_WAITS=%r is not one of %s; using passive", state.waits, WAITS)
        state.waits = "passive"
    wanted = {"OMP_NUM_THREADS": str(state.cpus), "NUMBA_NUM_THREADS": str(state.cpus)}
    if state.waits == "passive":
        wanted = {**WAIT_POLICY, **wanted}
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        if name in env and name not in wanted:
            state.from_environment[name] = env[name]
    for name, value in wanted.items():
        if name in env:
            state.from_environment[name] = env[name]
        else:
            env[name] = value
            state.set_by_engine[name] = value
    state.late = [m for m in ("torch", "numba") if m in loaded]
    return state


def apply(num_threads: int | None, numba_on_tbb: bool = False) -> int:
    """At engine load on CPU: torch's intra-op threads, ``num_threads`` if given, else torch's current
    count capped at the CPUs available (a caller that chose fewer keeps them). numba's decode
    kernel follows torch's count (``apiary.kernels.cpu_attention``). ``numba_on_tbb``: numba runs the
    projections (int8 weights, or bf16 through ``kernels.cpu_bf16_gemm``), so its loops go to oneTBB's pool
    where the wheel is installed (``kernels.numba_threads``); the first engine in a process decides, before
    numba's first loop."""
    import torch

    from apiary.kernels import numba_threads

    if numba_on_tbb:
        if numba_threads.layer() not in ("not started", "tbb"):
            log.warning("numba's kernels already run on %s in this process; the projections' GEMM keeps it",
                        numba_threads.describe())
        else:
            numba_threads.prepare()

    n = num_threads or min(torch.get_num_threads(), STATE.cpus or available_cpus(affinity_cpus(), cgroup_cpu_limit()))
    torch.set_num_threads(n)
    STATE.threads = n
    passive_for_numba()
    log.info("engine threads: %s", report(numba_pool=numba_threads.describe()))
    return n


def passive_for_numba(env: MutableMapping[str, str] | None = None, state: ThreadState | None = None) -> None:
    """Once torch's libgomp has loaded (spinning), the policy numba's libgomp will read when the first
    decode loads it: passive, unless the operator chose a policy for both."""
    env = os.environ if env is None else env
    state = STATE if state is None else state
    if state.waits != "adaptive":
        return  # passive: both runtimes already read PASSIVE (or the operator's choice) at import
    for name, value in NUMBA_WAIT_POLICY.items():
        if name not in env:
            env[name] = value
            state.set_by_engine[name] = value


def report(state: ThreadState | None = None, numba_pool: str | None = None) -> str:
    """One line: threads, where the count came from, how each OpenMP runtime waits, and ``numba_pool``
    (``kernels.numba_threads.describe()``) where given."""
    s = STATE if state is None else state
    quota = "none" if s.quota is None else f"{s.quota:g} CPUs"
    line = f"{s.threads or s.cpus} threads (affinity {s.affinity} CPUs, cgroup quota {quota}); "
    chosen = {k: v for k, v in s.from_environment.items() if k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if chosen:
        line += " ".join(f"{k}={v}" for k, v in chosen.items()) + " (set by the environment)"
    elif s.waits == "adaptive":
        line += ("APIARY_CPU_WAITS=adaptive: torch spinning, sleeping while others use a core (governor); "
                 "numba OMP_WAIT_POLICY=PASSIVE")
    else:
        line += "OMP_WAIT_POLICY=PASSIVE (set by the engine)"
    if "torch" in s.late:
        line += "; torch was imported before cloud.engine, so its OpenMP pool kept the policy it loaded with"
    if numba_pool:
        line += f"; numba kernels: {numba_pool}"
    return line


def install() -> None:
    """Run once, from ``cloud/engine/__init__.py``, before anything there imports torch or numba."""
    global STATE
    STATE = configure_environment()


def parse_stat_busy(text: str, cpus: set[int] | None = None) -> tuple[int, int]:
    """``/proc/stat`` text -> (busy, total) clock ticks summed over ``cpus`` (None: every ``cpuN`` line).

    Busy is every column but idle and iowait, steal included: time a hypervisor gave another guest is
    as gone for us as time another process took. guest/guest_nice are already inside user/nice.
    """
    busy = total = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit():
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        fields = [int(x) for x in rest.split()[:8]]
        fields += [0] * (8 - len(fields))
        user, nice, system, idle, iowait, irq, softirq, steal = fields
        busy += user + nice + system + irq + softirq + steal
        total += user + nice + system + idle + iowait + irq + softirq + steal
    return busy, total


def _read_proc_stat() -> str:
    with open("/proc/stat", encoding="ascii", errors="replace") as f:
        return f.read()


def _affinity_set() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


class ThreadGovernor:
    """Tells the engine, between steps, how many of its CPUs the rest of the machine leaves free.

    Why: OpenMP threads meet at a barrier after every op, so when another process takes a core the
    whole team waits for the thread that lost it, and with spinning waits its partners burn theirs
    meanwhile (docs/benchmarks.md). It measures how many CPUs *others* used (``/proc/stat`` busy
    ticks on this process's CPUs, steal included, minus this process's own CPU time) and calls
    ``on_change(free)`` with ``round(cpus - others)``, at least one, when that changes; the engine
    then makes its threads sleep instead of spin (``SpinThrottle``) while fewer than all are free.
    A change needs ``patience`` samples in a row (``interval_s`` apart) agreeing, so one burst does
    not flap it. (Running fewer threads instead measured worse: 42-45 tok/s with two busy loops beside
    it, against 52-64 with sleeping waits on two threads.)

    Everything it reads comes in through arguments, so it is tested with scripted clocks and stat text.
    """

    __slots__ = ("max_threads", "on_change", "interval_s", "patience", "read_stat", "own_cpu", "clock", "cpus",
                 "threads", "others", "changes", "_last", "_votes", "_vote_for")

    def __init__(self, max_threads: int, on_change: Callable[[int], None], *, interval_s: float = 0.5,
                 patience: int = 2, read_stat: Callable[[], str] = _read_proc_stat,
                 own_cpu: Callable[[], float] = time.process_time, clock: Callable[[], float] = time.monotonic,
                 cpus: set[int] | None = None) -> None:
        self.max_threads = max(1, max_threads)
        self.on_change = on_change
        self.interval_s = interval_s
        self.patience = max(1, patience)
        self.read_stat, self.own_cpu, self.clock = read_stat, own_cpu, clock
        self.cpus = _affinity_set() if cpus is None else cpus
        self.threads = self.max_threads  # the free CPUs last reported (max_threads until told otherwise)
        self.others: float | None = None  # CPUs others used in the last window
        self.changes = 0
        self._last: tuple[float, int, float] | None = None
        self._votes = 0
        self._vote_for = self.max_threads

    def _sample(self) -> tuple[float, int, float] | None:
        try:
            busy, _ = parse_stat_busy(self.read_stat(), self.cpus)
        except (OSError, ValueError):
            return None
        return self.clock(), busy, self.own_cpu()

    def target(self, others: float) -> int:
        """Threads for a machine where others use ``others`` CPUs: the free ones, rounded half up, >= 1."""
        return min(self.max_threads, max(1, math.floor(self.max_threads - others + 0.5)))

    def tick(self) -> int | None:
        """Call between steps; cheap when the window is not over. Returns the new thread count when it changed."""
        now = self.clock()
        if self._last is not None and now - self._last[0] < self.interval_s:
            return None
        sample = self._sample()
        if sample is None:
            return None
        last, self._last = self._last, sample
        if last is None:
            return None
        wall = sample[0] - last[0]
        others = max(0.0, ((sample[1] - last[1]) * TICK_S - (sample[2] - last[2])) / wall)
        self.others = others
        want = self.target(others)
        if want == self.threads:
            self._votes = 0
            return None
        self._votes = self._votes + 1 if want == self._vote_for else 1
        self._vote_for = want
        if self._votes < self.patience:
            return None
        self._votes = 0
        self.threads = want
        self.changes += 1
        self.on_change(want)
        log.info("engine: %d of %d CPUs free (others used %.2f)", want, self.max_threads, others)
        return want


class SpinThrottle:
    """Switches torch's OpenMP threads between spinning and sleeping waits while the engine runs.

    Why: libgomp reads its wait policy once, at load, and either choice loses somewhere: spinning
    waits collapse when another process takes a core (13-26 tok/s against 126-144 idle on the
    2-core VM), sleeping ones pay a futex wake-up per op (~86 idle). But libgomp also spins only
    briefly (100 spins, its documented ``GOMP_SPINCOUNT`` rule) while it manages more threads than
    the CPUs available. ``on()`` parks a helper thread that ran one parallel op of ``threads``
    threads: its team stays managed while it waits, so every team of torch's libgomp then sleeps
    at once; ``off()`` lets it finish, its team is freed, and full spinning is back.
    """

    __slots__ = ("threads", "_release", "_holder")

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._release: threading.Event | None = None
        self._holder: threading.Thread | None = None

    @property
    def engaged(self) -> bool:
        return self._holder is not None

    def on(self) -> None:
        if self._holder is not None:
            return
        import torch

        release, started = threading.Event(), threading.Event()

        def hold() -> None:
            torch.set_num_threads(self.threads)
            x = torch.ones(1 << 20)
            x.mul_(1.0).sum()  # one parallel region: its team joins the threads libgomp manages
            started.set()
            release.wait()

        self._release, self._holder = release, threading.Thread(target=hold, name="omp-throttle", daemon=True)
        self._holder.start()
        started.wait(5.0)

    def off(self) -> None:
        if self._holder is None:
            return
        assert self._release is not None
        self._release.set()
        self._holder.join(5.0)
        self._release = self._holder = None
