"""Threads and dtype from the host: affinity, cgroup quota, wait policy, bf16 only where native."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from apiary.cloud.engine import EngineConfig, threads
from apiary.cloud.engine.model_runner import resolve_dtype
from apiary.kernels import cpu
from tests.kernels.test_cpu import AMX_HOST, AVX2_HOST


def test_cgroup_quota_files_parse_to_cpus() -> None:
    assert threads.parse_cpu_max("max 100000\n") is None
    assert threads.parse_cpu_max("150000 100000\n") == 1.5
    assert threads.parse_cpu_max("200000") == 2.0  # period left out: the kernel's default 100 ms
    assert threads.parse_cfs("-1\n", "100000\n") is None
    assert threads.parse_cfs("50000\n", "100000\n") == 0.5


def test_cgroup_limit_is_the_smallest_readable_at_the_mount_root(tmp_path: Path) -> None:
    at_root = "0::/\n1:cpu,cpuacct:/\n"  # a process whose cgroups are the mounts' roots (a namespaced container)
    assert threads.cgroup_cpu_limit(tmp_path, at_root) is None  # neither file: no limit known
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.cgroup_cpu_limit(tmp_path, at_root) == 3.0
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert threads.cgroup_cpu_limit(tmp_path, at_root) == 1.0
    (tmp_path / "cpu.max").write_text("garbage\n")  # unreadable: left out, the other limit still holds
    assert threads.cgroup_cpu_limit(tmp_path, at_root) == 3.0
    assert threads.cgroup_cpu_limit(tmp_path, "") == 3.0  # /proc/self/cgroup unreadable: the roots' files


def test_cgroup_limit_is_read_where_proc_self_cgroup_puts_the_process(tmp_path: Path) -> None:
    """A systemd unit or a child cgroup: the limit is on the process's own cgroup or an ancestor, not on the root."""
    unit = tmp_path / "system.slice" / "apiary.service"
    unit.mkdir(parents=True)
    (tmp_path / "system.slice" / "cpu.max").write_text("400000 100000\n")  # the slice's limit applies to the unit
    membership = "0::/system.slice/apiary.service\n"
    assert threads.cgroup_cpu_limit(tmp_path, membership) == 4.0
    (unit / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_cpu_limit(tmp_path, membership) == 4.0  # "max" on the unit lifts nothing above it
    (unit / "cpu.max").write_text("150000 100000\n")
    assert threads.cgroup_cpu_limit(tmp_path, membership) == 1.5
    # v1: the cpu controller mounted alone or with cpuacct, the process in a child cgroup
    for mount in ("cpu", "cpu,cpuacct"):
        job = tmp_path / mount / "jobs" / "7"
        job.mkdir(parents=True)
        (job / "cpu.cfs_quota_us").write_text("50000\n")
        (job / "cpu.cfs_period_us").write_text("100000\n")
        assert threads.cgroup_cpu_limit(tmp_path, "4:cpu,cpuacct:/jobs/7\n3:memory:/jobs/7\n") == 0.5
        (job / "cpu.cfs_quota_us").unlink()
    assert threads.cgroup_cpu_limit(tmp_path, "4:memory:/jobs/7\n") is None  # no cpu controller: no CPU limit


def test_own_cgroups_keep_cpu_hierarchies_and_skip_malformed_lines() -> None:
    text = "12:memory:/a\n4:cpu,cpuacct:/a/b\n0::/user.slice/x\nbroken\n5:cpuset:/a\n6:cpu:relative\n"
    assert threads.own_cgroups(text) == [("cpu,cpuacct", "/a/b"), ("v2", "/user.slice/x")]
    assert threads._up_from(Path("/m"), "/a/../b") == [Path("/m/a/b"), Path("/m/a"), Path("/m")]


def _child_cgroup_with_quota(quota_us: int) -> Path | None:
    """A fresh v1 ``cpu`` cgroup under the mount's root with ``quota_us`` per 100 ms, or None where this process
    cannot make one (not root, cgroup v2 only, a read-only cgroup fs)."""
    mount = threads.CGROUP_ROOT / "cpu"
    if not (mount / "cpu.cfs_quota_us").is_file() or not os.access(mount, os.W_OK):
        return None
    child = mount / f"apiary-test-{os.getpid()}"
    try:
        child.mkdir()
        (child / "cpu.cfs_period_us").write_text("100000")
        (child / "cpu.cfs_quota_us").write_text(str(quota_us))
    except OSError:
        if child.is_dir():
            child.rmdir()
        return None
    return child


def test_an_engine_started_inside_a_quota_cgroup_takes_its_threads_from_the_quota(tiny_llama: Path) -> None:
    """The drill that found the bug, as a test: a fresh interpreter placed in a child cgroup limited to one CPU
    loads an engine and generates; its threads and its report follow the quota (before: two threads, "no quota")."""
    import json
    import subprocess
    import sys

    if threads.affinity_cpus() < 2:
        pytest.skip("needs at least 2 CPUs in the affinity mask to tell the quota from the affinity")
    child = _child_cgroup_with_quota(100_000)
    if child is None:
        pytest.skip("cannot create a v1 cpu cgroup here (needs root and cgroup v1's cpu controller mounted writable)")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")}
    code = ("import json, torch; from apiary.cloud.engine import EngineConfig, LLMEngine, SamplingParams, threads; "
            f"e = LLMEngine(EngineConfig(model_path={str(tiny_llama)!r}, kv_cache_bytes=1 << 20)); "
            "out = e.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True)); "
            "print(json.dumps([torch.get_num_threads(), threads.STATE.quota, len(out[0].output_token_ids), "
            "threads.report()]))")
    env["CODE"] = code  # the shell joins the cgroup, then becomes the interpreter
    try:
        done = subprocess.run(["sh", "-c", f'echo $$ > {child / "cgroup.procs"} && exec {sys.executable} -c "$CODE"'],
                              env=env, capture_output=True, text=True, check=True)
    finally:
        child.rmdir()
    torch_threads, quota, n, line = json.loads(done.stdout.splitlines()[-1])
    assert (torch_threads, quota, n) == (1, 1.0, 4)
    assert line.startswith("1 threads") and "cgroup quota 1 CPUs" in line


def test_threads_are_the_affinity_capped_by_the_quota_rounded_down() -> None:
    assert threads.available_cpus(8, None) == 8
    assert threads.available_cpus(8, 2.0) == 2
    assert threads.available_cpus(8, 1.5) == 1  # two threads would both be throttled and wait at barriers
    assert threads.available_cpus(2, 4.0) == 2
    assert threads.available_cpus(4, 0.25) == 1
    assert threads.available_cpus(0, None) == 1
    assert threads.affinity_cpus() == len(os.sched_getaffinity(0))


def test_environment_gets_passive_waits_and_counts_unless_the_operator_chose() -> None:
    env: dict[str, str] = {}
    state = threads.configure_environment(env, cpus=3, loaded={})
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0", "OMP_NUM_THREADS": "3",
                   "NUMBA_NUM_THREADS": "3"}
    assert state.set_by_engine == env and not state.late and state.waits == "passive"
    threads.passive_for_numba(env, state)
    assert state.set_by_engine == env
    assert "OMP_WAIT_POLICY=PASSIVE (set by the engine)" in threads.report(state)
    assert threads.report(state, numba_pool="oneTBB's pool").endswith("; numba kernels: oneTBB's pool")
    mine = {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "1"}
    state = threads.configure_environment(mine, cpus=3, loaded={"torch": object()})
    assert mine["OMP_WAIT_POLICY"] == "ACTIVE" and mine["OMP_NUM_THREADS"] == "1" and mine["NUMBA_NUM_THREADS"] == "3"
    assert state.from_environment == {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "1"}
    line = threads.report(state)
    assert "OMP_WAIT_POLICY=ACTIVE (set by the environment)" in line and "torch was imported before" in line


