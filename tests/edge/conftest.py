"""Edge fixtures: one llama.cpp model shared by the real-model tests (loading is cheap, KV reuse is not), the
shipped student, and an HTTP server for OTA images."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.edge.helpers import FileServer


@pytest.fixture(scope="session")
def local_model(gguf_path: Path):
    from apiary.edge.model import LocalModel

    # One thread: on a shared 2-core machine two llama.cpp threads spin on each other's barriers.
    model = LocalModel(gguf_path, n_ctx=2048, threads=1)
    yield model
    model.close()


@pytest.fixture(scope="session")
def ggufs(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> dict[str, Path]:
    """Tiny GGUFs without, with and with an unknown apiary.prompt_style (``helpers.export_styled_ggufs``)."""
    from tests.edge.helpers import export_styled_ggufs

    return export_styled_ggufs(tmp_path_factory.mktemp("styles"), gguf_path)


@pytest.fixture
def server() -> Iterator[FileServer]:
    """A local HTTP server for OTA images (``helpers.FileServer``)."""
    s = FileServer()
    s.thread.start()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


@pytest.fixture(scope="session")
def student_gguf() -> Path:
    """The shipped edge student's GGUF (the signed image in shared/models/edge-student, verified and unpacked)."""
    from apiary.shared import assets

    return assets.edge_model("edge-student")
