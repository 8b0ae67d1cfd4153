"""Shared helpers for benchmarks: percentiles, a results table, and the JSON record."""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any, Iterable

import numpy as np
from rich.console import Console
from rich.table import Table

RESULTS_DIR = Path("results") / "bench"


def percentile(values: Iterable[float], q: float) -> float:
    arr = np.asarray(list(values), dtype=float)
    return float(np.percentile(arr, q)) if arr.size else float("nan")


def machine_info() -> dict[str, Any]:
    import os

    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}


def report(name: str, title: str, columns: list[str], rows: list[list[Any]], extra: dict[str, Any] | None = None,
           out: Path | None = None) -> Path:
    """Print ``rows`` as a rich table and write them (plus ``extra``) as JSON; return the JSON path."""
    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*[f"{v:.3g}" if isinstance(v, float) else str(v) for v in r])
    Console().print(table)
    out = out or RESULTS_DIR / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"bench": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine_info(),
              "columns": columns, "rows": rows, **(extra or {})}
    out.write_text(json.dumps(record, indent=2, default=str))
    Console().print(f"wrote {out}")
    return out