def test_adaptive_waits_leave_torch_spinning_and_give_numba_passive_waits_once_torch_loaded() -> None:
    env = {"APIARY_CPU_WAITS": "adaptive"}
    state = threads.configure_environment(env, cpus=2, loaded={})
    assert state.waits == "adaptive" and "OMP_WAIT_POLICY" not in env and env["OMP_NUM_THREADS"] == "2"
    threads.passive_for_numba(env, state)  # what numba's libgomp will read when the first decode loads it
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and state.set_by_engine["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "APIARY_CPU_WAITS=adaptive" in threads.report(state)
    assert threads.configure_environment({"APIARY_CPU_WAITS": "fast"}, cpus=2, loaded={}).waits == "passive"


def test_importing_the_engine_sets_the_policy_before_torch_and_numba_load() -> None:
    """In a fresh interpreter: ``import apiary.cloud.engine`` sets the env before its own torch/numba imports."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME", "OMP_NUM_THREADS",
                                                           "NUMBA_NUM_THREADS")}
    code = ("import json, os, torch, numba; from apiary.cloud.engine import threads; "
            "print(json.dumps([threads.STATE.late, os.environ.get('OMP_WAIT_POLICY'), os.environ['OMP_NUM_THREADS'], "
            "torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS, threads.report()]))")

    def run(source: str) -> list:
        done = subprocess.run([sys.executable, "-c", source], env=env, capture_output=True, text=True, check=True)
        return json.loads(done.stdout.splitlines()[-1])

    late, *_, line = run(code)  # torch and numba first: too late for their pools, and the report says so
    assert late == ["torch", "numba"] and "torch was imported before cloud.engine" in line
    late, policy, omp, torch_threads, numba_threads, line = run("import apiary.cloud.engine; " + code)
    cpus = threads.available_cpus(threads.affinity_cpus(), threads.cgroup_cpu_limit())
    assert late == [] and policy == "PASSIVE" and omp == str(cpus)
    assert torch_threads == cpus and numba_threads == cpus


def test_apply_sets_the_given_count_or_caps_torch_at_the_available_cpus() -> None:
    before = torch.get_num_threads()
    try:
        assert threads.apply(1) == 1 and torch.get_num_threads() == 1
        assert threads.apply(None) == 1  # a caller that chose fewer threads keeps them
        torch.set_num_threads(threads.STATE.cpus + 3)
        assert threads.apply(None) == threads.STATE.cpus
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("host", "expected"), [(AVX2_HOST, torch.float32), (AMX_HOST, torch.bfloat16)])
def test_auto_dtype_is_bfloat16_only_where_the_cpu_computes_it(host: str, expected: torch.dtype) -> None:
    flags = cpu.parse_flags(host)
    config = EngineConfig(model_path="unused")
    assert resolve_dtype(config, torch.device("cpu"), flags) == expected
    assert resolve_dtype(EngineConfig(model_path="unused", dtype="bfloat16"), torch.device("cpu"), flags) == torch.bfloat16
    assert resolve_dtype(EngineConfig(model_path="unused", dtype="float32"), torch.device("cpu"), flags) == torch.float32
    assert resolve_dtype(config, torch.device("cuda"), flags) == torch.bfloat16


def test_the_engine_logs_its_dtype_and_the_features_it_saw(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    from apiary.cloud.engine import LLMEngine

    with caplog.at_level("INFO", logger="apiary.cloud.engine.model_runner"):
        engine = LLMEngine(EngineConfig(model_path=tiny_llama, kv_cache_bytes=1 << 20))
    expected = resolve_dtype(engine.config, torch.device("cpu"))
    assert engine.runner.dtype == expected
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("engine dtype"))
    assert f"engine dtype {str(expected).removeprefix('torch.')} (asked auto)" in line
    assert cpu.describe() in line


STAT = """cpu  {u0} 0 0 {i0} 0 0 0 0 0 0
cpu0 {a} 0 {s} {i} 0 0 0 {st} 0 0
cpu1 {b} 0 0 {j} 0 0 0 0 0 0
intr 12345
"""


def test_proc_stat_busy_counts_every_column_but_idle_and_iowait_on_the_chosen_cpus() -> None:
    text = "cpu  9 9 9 9 9 9 9 9 0 0\ncpu0 10 1 2 100 5 3 4 7 6 0\ncpu1 20 0 0 50 0 0 0 0 0 0\ncpu11 1 1 1 1\n"
    assert threads.parse_stat_busy(text, {0}) == (10 + 1 + 2 + 3 + 4 + 7, 10 + 1 + 2 + 100 + 5 + 3 + 4 + 7)
    assert threads.parse_stat_busy(text, {0, 1}) == (27 + 20, 132 + 70)
    assert threads.parse_stat_busy(text) == (27 + 20 + 3, 132 + 70 + 4)  # short lines (old kernels) pad with 0
    assert threads.parse_stat_busy("intr 5\n", None) == (0, 0)


class Machine:
    """A scripted two-CPU machine: others' and our CPU use per window, as /proc/stat and process_time see it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy_ticks = 0
        self.own = 0.0
        self.set: list[int] = []

    def advance(self, seconds: float, others_cpus: float, own_cpus: float) -> None:
        self.now += seconds
        self.own += own_cpus * seconds
        self.busy_ticks += round((others_cpus + own_cpus) * seconds / threads.TICK_S)

    def stat(self) -> str:
        half = self.busy_ticks // 2
        return f"cpu0 {half} 0 0 0 0 0 0 0\ncpu1 {self.busy_ticks - half} 0 0 0 0 0 0 0\n"

    def governor(self, max_threads: int = 2, patience: int = 2) -> threads.ThreadGovernor:
        return threads.ThreadGovernor(max_threads, self.set.append, interval_s=0.5, patience=patience,
                                      read_stat=self.stat, own_cpu=lambda: self.own, clock=lambda: self.now,
                                      cpus={0, 1})


def test_the_governor_gives_up_a_core_others_keep_busy_and_takes_it_back_when_they_stop() -> None:
    m = Machine()
    g = m.governor()
    assert g.tick() is None  # the first sample is only a baseline
    for _ in range(4):  # alone on the machine: two threads, nothing changes
        m.advance(0.5, others_cpus=0.05, own_cpus=1.9)
        assert g.tick() is None
    assert g.threads == 2 and m.set == [] and g.others == pytest.approx(0.05, abs=0.03)
    m.advance(0.5, others_cpus=1.3, own_cpus=0.7)  # two busy loops arrive
    assert g.tick() is None  # one window is not enough (patience 2)
    m.advance(0.5, others_cpus=1.3, own_cpus=0.7)
    assert g.tick() == 1 and m.set == [1] and g.threads == 1
    for _ in range(3):
        m.advance(0.5, others_cpus=1.33, own_cpus=0.67)
        assert g.tick() is None
    m.advance(0.5, others_cpus=0.0, own_cpus=1.0)  # they stop
    assert g.tick() is None
    m.advance(0.5, others_cpus=0.0, own_cpus=1.0)
    assert g.tick() == 2 and m.set == [1, 2] and g.changes == 2


def test_a_single_burst_or_alternating_load_does_not_flap_the_thread_count() -> None:
    m = Machine()
    g = m.governor()
    g.tick()
    for others in (1.5, 0.1, 1.5, 0.1, 1.5, 0.0):  # never two windows in a row
        m.advance(0.5, others_cpus=others, own_cpus=0.5)
        assert g.tick() is None
    assert m.set == [] and g.threads == 2


def test_ticks_inside_the_window_read_nothing() -> None:
    reads = []
    m = Machine()
    g = threads.ThreadGovernor(2, m.set.append, interval_s=0.5, read_stat=lambda: reads.append(1) or m.stat(),
                               own_cpu=lambda: m.own, clock=lambda: m.now, cpus={0, 1})
    g.tick()
    for _ in range(10):
        m.now += 0.01
        g.tick()
    assert len(reads) == 1


def test_the_target_is_the_free_cores_rounded_half_up_and_never_zero() -> None:
    g = threads.ThreadGovernor(16, lambda n: None, read_stat=lambda: "", cpus={0})
    assert [g.target(x) for x in (0.0, 0.4, 0.5, 0.6, 3.2, 15.0, 40.0)] == [16, 16, 16, 15, 13, 1, 1]
    assert threads.ThreadGovernor(2, lambda n: None, read_stat=lambda: "").target(0.5) == 2
    assert threads.ThreadGovernor(2, lambda n: None, read_stat=lambda: "").target(0.51) == 1


def test_an_unreadable_proc_stat_leaves_the_threads_alone() -> None:
    def broken() -> str:
        raise OSError("no /proc here")

    g = threads.ThreadGovernor(2, lambda n: pytest.fail("must not change threads"), read_stat=broken,
                               clock=iter(range(0, 100, 1)).__next__)
    for _ in range(5):
        assert g.tick() is None
    assert g.threads == 2


def test_the_engine_runs_the_governor_between_steps_on_cpu(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With adaptive waits and more than one thread the engine keeps a governor and ticks it each step;
    passive waits or one thread mean none."""
    from apiary.cloud.engine import LLMEngine, SamplingParams

    before = torch.get_num_threads()
    monkeypatch.setattr(threads.STATE, "waits", "adaptive")
    try:
        engine = LLMEngine(EngineConfig(model_path=tiny_llama, kv_cache_bytes=1 << 20, num_threads=2))
        governor = engine.runner.governor
        assert governor is not None and governor.max_threads == 2
        ticks = []

        class Counting:
            def tick(self) -> None:
                ticks.append(1)

        engine.runner.governor = Counting()
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(ticks) >= 3
        monkeypatch.setattr(threads.STATE, "waits", "passive")
        assert LLMEngine(EngineConfig(model_path=tiny_llama, kv_cache_bytes=1 << 20,
                                      num_threads=2)).runner.governor is None
        monkeypatch.setattr(threads.STATE, "waits", "adaptive")
        assert LLMEngine(EngineConfig(model_path=tiny_llama, kv_cache_bytes=1 << 20,
                                      num_threads=1)).runner.governor is None
    finally:
        torch.set_num_threads(before)


def test_the_throttle_parks_one_omp_team_while_on_and_frees_it_when_off() -> None:
    """On: a helper thread that ran a parallel op waits (its team keeps libgomp throttled); off: it is gone."""
    import threading

    t = threads.SpinThrottle(2)
    assert not t.engaged
    t.on()
    t.on()  # idempotent: still one helper
    holders = [th for th in threading.enumerate() if th.name == "omp-throttle"]
    assert t.engaged and len(holders) == 1 and holders[0].is_alive()
    t.off()
    assert not t.engaged and not holders[0].is_alive()
    t.off()
    assert not [th for th in threading.enumerate() if th.name == "omp-throttle"]


def test_the_engine_throttles_its_spinning_while_the_governor_reports_a_core_taken(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from apiary.cloud.engine import LLMEngine

    monkeypatch.setattr(threads.STATE, "waits", "adaptive")
    before = torch.get_num_threads()
    try:
        engine = LLMEngine(EngineConfig(model_path=tiny_llama, kv_cache_bytes=1 << 20, num_threads=2))
        governor = engine.runner.governor
        governor.on_change(1)
        assert engine.runner.throttle.engaged
        governor.on_change(2)
        assert not engine.runner.throttle.engaged
    finally:
        torch.set_num_threads(before)


def test_adaptive_waits_named_in_the_environment_reach_a_fresh_engine(tiny_llama: Path) -> None:
    """APIARY_CPU_WAITS=adaptive in a fresh interpreter: torch loads spinning, the engine keeps a governor,
    numba's libgomp is left PASSIVE, and generation works with it."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME", "GOMP_SPINCOUNT")}
    env["APIARY_CPU_WAITS"] = "adaptive"
    code = ("import json, os; from apiary.cloud.engine import EngineConfig, LLMEngine, SamplingParams, threads; "
            "before = os.environ.get('OMP_WAIT_POLICY'); "
            f"e = LLMEngine(EngineConfig(model_path={str(tiny_llama)!r}, kv_cache_bytes=1 << 20, num_threads=2)); "
            "out = e.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True)); "
            "print(json.dumps([before, os.environ.get('OMP_WAIT_POLICY'), e.runner.governor is not None, "
            "len(out[0].output_token_ids), threads.report()]))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    before, after, governed, n, line = json.loads(done.stdout.splitlines()[-1])
    assert before is None and after == "PASSIVE" and governed and n == 4
    assert "APIARY_CPU_WAITS=adaptive" in line


@pytest.mark.parametrize(("dtype", "weights"), [("float32", "dtype"), ("bfloat16", "dtype"), ("auto", "int8")])
def test_engines_whose_projections_numba_runs_take_tbbs_pool(tiny_llama: Path, dtype: str, weights: str) -> None:
    """In a fresh interpreter: where numba runs the projections (int8 weights; bf16 ones through the vdpbf16ps
    kernel) the engine takes oneTBB's pool where the wheel is installed; where torch runs them (float32, or bf16
    through oneDNN on a CPU numba does not compile vdpbf16ps for) numba stays on libgomp."""
    import json
    import subprocess
    import sys

    from apiary.kernels import numba_threads, ops

    numba_projections = weights == "int8" or (dtype == "bfloat16" and ops.bf16_gemm_available()
                                             and cpu.native_bf16(cpu.host_flags()) is not None)
    if weights == "int8":
        from apiary.cloud.engine import int8

        if int8.gemm_choice().backend is None:
            pytest.skip(f"no fast int8 GEMM here: {int8.gemm_choice().reason}")
    elif not numba_projections:
        import ctypes.util

        if ctypes.util.find_library("tbb"):
            pytest.skip("a system libtbb is on the loader's path here: numba takes it without prepare()")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    code = ("import json; from apiary.cloud.engine import EngineConfig, LLMEngine, SamplingParams; "
            "from apiary.kernels import numba_threads; "
            f"e = LLMEngine(EngineConfig(model_path={str(tiny_llama)!r}, kv_cache_bytes=1 << 20, dtype={dtype!r}, "
            f"weights={weights!r})); "
            "out = e.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True)); "
            "print(json.dumps([numba_threads.layer(), len(out[0].output_token_ids)]))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    layer, n = json.loads(done.stdout.splitlines()[-1])
    want = "tbb" if numba_projections and numba_threads.tbb_library() is not None else "omp"
    assert layer == want and n == 3
