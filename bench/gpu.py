"""One-shot GPU check: the CUDA tests, kernel bandwidth vs the device's peak and engine decode, in one budget.

A GPU is lent to this project rarely and briefly (15 minutes of device time in all, start-up
included), so everything worth knowing on one is gathered by a single command that fits in
about 8 minutes and leaves one JSON and one table behind, whatever fails on the way:

1. ``tests``: the CUDA variants of the kernel tests and the engine's CUDA tests (pytest, JUnit XML);
2. ``kernels``: ``apiary bench kernels`` (paged decode attention's achieved HBM bandwidth vs peak,
   prefill attention, the small kernels) and its end-to-end engine run at ``--engine-batch``.

Each step runs in its own process with its own time limit, cut to what is left of ``--budget-s``,
so a hung CUDA call costs one step, not the run. ``--rehearse`` runs the same plan on a CPU
(the Triton interpreter's correctness smoke instead of the measurement; no numbers that mean
anything), so the plan, the plumbing and the report are tested on machines without a GPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

ROOT = Path(__file__).resolve().parents[1]
DECODE_PEAK_TARGET = 0.80  # decode attention's share of the device's HBM peak (issue 21)
ENGINE_TOK_S_TARGET = 30_000.0  # engine decode, SmolLM2-135M at batch 256 (issue 21)
SMOKE_MAX_DIFF = 0.125  # the CPU rehearsal's bf16 smoke: two bf16 ulps of values below 16


@dataclass(slots=True)
class Step:
    """One part of the check: a command, the limit it gets, and what it leaves in its folder."""

    name: str
    argv: list[str]
    limit_s: float
    status: str = "not run"  # ok | failed (rc N) | timeout | skipped (why)
    seconds: float = 0.0
    result: dict[str, Any] = field(default_factory=dict)


# The test step runs in one process, not on pyproject's xdist workers: one GPU, one CUDA context and one
# Triton compile per kernel instead of one per worker, inside a budget of minutes.
IN_PROCESS = ("-n", "0")
# Where the CUDA tests live (named by file: the rest of tests/cloud/engine needs the cloud extra's web stack).
CUDA_TESTS = (str(ROOT / "tests" / "kernels"), str(ROOT / "tests" / "cloud" / "engine" / "test_cuda_graphs.py"))


def plan(folder: Path, *, rehearse: bool, engine_batch: int, iters: int, model: str) -> list[Step]:
    """The steps in order; ``rehearse`` swaps CUDA work for its CPU stand-ins."""
    junit = folder / "tests.xml"
    py = sys.executable
    if rehearse:
        tests = [py, "-m", "pytest", str(ROOT / "tests" / "kernels" / "test_ops.py"), "-q", "-p", "no:cacheprovider",
                 *IN_PROCESS, f"--junitxml={junit}"]
        kernels = [py, "-m", "apiary", "bench", "kernels", "--device", "cpu", "--interpret"]
    else:
        # Not the real-model tests (marked slow): the model file cannot travel to an offline GPU host.
        tests = [py, "-m", "pytest", *CUDA_TESTS, "-q", "-p", "no:cacheprovider", *IN_PROCESS, "-k", "cuda", "-m",
                 "not slow", f"--junitxml={junit}"]
        kernels = [py, "-m", "apiary", "bench", "kernels", "--iters", str(iters), "--engine-batch",
                   str(engine_batch), "--engine-prompt", "128", "--engine-tokens", "128",
                   *(["--model", model] if model else [])]
    return [Step("tests", tests, 180.0), Step("kernels", kernels, 300.0)]


def run_steps(steps: list[Step], folder: Path, budget_s: float) -> None:
    """Run each step in ``folder`` (its JSON lands under folder/results/bench) within what is left of the budget."""
    start = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for step in steps:
        left = budget_s - (time.monotonic() - start)
        if left < 5:
            step.status = "skipped (budget spent)"
            continue
        limit = min(step.limit_s, left)
        log = folder / f"{step.name}.log"
        t0 = time.monotonic()
        with log.open("w") as out:
            proc = subprocess.Popen(step.argv, cwd=folder, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
                step.status = "ok" if rc == 0 else f"failed (rc {rc})"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                step.status = f"timeout ({limit:.0f} s)"
        step.seconds = round(time.monotonic() - t0, 1)
        step.result = read_result(step.name, folder)
        typer.echo(f"{step.name}: {step.status} in {step.seconds} s (log {log})")


def read_result(name: str, folder: Path) -> dict[str, Any]:
    """What a finished (or killed) step left behind, summarised; {} when it left nothing."""
    if name == "tests":
        junit = folder / "tests.xml"
        if not junit.exists():
            return {}
        root = ET.parse(junit).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        total, failed, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        return {"passed": total - failed - errors - skipped, "failed": failed + errors, "skipped": skipped}
    bench = folder / "results" / "bench"
    for candidate in ("kernels.json", "kernels-cpu-smoke.json"):
        if (bench / candidate).exists():
            return kernel_summary(json.loads((bench / candidate).read_text()))
    return {}


def _fraction(cell: Any) -> float | None:
    return float(cell.rstrip("%")) / 100 if isinstance(cell, str) and cell.endswith("%") else None


def kernel_summary(record: dict[str, Any]) -> dict[str, Any]:
    """The figures the targets are about, from ``apiary bench kernels``' JSON (measurement or CPU smoke)."""
    columns, rows = record["columns"], record["rows"]
    if record.get("mode") == "cpu-interpret-smoke":
        diff = columns.index("max |triton - torch|")
        return {"mode": "rehearsal", "kernels": len(rows), "max_diff": max(float(r[diff]) for r in rows)}
    peak = columns.index("% peak")
    decode = [f for r in rows if r[0] == "decode attention" and (f := _fraction(r[peak])) is not None]
    engine = record.get("engine", {})
    return {"mode": "measurement", "device": record.get("device"), "peak_gbs": record.get("peak_gbs"),
            "decode_peak_fraction_best": max(decode) if decode else None,
            "decode_peak_fraction_worst": min(decode) if decode else None,
            # the target is decode's rate; records from before decode was timed on its own carry e2e only
            "engine_tok_s": engine.get("triton_decode_tok_s", engine.get("triton_tok_s")),
            "engine_e2e_tok_s": engine.get("triton_tok_s"), "engine_eager_decode_tok_s": engine.get(
                "eager_decode_tok_s"), "engine_batch": engine.get("batch"), "stand_in_of": engine.get("stand_in_of"),
            "engine_note": engine.get("skipped") or engine.get("failed")}


