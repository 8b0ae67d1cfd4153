"""``apiary bench mesh`` through its real entry point, short: Mosquitto, a cloud, two edge agents, a rollout of a
freshly signed image to both (canary, then the other) while the traffic flows; the table and JSON say the rollout
committed everywhere and that no event of its window was lost or answered twice."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_bench_mesh_rolls_an_image_out_and_loses_no_event_during_the_swaps(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "apiary", "bench", "mesh", "--duration", "40", "--sites", "1", "--devices", "2",
         "--rate", "1", "--restart-at", "0", "--rollout-at", "0.25", "--drain", "420",
         "--results", str(tmp_path / "runs")],
        cwd=tmp_path, capture_output=True, text=True, timeout=950)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "results" / "bench" / "mesh.json").read_text())
    rollout = record["rollout"]
    assert rollout["state"] == "completed" and rollout["waves"] == 2 and len(rollout["canary"]) == 1, rollout
    assert rollout["committed"] == rollout["devices"] == 2 and rollout["rolled_back"] == 0
    during = rollout["during"]
    assert during["events"] > 0 and during["unanswered"] == 0 and during["double_answers"] == 0, during
    assert during["answered_once"] == during["needing_answer"]
    snap = record["snapshot"]
    assert snap["events"] == record["frames_sent"] and snap["double_answers"] == 0 and record["drained"]
    assert {d["image_version"] for d in snap["devices"].values()} == {rollout["image_version"]}
    rows = {row[0]: row[1] for row in record["rows"]}
    assert rows["devices committed / rolled back / all"] == "2 / 0 / 2"
    assert rows["  lost (no answer) / answered twice"] == "0 / 0"
    assert "rollout of " + rollout["image_version"] in proc.stdout
