"""The matmul floor (bench.floor) and its columns in ``apiary bench engine``."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import typer
from typer.testing import CliRunner

from apiary.bench import engine as bench_engine
from apiary.bench import floor

SMOLLM2_135M = SimpleNamespace(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                               num_kv_heads=3, head_dim=64)


def test_flops_per_token_count_every_projection_once() -> None:
    body, head = floor.flops_per_token(SMOLLM2_135M)
    per_layer = 576 * (9 + 6) * 64 + 576 * 576 + 576 * 2 * 1536 + 1536 * 576  # q/k/v, o, gate/up, down
    assert body == 2 * 30 * per_layer
    assert head == 2 * 49152 * 576
    assert round((body + head) / 1e9, 2) == 0.27  # the issue's ~0.27 GFLOP per token


def test_the_head_runs_once_per_generated_token_and_the_body_for_every_position() -> None:
    body, head = floor.flops_per_token(SMOLLM2_135M)
    # two requests: prompts of 10 and 20 tokens, 5 outputs each: the body sees 30 + 10 - 2 positions
    assert floor.workload_flops(SMOLLM2_135M, 30, 10, 2) == body * 38 + head * 10


def test_the_measured_rate_is_a_positive_number_of_gflops() -> None:
    assert floor.matmul_gflops(SMOLLM2_135M, torch.float32, seconds=0.2) > 0


@pytest.mark.timeout(300)
def test_bench_engine_prints_each_engine_systems_floor_and_fraction(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.cloud.engine.tiny import make_checkpoint

    model = make_checkpoint(tmp_path / "tiny", "llama")
    monkeypatch.chdir(tmp_path)
    app = typer.Typer()
    app.command()(bench_engine.command)
    result = CliRunner().invoke(app, ["--model", str(model), "--systems", "engine,engine-fp32", "--requests", "3",
                                      "--prompt-tokens", "8-16", "--output-tokens", "4-8", "--threads", "1",
                                      "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "results" / "bench" / "engine.json").read_text())
    assert record["columns"][-2:] == ["matmul floor s", "% of floor"]
    for row in record["rows"]:
        got = record["matmul_floor"][row[0]]
        assert got["dtype"] == "float32" and got["gflops"] > 0 and got["seconds"] > 0
        assert row[-1].endswith("%")
