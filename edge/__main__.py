"""``python -m edge run --site S --device D …``: the same commands as ``apiary edge``."""
from __future__ import annotations

import typer

from edge.cli import register

app = typer.Typer(no_args_is_help=True, pretty_exceptions_show_locals=False)
register(app)

if __name__ == "__main__":
    app(prog_name="python -m edge")
