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


def test_cgroup_limit_reads_v2_then_v1(tmp_path: Path) -> None:
    assert threads.cgroup_cpu_limit(tmp_path) is None  # neither file: no limit known
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.cgroup_cpu_limit(tmp_path) == 3.0
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert threads.cgroup_cpu_limit(tmp_path) == 1.0
    (tmp_path / "cpu.max").write_text("garbage\n")
    assert threads.cgroup_cpu_limit(tmp_path) is None


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
    assert state.set_by_engine == env and not state.late
    assert "OMP_WAIT_POLICY=PASSIVE (set by the engine)" in threads.report(state)
    mine = {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "1"}
    state = threads.configure_environment(mine, cpus=3, loaded={"torch": object()})
    assert mine["OMP_WAIT_POLICY"] == "ACTIVE" and mine["OMP_NUM_THREADS"] == "1" and mine["NUMBA_NUM_THREADS"] == "3"
    assert state.from_environment == {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "1"}
    line = threads.report(state)
    assert "OMP_WAIT_POLICY=ACTIVE (set by the environment)" in line and "torch was imported before" in line


def test_importing_the_engine_sets_the_policy_before_torch_and_numba_load() -> None:
    """In a fresh interpreter: ``import apiary.cloud.engine`` sets the env before its own torch/numba imports."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME", "OMP_NUM_THREADS",
                                                           "NUMBA_NUM_THREADS")}
    code = ("import json, os, torch, numba; from apiary.cloud.engine import threads; "
            "print(json.dumps([threads.STATE.late, os.environ['OMP_WAIT_POLICY'], os.environ['OMP_NUM_THREADS'], "
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
