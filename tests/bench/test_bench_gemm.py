"""``apiary bench gemm``: every GEMM this host runs, timed and checked against a float64 product.

No timing thresholds: what is checked is that each system that runs here is in the table, with its
rows, times and an error that says it computed the product (bf16 operands within bf16 rounding, int8
within its quantization), and that the JSON names the CPU's features.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from apiary.bench import gemm as bench_gemm
from apiary.kernels import cpu, ops


def _expected_systems() -> list[str]:
    from apiary.cloud.engine.linear import _pack

    native = cpu.native_bf16(cpu.host_flags()) is not None
    wanted = ["onednn-bf16"] if _pack(torch.randn(16, 32).bfloat16(), None, None) is not None else []
    if native and ops.bf16_gemm_available():
        wanted.append("bf16-kernel")
    if ops.grouped_int8_available():
        wanted.append("int8-grouped")
    return [*wanted, "fp32"]


@pytest.mark.timeout(300)
def test_each_gemm_here_is_timed_and_computes_the_product(tmp_path: Path) -> None:
    from tests.cloud.engine.tiny import make_checkpoint

    model = make_checkpoint(tmp_path / "tiny", "llama")
    app = typer.Typer()
    app.command()(bench_gemm.command)
    out = tmp_path / "gemm.json"
    result = CliRunner().invoke(app, ["--model", str(model), "--rows", "1,5", "--layers", "2", "--repeats", "1",
                                      "--threads", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    systems = _expected_systems()
    assert record["systems"] == systems
    assert [(r[0], r[1]) for r in record["rows"]] == [(m, s) for m in (1, 5) for s in systems]
    for rows, system, ms, _, _, _, error in record["rows"]:
        assert ms > 0
        bound = {"fp32": 1e-6, "int8-grouped": 5e-2}.get(system, 1e-2)  # bf16: one rounding of each output
        assert float(error) < bound, (system, error)
    assert record["machine"]["cpu_features"] == cpu.relevant(cpu.host_flags()) and "features:" in result.output


def test_unknown_systems_and_bad_counts_are_refused() -> None:
    app = typer.Typer()
    app.command()(bench_gemm.command)
    result = CliRunner().invoke(app, ["--systems", "fp32,mkl"])
    assert result.exit_code != 0 and "unknown systems ['mkl']" in result.output
    result = CliRunner().invoke(app, ["--rows", "0"])
    assert result.exit_code != 0 and "must be >= 1" in result.output