def verdicts(steps: list[Step]) -> list[list[Any]]:
    """One table row per step: what it found against its target."""
    rows = []
    for step in steps:
        r = step.result
        if step.name == "tests":
            found = f"{r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped" if r else "-"
            target, met = "all pass", (bool(r) and r["failed"] == 0 and r["passed"] > 0)
        elif r.get("mode") == "rehearsal":
            found = f"{r['kernels']} kernels, max |diff| {r['max_diff']:.1e}"
            target, met = f"<= {SMOKE_MAX_DIFF} (bf16 smoke)", r["max_diff"] <= SMOKE_MAX_DIFF
        elif r:
            best = r["decode_peak_fraction_best"]
            found = f"decode attention {best:.0%} of {r['peak_gbs']} GB/s" if best is not None else "no decode row"
            if r["engine_tok_s"]:
                found += f"; engine decode {r['engine_tok_s']:.0f} tok/s at batch {r['engine_batch']}"
                if r.get("engine_eager_decode_tok_s"):
                    found += f" ({r['engine_eager_decode_tok_s']:.0f} without CUDA graphs)"
                if r.get("stand_in_of"):
                    found += f", stand-in of {r['stand_in_of']}"
            if r["engine_note"]:
                found += f"; engine: {r['engine_note']}"
            target = f">= {DECODE_PEAK_TARGET:.0%} of peak; >= {ENGINE_TOK_S_TARGET:.0f} tok/s"
            met = best is not None and best >= DECODE_PEAK_TARGET and (r["engine_tok_s"] or 0) >= ENGINE_TOK_S_TARGET
        else:
            found, target, met = "-", "-", False
        rows.append([step.name, step.status, step.seconds, found, target, "yes" if met else "no"])
    return rows


def command(
    budget_s: float = typer.Option(480.0, help="wall-clock budget for all steps (8 min leaves room in a 15-min lease)"),
    rehearse: bool = typer.Option(False, help="run the plan on CPU (interpreter smoke, no measurement) to test it"),
    engine_batch: int = typer.Option(256, help="concurrent requests of the engine decode run"),
    iters: int = typer.Option(20, help="timed calls per kernel measurement"),
    model: str = typer.Option("", help="engine model (GGUF/HF path); default: the cached smollm2-135m-q4 asset"),
    stand_in: Path = typer.Option(None, help="engine model: a folder from `apiary bench stand_in` (config and "
                                             "tokenizer); its random weights are made here if it has none"),
    out: Path = typer.Option(Path("results") / "gpu-check", help="folder for logs, JUnit XML and the JSON"),
) -> None:
    import torch

    from apiary.bench.common import RESULTS_DIR, report

    if not rehearse and not torch.cuda.is_available():
        typer.echo("apiary bench gpu needs a CUDA GPU (none is visible here); --rehearse runs its plan on CPU.",
                   err=True)
        raise typer.Exit(2)
    if stand_in is not None and not (stand_in / "config.json").is_file():
        typer.echo(f"--stand-in {stand_in} has no config.json: write one with `apiary bench stand_in {stand_in}` on "
                   "a host that has the model", err=True)
        raise typer.Exit(2)
    out.mkdir(parents=True, exist_ok=True)
    if stand_in is not None:
        from apiary.bench.stand_in import fill_weights

        fill_weights(stand_in)
        model = str(stand_in.resolve())
    steps = plan(out.resolve(), rehearse=rehearse, engine_batch=engine_batch, iters=iters, model=model)
    typer.echo("plan: " + "; ".join(f"{s.name} (up to {s.limit_s:.0f} s)" for s in steps) + f"; budget {budget_s:.0f} s")
    run_steps(steps, out.resolve(), budget_s)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (rehearsal: not a measurement)"
    rows = verdicts(steps)
    report("gpu", f"One-shot GPU check on {device}", ["step", "status", "seconds", "found", "target", "met"], rows,
           {"device": device, "rehearsal": rehearse, "budget_s": budget_s,
            "steps": [{"name": s.name, "argv": s.argv, "status": s.status, "seconds": s.seconds, "result": s.result}
                      for s in steps]}, out=RESULTS_DIR / ("gpu-rehearsal.json" if rehearse else "gpu.json"))
