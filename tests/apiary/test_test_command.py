"""The README's test command runs the suite on pytest-xdist workers sized from the CPUs and memory there."""
from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.conftest import MAX_WORKERS, WORKER_MEMORY, xdist_workers

ROOT = Path(__file__).resolve().parents[2]


def test_workers_follow_the_usable_cpus_capped_by_count_and_memory() -> None:
    assert xdist_workers(1, None) == 1
    assert xdist_workers(2, 24 << 30) == 2
    assert xdist_workers(0, None) == 1
    assert xdist_workers(64, 1 << 40) == MAX_WORKERS
    assert xdist_workers(8, WORKER_MEMORY + (1 << 30)) == 1  # memory for one worker only
    assert xdist_workers(8, 1 << 20) == 1  # never zero


def test_the_suite_runs_distributed_by_file() -> None:
    """``-n auto`` asks the hook above; ``loadfile`` keeps each module's expensive fixtures on one worker."""
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"].split()
    assert addopts[addopts.index("-n") + 1] == "auto"
    assert addopts[addopts.index("--dist") + 1] == "loadfile"


def test_the_avx2_rehearsal_holds_every_cpu_choice_to_avx2() -> None:
    """``.ci/avx2-rehearsal CMD`` runs CMD as on an AVX2-only host: our flags, torch's kernels, oneDNN's ISA and
    numba's code generation all without AVX-512, so the engine picks float32 and numba's AVX2 kernels."""
    code = ("import json, os, torch; from apiary.kernels import cpu, cpu_bf16_gemm, cpu_int8_gemm; from apiary.bench "
            "import common; print(json.dumps({'flags': cpu.relevant(cpu.host_flags()), 'aten': "
            "torch.backends.cpu.get_cpu_capability(), 'onednn': os.environ['ONEDNN_MAX_CPU_ISA'], 'bf16_gemm': "
            "cpu_bf16_gemm.available(), 'int8': cpu_int8_gemm.runnable(), 'line': common.machine_line("
            "common.machine_info())}))")
    done = subprocess.run([str(ROOT / ".ci" / "avx2-rehearsal"), sys.executable, "-c", code], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert not any(f.startswith(("avx512", "amx")) for f in seen["flags"])
    assert seen["aten"] in ("AVX2", "DEFAULT") and seen["onednn"] == "AVX2"
    assert seen["bf16_gemm"] is False and "avx512_vnni" not in seen["int8"]
    assert "a rehearsal" in seen["line"] and "transparent huge pages " in seen["line"]
