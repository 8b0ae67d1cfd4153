"""The demo's view of an OTA rollout: each device's image version and OTA phase from what the observer saw on the
wire (states and ota/status), the rollout's line from the cloud's view of it, and the events of a window (the
rollout's) that were answered once, never, or twice."""
from __future__ import annotations

from typing import Any

import pytest

from apiary.observer import MeshObserver
from apiary.shared.config import MqttConfig
from apiary.shared.protocol import DeviceState, InferenceResult, OtaStatus, SensorEvent, Severity, make
from apiary.view import ota_cell, progress_line, render, rollout_text
from tests.apiary.test_view import shown

NEW = "2026.12.0-demo"
ROLLOUT = {"image_version": NEW, "state": "running", "wave": 1, "waves": 2,
           "counts": {"committed": 1, "downloading": 2, "health_check": 1}}


def observer_mid_rollout() -> MeshObserver:
    """Four hives: one committed the new image (its state says so), two downloading, one checking its health."""
    obs = MeshObserver(MqttConfig())  # never started: the handlers are fed directly
    phases = {"hive-1": ("committed", None), "hive-2": ("downloading", 0.4), "hive-3": ("downloading", 0.7),
              "hive-4": ("health_check", None)}
    for device, (phase, progress) in phases.items():
        obs._on_state("", make(DeviceState(site="site-0", device=device, status="birth", online=True, session=1,
                                           battery_soc=0.8, image_version=NEW if phase == "committed" else None),
                               sender=device))
        obs._on_ota_status("", make(OtaStatus(site="site-0", device=device, image_version=NEW, phase=phase,
                                              progress=progress), sender=device))
    return obs


@pytest.fixture
def snap() -> dict[str, Any]:
    return {**observer_mid_rollout().snapshot(), "rollout": ROLLOUT}


def test_devices_carry_their_image_and_newest_ota_phase(snap) -> None:
    d = snap["devices"]
    assert (d["site-0/hive-1"]["image_version"], d["site-0/hive-1"]["ota_phase"]) == (NEW, "committed")
    assert d["site-0/hive-2"]["image_version"] is None and ota_cell(d["site-0/hive-2"]) == "downloading 40%"
    assert ota_cell(d["site-0/hive-4"]) == "health_check" and ota_cell({"ota_phase": None}) == "-"


def test_the_full_and_compact_layouts_and_the_progress_line_show_the_rollout(snap) -> None:
    line = "rollout 2026.12.0-demo: running, wave 2/2: downloading 2 · committed 1 · health_check 1"
    assert rollout_text(ROLLOUT) == line and rollout_text(None) is None
    full = "\n".join(shown(render(snap, None, "demo"), 140, 60))
    assert line in full and "downloading 70%" in full and full.count(NEW) >= 2  # the line and hive-1's image
    compact = shown(render(snap, None, "demo"), 80, 24)
    assert len(compact) <= 23 and any(line[:60] in row for row in compact)
    assert any("site-0/hive-2" in row and "dl 40%" in row for row in compact)
    assert progress_line(snap, None, "demo").endswith("; " + line)
    ended = {**ROLLOUT, "state": "completed", "counts": {"committed": 4}}
    assert rollout_text(ended) == "rollout 2026.12.0-demo: completed, 2 waves: committed 4"


def test_a_window_counts_its_events_answered_once_never_or_twice() -> None:
    obs = MeshObserver(MqttConfig())
    for seq in range(1, 5):
        ev = SensorEvent(site="s", device="h", seq=seq, timestamp=1.7e9 + seq, readings={"hive_temp_c": 39.0},
                         flags=["hive_temp_c_high"], severity=Severity.WARNING)
        obs._on_event("", make(ev, sender="bridge"))
    t0 = min(r.seen_at for r in obs.events.values())
    for seq, times, model in ((1, 1, "old.gguf"), (2, 2, "new.gguf"), (3, 1, "new.gguf")):  # #4: none
        for _ in range(times):
            obs._on_answer("", make(InferenceResult(request_id=f"r{seq}", site="s", device="h", tier="edge",
                                                    event_seq=seq, model=model), sender="h"))
    window = obs.window(t0, t0 + 60)
    assert window == {"events": 4, "needing_answer": 4, "answered_once": 2, "unanswered": 1, "double_answers": 1,
                      "models": {"old.gguf": 1, "new.gguf": 2}}
    assert obs.window(t0 + 60, t0 + 120)["events"] == 0
