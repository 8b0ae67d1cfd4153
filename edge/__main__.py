"""``python -m apiary.edge run --site S --device D …``: the same commands as ``apiary edge``."""
from __future__ import annotations

from apiary.edge.cli import edge_app

if __name__ == "__main__":
    edge_app()(prog_name="python -m apiary.edge")
