"""``apiary bench kernels``: the GPU benchmark's exact code path, run on tiny shapes in the interpreter.

The GPU this benchmark is written for is not always at hand, so its measuring code is exercised
here (numbers meaningless) to make sure it runs end to end and that the Triton and torch outputs
it compares agree. Also: it refuses plainly on a machine without CUDA.
"""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from apiary.bench import kernels as bench_kernels


def test_peak_bandwidth_from_device_name():
    assert bench_kernels.device_peak_gbs("NVIDIA H200") == 4800.0
    assert bench_kernels.device_peak_gbs("NVIDIA H100 80GB HBM3") == 3350.0
    assert bench_kernels.device_peak_gbs("NVIDIA H100 PCIe") == 2000.0
    assert bench_kernels.device_peak_gbs("NVIDIA GH200 480GB") == 4000.0
    assert bench_kernels.device_peak_gbs("Some Future GPU") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without CUDA")
def test_refuses_without_cuda():
    import typer

    app = typer.Typer()
    app.command()(bench_kernels.command)
    result = CliRunner().invoke(app, [])
    assert result.exit_code == 2
    assert "needs a CUDA GPU" in result.output


@pytest.mark.timeout(300)
def test_measure_runs_end_to_end_on_tiny_shapes(device, tmp_path):
    if device == "cuda":
        pytest.skip("on a GPU run the real benchmark: apiary bench kernels")
    out = tmp_path / "kernels.json"
    result = bench_kernels.measure(batch=2, contexts=[40], num_heads=4, num_kv_heads=2, head_dim=32,
                                   block_size=16, dtype=torch.float32, iters=1, peak_gbs=1000.0, engine=False,
                                   model="", engine_batch=0, engine_prompt=0, engine_tokens=0, tokens=8,
                                   prefill_len=16, device="cpu", out=out)
    kernels = [row[0] for row in result["rows"]]
    assert kernels.count("decode attention") == 2 and kernels.count("prefill attention") == 2
    assert {"d2d copy", "rms_norm + residual", "rotary q+k", "write_kv"} <= set(kernels)
    for row in result["rows"]:
        if row[-1] != "-":
            assert float(row[-1]) < 1e-4, row  # Triton and torch agree (fp32)
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(result["rows"]))
