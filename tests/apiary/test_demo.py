"""`apiary demo` end to end: events through every tier, answers from edge and cloud, nothing left running."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{pid}: {cmdline[:200]}")
    return found


@pytest.mark.slow
@pytest.mark.timeout(1100)
def test_demo_runs_every_tier_and_cleans_up(tmp_path: Path, gguf_path: Path) -> None:
    results = tmp_path / "demo-results"
    proc = subprocess.run(
        [sys.executable, "-m", "apiary", "demo", "--duration", "30", "--sites", "2", "--devices", "2",
         "--rate", "2", "--drain", "420", "--no-live", "--results", str(results)],
        capture_output=True, text=True, timeout=1000)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = list(results.iterdir())
    assert len(runs) == 1
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert (runs[0] / "latency.png").stat().st_size > 0

    # events flowed bridge -> broker -> edge; answers came from both tiers; nothing answered twice
    assert summary["events"] > 0 and summary["events"] == summary["frames_sent"]
    assert summary["answers_by_tier"].get("edge", 0) > 0, summary
    assert summary["answers_by_tier"].get("cloud", 0) > 0, summary
    assert summary["escalations"] > 0
    assert summary["double_answers"] == 0
    assert summary["anomalies_injected"] > 0
    assert summary["answered"] == summary["events_needing_answer"], summary
    # every answer with an action is graded against the simulator's ground truth, per tier
    graded = summary["accuracy_by_tier"]
    assert sum(t["graded"] for t in graded.values()) > 0 and all(0 <= t["accuracy"] <= 1 for t in graded.values())
    # the REST API was up: its engine gauges were scraped at the end
    assert summary["engine"], "no engine metrics from the cloud's /metrics endpoint"

    # shutdown left no process behind (every component's command line names the run folder)
    assert _processes_mentioning(str(results)) == []
