"""`apiary bench …`: every benchmark module in bench/ that defines ``command`` becomes a subcommand.

Benchmark modules import their heavy dependencies inside ``command`` so that the
CLI starts fast. Each benchmark prints a table and writes JSON under results/bench/.
"""
from __future__ import annotations

import importlib
import pkgutil

import typer

from apiary import bench


def register(app: typer.Typer) -> None:
    bench_app = typer.Typer(help="Benchmarks: print a table and write JSON to results/bench/.", no_args_is_help=True)
    found = 0
    for info in sorted(pkgutil.iter_modules(bench.__path__), key=lambda i: i.name):
        if info.name in {"cli", "common"}:
            continue
        module = importlib.import_module(f"apiary.bench.{info.name}")
        if hasattr(module, "command"):
            bench_app.command(info.name, help=(module.__doc__ or "").strip().splitlines()[0])(module.command)
            found += 1
    if found:
        app.add_typer(bench_app, name="bench")
