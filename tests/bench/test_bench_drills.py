"""``apiary bench drills`` through its real entry point: the cheap burst drill on a real Mosquitto and UDP bridge.

The crash drills (cloud, broker, edge) are the same scenarios as tests/cloud/test_drills.py, which asserts them
on the real processes; here the benchmark's own plumbing is checked: it runs, counts and writes its JSON.
"""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from apiary.cli import app

pytestmark = pytest.mark.timeout(180)


def test_burst_drill_counts_every_frame_once(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # results/bench/drills.json lands here
    result = CliRunner().invoke(app, ["bench", "drills", "--drills", "bridge-burst", "--burst", "600",
                                      "--drain", "60", "--results", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "results" / "bench" / "drills.json").read_text())
    (row,) = record["rows"]
    assert row[:5] == ["bridge-burst", 600, 600, 0, 0]
    assert (tmp_path / "runs").is_dir() and record["machine"]["cpu_features"] is not None


def test_unknown_drill_is_a_clear_error() -> None:
    result = CliRunner().invoke(app, ["bench", "drills", "--drills", "meteor"])
    assert result.exit_code == 2 and "unknown drills" in result.output
