"""bench.common's table: every cell readable when stdout is a pipe (rich's default width is 80 there)."""
from __future__ import annotations

import json
from pathlib import Path

from apiary.bench.common import report


def test_a_wide_table_prints_every_cell_in_full_to_a_pipe(tmp_path: Path, capsys) -> None:
    columns = [f"column number {i}" for i in range(13)]
    row = [f"value-{i}-complete" for i in range(13)]
    out = report("wide", "a wide table", columns, [row], out=tmp_path / "wide.json")
    printed = capsys.readouterr().out
    assert all(cell in printed for cell in row) and all(c in printed for c in columns)
    assert json.loads(out.read_text())["rows"] == [row]
