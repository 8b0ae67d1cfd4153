"""Shared helpers for benchmarks: percentiles, a results table, and the JSON record.

Every table says which CPU it ran on (model, speed-relevant features, CPUs, load average): these
machines change from AVX-512 + bf16 one day to AVX2 only the next, and a number means little
without them (``apiary.kernels.cpu``).
"""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any, Iterable

import numpy as np
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

RESULTS_DIR = Path("results") / "bench"


def percentile(values: Iterable[float], q: float) -> float:
    arr = np.asarray(list(values), dtype=float)
    return float(np.percentile(arr, q)) if arr.size else float("nan")


def machine_info() -> dict[str, Any]:
    import os

    from apiary.kernels import cpu, huge_pages, numba_threads

    flags = cpu.host_flags()
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "cpu_model": cpu.host_model_name(), "cpu_features": cpu.relevant(flags),
            "bf16": f"native ({cpu.native_bf16(flags)})" if cpu.native_bf16(flags) else "emulated",
            "numba_pool": numba_threads.describe(), "huge_pages": huge_pages.thp_mode(),
            "load_average": [round(x, 2) for x in os.getloadavg()], "cpu_hidden": os.environ.get(cpu.HIDE_ENV, "")}


def machine_line(info: dict[str, Any]) -> str:
    """The line printed under every table: CPU model, features, bf16, CPUs, numba's pool, the kernel's transparent
    huge page mode (the streamed weights and the KV pool ask for 2 MiB pages: ``kernels.huge_pages``) and load
    average."""
    load = "/".join(f"{x:.2f}" for x in info["load_average"])
    pool = info.get("numba_pool", "unknown").split(" (")[0]
    hidden = f" (hiding {info['cpu_hidden']}: a rehearsal)" if info.get("cpu_hidden") else ""
    return (f"CPU: {info['cpu_model']}, {info['cpus']} CPUs; features: {' '.join(info['cpu_features']) or 'none found'}"
            f"{hidden}; "
            f"bf16 {info['bf16']}; numba kernels on {pool}; transparent huge pages {info.get('huge_pages', 'unknown')}; "
            f"load average {load}")


def report(name: str, title: str, columns: list[str], rows: list[list[Any]], extra: dict[str, Any] | None = None,
           out: Path | None = None) -> Path:
    """Print ``rows`` as a rich table and write them (plus ``extra``) as JSON; return the JSON path."""
    machine = machine_info()
    table = Table(title=title, caption=machine_line(machine))
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*[f"{v:.3g}" if isinstance(v, float) else str(v) for v in r])
    # As wide as the table needs (bench engine has 13 columns): rich squeezes cells to "…" or to nothing
    # at its default 80 columns when stdout is a pipe or a narrow terminal.
    console = Console()
    console.width = max(console.width, Measurement.get(console, console.options.update_width(10_000), table).maximum)
    console.print(table)
    out = out or RESULTS_DIR / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"bench": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine,
              "columns": columns, "rows": rows, **(extra or {})}
    out.write_text(json.dumps(record, indent=2, default=str))
    Console().print(f"wrote {out}")
    return out
