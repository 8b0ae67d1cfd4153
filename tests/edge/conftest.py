"""Edge fixtures: one llama.cpp model shared by the real-model tests (loading is cheap, KV reuse is not)."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def local_model(gguf_path: Path):
    from edge.model import LocalModel

    # One thread: on a shared 2-core machine two llama.cpp threads spin on each other's barriers.
    model = LocalModel(gguf_path, n_ctx=2048, threads=1)
    yield model
    model.close()


@pytest.fixture(scope="session")
def ggufs(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> dict[str, Path]:
    """Tiny GGUFs without, with and with an unknown apiary.prompt_style (``helpers.export_styled_ggufs``)."""
    from tests.edge.helpers import export_styled_ggufs

    return export_styled_ggufs(tmp_path_factory.mktemp("styles"), gguf_path)
