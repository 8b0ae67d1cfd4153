"""The README as a newcomer follows it: what it tells them to type works as written."""
from __future__ import annotations

import re
from pathlib import Path

from cloud.settings import CloudSettings

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_asks_for_the_model_id_cloud_serve_serves() -> None:
    """Every `model` the README sends (curl, openai client) is the id `apiary cloud serve` serves by default."""
    asked = re.findall(r'\bmodel"?\s*[:=]\s*"([^"]+)"', README.read_text())
    assert len(asked) >= 2 and set(asked) == {CloudSettings().model_name}, asked
