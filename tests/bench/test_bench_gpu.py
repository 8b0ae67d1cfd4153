"""``apiary bench gpu``: its plan, plumbing and report, rehearsed on CPU (the CUDA calls are the only part left out)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from apiary.bench import gpu

pytestmark = pytest.mark.timeout(600)


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "apiary", "bench", "gpu", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=580)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without CUDA")
def test_it_refuses_without_a_gpu_and_names_the_rehearsal(tmp_path: Path) -> None:
    done = run_cli(cwd=tmp_path)
    assert done.returncode == 2 and "--rehearse" in done.stderr


def test_a_rehearsal_runs_every_step_and_writes_one_record(tmp_path: Path) -> None:
    done = run_cli("--rehearse", "--out", "check", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    record = json.loads((tmp_path / "results" / "bench" / "gpu-rehearsal.json").read_text())
    steps = {s["name"]: s for s in record["steps"]}
    assert [s["name"] for s in record["steps"]] == ["tests", "kernels"]
    assert steps["tests"]["status"] == "ok" and steps["tests"]["result"]["passed"] > 0
    assert steps["tests"]["result"]["failed"] == 0
    assert steps["kernels"]["status"] == "ok" and steps["kernels"]["result"]["mode"] == "rehearsal"
    assert steps["kernels"]["result"]["kernels"] >= 5 and steps["kernels"]["result"]["max_diff"] <= gpu.SMOKE_MAX_DIFF
    assert [row[-1] for row in record["rows"]] == ["yes", "yes"]
    assert (tmp_path / "check" / "tests.log").exists() and (tmp_path / "check" / "kernels.log").exists()


def test_a_step_past_the_budget_is_killed_and_the_rest_skipped_yet_reported(tmp_path: Path) -> None:
    steps = [gpu.Step("tests", [sys.executable, "-c", "import time; time.sleep(60)"], 60.0),
             gpu.Step("kernels", [sys.executable, "-c", "print('never')"], 60.0)]
    gpu.run_steps(steps, tmp_path, budget_s=6.0)
    assert steps[0].status.startswith("timeout") and steps[0].result == {}
    assert steps[1].status == "skipped (budget spent)"
    assert [row[-1] for row in gpu.verdicts(steps)] == ["no", "no"]


def test_a_measurement_is_judged_against_the_issue_targets() -> None:
    columns = ["kernel", "shape", "triton ms", "torch ms", "speedup", "triton GB/s", "% peak", "% copy", "TFLOP/s",
               "max |diff|"]
    rows = [["decode attention", "B64 ctx 2048", 1, 2, 2, 3900.0, "81%", "95%", "-", "1e-3"],
            ["decode attention", "B64 ctx ragged", 1, 2, 2, 3000.0, "62%", "80%", "-", "1e-3"],
            ["d2d copy", "same bytes", "-", "-", "-", 4100.0, "85%", "100%", "-", "-"]]
    record = {"columns": columns, "rows": rows, "device": "NVIDIA H200", "peak_gbs": 4800.0,
              "engine": {"triton_tok_s": 31000.0, "batch": 256}}
    summary = gpu.kernel_summary(record)
    assert summary["decode_peak_fraction_best"] == 0.81 and summary["decode_peak_fraction_worst"] == 0.62
    step = gpu.Step("kernels", [], 1.0, status="ok", result=summary)
    assert gpu.verdicts([step])[0][-1] == "yes"
    step.result = {**summary, "engine_tok_s": 12000.0}
    assert gpu.verdicts([step])[0][-1] == "no"


@pytest.mark.parametrize("rehearse", [True, False])
def test_the_test_step_runs_in_one_process_not_on_xdist_workers(tmp_path: Path, rehearse: bool) -> None:
    """pyproject's addopts spread pytest over workers; on the GPU that would be one CUDA context and one
    Triton compile per worker, so the step asks for ``-n 0``."""
    argv = gpu.plan(tmp_path, rehearse=rehearse, engine_batch=8, iters=2, model="")[0].argv
    assert argv[argv.index("-n") + 1] == "0"
