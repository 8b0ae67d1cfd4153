"""``python -m edge run --site S --device D …``: the same commands as ``apiary edge``."""
from __future__ import annotations

from edge.cli import edge_app

if __name__ == "__main__":
    edge_app()(prog_name="python -m edge")
