"""CPU GEMMs on a model's projection shapes: oneDNN bf16, our bf16 and int8 kernels, float32, at decode and prompt rows.

Why: a CPU decode step is mostly its projections, and which GEMM runs them is chosen per host (the engine's
``Linear``, ``int8.gemm_choice``). This times each available one on the model's four projections (q/k/v, o,
gate/up, down) for ``--layers`` layers of distinct random weights, so the weights come from memory as in a
decode step, with the engine's threads (numba on oneTBB's pool where it is installed). Systems alternate
within every repeat, so background load hits them alike; the median of the repeats is reported. Each
system's output is also checked against a float64 product of the same operands (its relative error).

Systems (where they run): ``onednn-bf16`` (the weight prepacked, ``cloud.engine.linear``'s fallback),
``bf16-kernel`` (``kernels/cpu_bf16_gemm.py``), ``int8-grouped`` (``kernels/cpu_int8_gemm.py``, bf16
activations as the int8 engine on a bf16 host), ``fp32`` (``F.linear``).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable

import typer

SYSTEMS = ("onednn-bf16", "bf16-kernel", "int8-grouped", "fp32")


def _systems(weights: list[list[Any]], wanted: list[str]) -> dict[str, tuple[list[list[Callable]], Any, int]]:
    """Per available system: per layer, one call per projection of ``weights`` (float32, per layer); the
    activations' dtype; bytes of weights per layer."""
    import torch
    import torch.nn.functional as F

    from apiary.cloud.engine.linear import _pack
    from apiary.kernels import ops

    params = sum(w.numel() for w in weights[0])
    found: dict[str, tuple[list[list[Callable]], Any, int]] = {}
    for name in wanted:
        if name == "onednn-bf16":
            packed = [[_pack(w.bfloat16(), None, None) for w in layer] for layer in weights]
            if any(p is None for layer in packed for p in layer):
                continue  # no native bf16 or no oneDNN packing here

            def onednn(p: Any) -> Callable:
                return lambda x: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

            found[name] = ([[onednn(p) for p in layer] for layer in packed], torch.bfloat16, 2 * params)
        elif name == "bf16-kernel":
            bound = [[ops.bind_bf16_linear(w.bfloat16()) for w in layer] for layer in weights]
            if any(b is None for layer in bound for b in layer):
                continue
            found[name] = (bound, torch.bfloat16, 2 * params)  # type: ignore[assignment]
        elif name == "int8-grouped":
            if not ops.grouped_int8_available():
                continue
            found[name] = ([[ops.bind_grouped_int8(ops.pack_grouped_int8(w)) for w in layer] for layer in weights],
                           torch.bfloat16, params)
        elif name == "fp32":

            def plain(w: Any) -> Callable:
                return lambda x: F.linear(x, w)

            found[name] = ([[plain(w) for w in layer] for layer in weights], torch.float32, 4 * params)
    return found


def command(
    rows: str = typer.Option("1,4,16,64,384", help="rows per call (decode batch sizes, prompt chunk sizes)"),
    layers: int = typer.Option(30, help="layers of distinct weights per timed pass"),
    repeats: int = typer.Option(5, help="timed passes per system and row count (the median is reported)"),
    systems: str = typer.Option(",".join(SYSTEMS), help=f"comma-separated, of: {', '.join(SYSTEMS)}"),
    threads: int = typer.Option(0, help="torch/numba threads (0: the engine's choice for this host)"),
    model: str = typer.Option("", help="GGUF or HF folder whose shapes to use; default: the smollm2-135m-q4 asset"),
    out: Path = typer.Option(None, help="JSON path (default results/bench/gemm.json)"),
) -> None:
    # The engine's thread settings first: they must reach torch's OpenMP runtime before it loads (waits as the
    # engine's; with torch's threads spinning between calls, numba's kernels measured up to 1.5x slower here).
    from apiary.cloud.engine import threads as engine_threads

    import torch

    from apiary.bench.common import report
    from apiary.bench.floor import projection_shapes
    from apiary.cloud.engine.loader import load_checkpoint
    from apiary.shared import assets

    wanted = [s.strip() for s in systems.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SYSTEMS))
    if unknown:
        raise typer.BadParameter(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    counts = sorted({int(r) for r in rows.split(",") if r.strip()})
    if not counts or counts[0] < 1 or layers < 1 or repeats < 1:
        raise typer.BadParameter("rows, layers and repeats must be >= 1")
    mc = load_checkpoint(Path(model) if model else assets.ensure("smollm2-135m-q4")).config
    engine_threads.apply(threads or None, numba_on_tbb=True)
    shapes = projection_shapes(mc)
    g = torch.Generator().manual_seed(0)
    weights = [[torch.randn(o, i, generator=g) / i ** 0.5 for i, o in shapes] for _ in range(layers)]
    found = _systems(weights, wanted)
    flops_per_row = 2.0 * layers * sum(i * o for i, o in shapes)
    table: list[list[Any]] = []
    with torch.inference_mode():
        for m in counts:
            inputs = {i: torch.randn(m, i, generator=g) for i, _ in shapes}
            errors = {}
            for name, (calls, dtype, _) in found.items():  # first pass: warm-up and the check against float64
                worst = 0.0
                for (i, _), w, call in zip(shapes, weights[0], calls[0]):
                    x = inputs[i].to(dtype)
                    # the operands as held (bf16 rounded); int8's own quantization error counts
                    exact = x.double() @ w.to(dtype).double().t()
                    worst = max(worst, float(((call(x).double() - exact).norm() / exact.norm())))
                errors[name] = worst
            times: dict[str, list[float]] = {name: [] for name in found}
            for _ in range(repeats):
                for name, (calls, dtype, _) in found.items():
                    xs = [inputs[i].to(dtype) for i, _ in shapes]
                    start = time.perf_counter()
                    for layer in calls:
                        for call, x in zip(layer, xs):
                            call(x)
                    times[name].append(time.perf_counter() - start)
            base = statistics.median(times["onednn-bf16"]) if "onednn-bf16" in times else None
            for name, (_, _, nbytes) in found.items():
                t = statistics.median(times[name])
                table.append([m, name, round(t * 1e3, 2), round(base / t, 2) if base else "-",
                              round(layers * nbytes / t / 1e9, 1), round(m * flops_per_row / t / 1e9),
                              f"{errors[name]:.1e}"])
    report("gemm", f"CPU GEMMs on {layers} layers of {Path(str(model or 'smollm2-135m-q4')).name}'s projections "
           f"({engine_threads.STATE.threads} threads)",
           ["rows", "system", "ms", "x onednn-bf16", "weights GB/s", "GFLOP/s", "rel. error vs float64"], table,
           {"layers": layers, "repeats": repeats, "shapes": shapes, "systems": list(found),
            "engine_threads": engine_threads.report()}, out=out)
    typer.echo(f"threads: {engine_threads.report()}")

