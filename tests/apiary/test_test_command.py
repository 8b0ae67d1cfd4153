"""The README's test command runs the suite on pytest-xdist workers sized from the CPUs and memory there."""
from __future__ import annotations

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
