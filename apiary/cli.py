"""The `apiary` command: one front door that mounts each room's commands.

Each room (shared, edge, cloud, firmware_bridge, deploy, bench) that has commands
keeps them in its own ``<room>/cli.py`` with a ``register(app)`` function, so the
rooms stay independent and heavy imports (torch, llama.cpp) happen only inside the
command that needs them.
"""
from __future__ import annotations

import importlib

import typer

ROOMS = ("apiary.shared", "apiary.firmware_bridge", "apiary.edge", "apiary.cloud", "apiary.deploy", "apiary.bench",
         "apiary.demo")

app = typer.Typer(
    help="Apiary Mesh: edge-to-cloud LLM inference for field sensor networks.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    rich_markup_mode=None,  # help texts say "[mqtt]" and "[default: …]" literally; no markup
)

for room in ROOMS:
    module_name = room if room == "apiary.demo" else f"{room}.cli"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:  # a real import error inside the room: surface it
            raise
        continue
    module.register(app)
