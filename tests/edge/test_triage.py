"""Triage skips the model only where the answer is surely "normal"."""
from __future__ import annotations

from collections import Counter

from apiary.edge.triage import needs_answer, why
from apiary.firmware_bridge.simulator import labelled_situations


def test_no_anomaly_is_skipped_and_most_quiet_readings_are() -> None:
    """On 300 labelled situations (a seed used nowhere else), every situation triage logs as routine is
    labelled normal: early robbing (traffic and hum up, no warning yet) is flagged elevated and gets a look."""
    situations = labelled_situations(300, seed=31337)
    skipped = Counter(s.label for s in situations if not needs_answer(s.event, s.context))
    assert set(skipped) == {"normal"}, skipped
    normals = sum(1 for s in situations if s.label == "normal")
    assert skipped["normal"] >= 0.8 * normals  # the battery is still spared on most quiet readings
    looked_at = [s for s in situations if s.label == "robbing"]
    assert all(needs_answer(s.event, s.context) for s in looked_at)
    assert any(why(s.event).startswith("flags") and "elevated" in why(s.event) for s in looked_at)


def test_a_quiet_reading_right_after_flagged_ones_stays_watched() -> None:
    from apiary.shared.protocol import SensorEvent

    base = dict(site="s", device="hive-1", seq=1, timestamp=1.0, readings={"bee_traffic": 100.0})
    quiet = SensorEvent(**base)
    flagged = SensorEvent(**{**base, "flags": ["acoustic_freq_hz_elevated"]})
    other = SensorEvent(**{**base, "device": "hive-2", "flags": ["acoustic_freq_hz_elevated"]})
    assert not needs_answer(quiet, [quiet, quiet])
    assert why(quiet, [flagged, quiet]) == "recently flagged acoustic_freq_hz_elevated"
    assert not needs_answer(quiet, [flagged, quiet, quiet])  # flagged longer ago than WATCH_CONTEXT
    assert not needs_answer(quiet, [other])  # another device's flags are not this hive's
