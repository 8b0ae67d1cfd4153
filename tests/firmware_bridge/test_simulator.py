"""The simulator: realistic daily cycles, labelled anomaly signatures, ground truth, evaluation situations."""
from __future__ import annotations

import statistics

import pytest

from apiary.firmware_bridge.errors import BridgeError
from apiary.firmware_bridge.frames import decode_frame
from apiary.firmware_bridge.simulator import (ANOMALIES, DAY, HOUR, SPECS, SWARM_DEPARTURE, Fleet, emit,
                                       labelled_situations)
from apiary.firmware_bridge.stream import StreamReader
from apiary.firmware_bridge.thresholds import assess
from apiary.shared.protocol import ASSESSMENTS, Severity


def run_hive(days=3.0, interval=600.0, seed=2, **profile):
    fleet = Fleet(1, 1, seed=seed, interval_s=interval)
    for k, v in profile.items():
        setattr(fleet.hives[0].profile, k, v)
    return fleet, [fleet.tick()[0] for _ in range(int(days * DAY / interval))]


def at_hour(frames, hour):
    return [f for f in frames if abs((f.timestamp % DAY) / HOUR - hour) < 1e-6]


def test_frames_are_real_decodable_frames():
    fleet, frames = run_hive(days=0.5)
    for f in frames:
        d = decode_frame(f.data)
        assert (d.device_id, d.seq, d.timestamp) == (f.device_id, f.seq, f.timestamp)
        assert d.readings == f.readings
    assert [f.seq for f in frames] == list(range(frames[0].seq, frames[0].seq + len(frames)))


def test_daily_cycles():
    _, frames = run_hive(days=4, nectar_kg_per_day=0.0, colony=1.2)
    for day in range(1, 4):
        today = [f for f in frames if int(f.timestamp // DAY) == int(frames[0].timestamp // DAY) + day]
        r = {h: at_hour(today, h)[0].readings for h in (4, 7, 13, 15, 22)}
        assert r[15]["ambient_temp_c"] > r[4]["ambient_temp_c"] + 8  # afternoon peak, cold before dawn
        assert r[4]["solar_w"] == r[22]["solar_w"] == 0 and r[13]["solar_w"] > 0.5
        assert r[4]["bee_traffic"] < 50 < 500 < r[13]["bee_traffic"]
        assert r[13]["hive_weight_kg"] < r[7]["hive_weight_kg"] - 0.2  # foragers out at midday
        assert r[22]["hive_weight_kg"] > r[13]["hive_weight_kg"] + 0.2  # and back home at night
        assert r[7]["battery_v"] < r[15]["battery_v"]  # drained overnight, charged by day
        assert 33.0 < r[4]["hive_temp_c"] < 36.0 and 33.0 < r[15]["hive_temp_c"] < 36.0  # brood nest held
        assert r[13]["acoustic_db"] > r[4]["acoustic_db"]


def test_nectar_flow_gains_weight_day_over_day():
    _, frames = run_hive(days=5, nectar_kg_per_day=1.6, colony=1.2)
    dawns = [f.readings["hive_weight_kg"] for f in at_hour(frames, 6)]
    assert all(b > a + 0.5 for a, b in zip(dawns, dawns[1:]))


def test_no_warnings_and_few_watch_flags_on_a_normal_fleet_week():
    fleet = Fleet(2, 4, seed=4, interval_s=900)
    flagged, elevated, total, prev = 0, 0, 0, {}
    for _ in range(int(7 * DAY / 900)):
        for f in fleet.tick():
            sev, flags = assess(f.readings, previous=prev.get(f.device_id), timestamp=f.timestamp)
            prev[f.device_id] = (f.timestamp, f.readings)
            flagged += any(not fl.endswith("_elevated") for fl in flags) or sev.value != "info"
            elevated += bool(flags)
            total += 1
    assert flagged == 0 and total > 5000
    assert elevated <= 0.01 * total  # busy hours that earn a look from the edge model: rare


def window(fleet, frames, anomaly):
    return [f for f in frames if anomaly.start <= f.timestamp < anomaly.end]


@pytest.mark.parametrize("kind", ANOMALIES)
def test_each_anomaly_has_its_signature_and_label(kind):
    fleet = Fleet(1, 1, seed=8, interval_s=300)
    dev = fleet.hives[0].device_id
    a = fleet.inject(kind, dev, fleet.t + DAY + HOUR * SPECS[kind].start_hours[0] + 0.5 * HOUR,
                     mode="temp_85" if kind == "sensor_fault" else None)
    frames = [fleet.tick()[0] for _ in range(int(3 * DAY / 300))]
    inside = window(fleet, frames, a)
    assert {f.label for f in inside} == {kind}
    assert {f.label for f in frames if f not in inside} == {"normal"}
    evident = [f.readings for f in inside if f.timestamp >= a.start + SPECS[kind].evident[0] * a.duration_s]
    day_before = [f.readings for f in frames if a.start - DAY <= f.timestamp < a.end - DAY]
    mean = lambda rows, k: statistics.fmean(r[k] for r in rows)  # noqa: E731
    if kind == "heat_stress":
        assert min(r["hive_temp_c"] for r in evident) > 37 and min(r["ambient_temp_c"] for r in evident) > 35
    elif kind == "swarming":
        pre = [f.readings for f in inside if f.timestamp < a.start + SWARM_DEPARTURE * a.duration_s
               and f.timestamp >= a.start + SPECS[kind].ramp_s]
        assert min(r["acoustic_freq_hz"] for r in pre) > 380  # piping
        weights = [f.readings["hive_weight_kg"] for f in inside]
        assert max(a - b for a, b in zip(weights, weights[1:])) > 1.0  # the swarm leaves within minutes
        assert max(f.readings["bee_traffic"] for f in inside) > 3 * mean(day_before, "bee_traffic")
    elif kind == "robbing":
        assert mean(evident, "bee_traffic") > 2.5 * mean(day_before, "bee_traffic")
        assert inside[-1].readings["hive_weight_kg"] < inside[0].readings["hive_weight_kg"] - 0.5
    elif kind == "sensor_fault":
        assert all(r["hive_temp_c"] == 85.0 for r in evident)
    else:
        assert max(r["battery_v"] for r in evident) < 3.5 and mean(evident, "solar_w") < 0.5


def test_truth_lookup_matches_every_frame():
    fleet = Fleet(2, 2, seed=3, interval_s=600)
    fleet.inject_random(6, 3 * DAY)
    frames = [f for _ in range(int(3 * DAY / 600)) for f in fleet.tick()]
    assert all(fleet.truth(f.device_id, f.seq) == f.label for f in frames)
    assert {f.label for f in frames} - {"normal"}
    assert fleet.truth(1, frames[-1].seq + 1000) is None and fleet.truth(999, 0) is None


def test_inject_random_never_overlaps_on_a_device():
    fleet = Fleet(1, 3, seed=1)
    got = fleet.inject_random(12, 10 * DAY)
    assert len(got) == 12
    for a in got:
        assert not any(b is not a and b.device_id == a.device_id and a.start < b.end and b.start < a.end for b in got)


def test_emit_with_noise_is_recovered_by_the_reader():
    fleet = Fleet(1, 4, seed=6)
    chunks: list[bytes] = []
    stats = emit(fleet.frames(), chunks.append, rate=0, count=500, noise=0.2, seed=1)
    assert stats.frames == 500 and stats.corrupted > 10 and stats.garbage > 10
    reader = StreamReader()
    got = [f for c in chunks for f in reader.feed(c)] + reader.finish()
    assert len(got) == 500 - stats.corrupted
    assert sum(stats.labels.values()) == 500


def test_labelled_situations_are_balanced_deterministic_and_bridge_shaped():
    sits = labelled_situations(36, seed=4)
    assert sits == labelled_situations(36, seed=4)
    assert sorted(s.label for s in sits) == sorted(ASSESSMENTS * 6)
    for s in sits:
        e = s.event
        assert e.truth == s.label and len(s.context) == 6
        assert all(c.device == e.device and c.site == e.site for c in s.context)
        assert [c.seq for c in s.context] == list(range(e.seq - 6, e.seq))
        prev = s.context[-1]
        assert (e.severity, e.flags) == assess(e.readings, previous=(prev.timestamp, prev.readings),
                                               timestamp=e.timestamp)
        if s.label in ("heat_stress", "swarming", "sensor_fault", "low_battery"):
            assert e.severity is not Severity.INFO, s
        if s.label == "normal":
            assert e.severity is Severity.INFO and e.flags == []
    assert labelled_situations(6, seed=5) != labelled_situations(6, seed=6)


def test_climate_and_noise_knobs_shift_the_readings_and_default_to_the_tuned_conditions():
    base = labelled_situations(6, seed=7)
    assert labelled_situations(6, seed=7, climate_c=0.0, noise_scale=1.0) == base

    def hive(**conditions):
        fleet = Fleet(1, 1, seed=3, interval_s=600, **conditions)
        return [fleet.tick()[0].readings for _ in range(int(2 * DAY / 600))]

    calm, hot, noisy = hive(), hive(climate_c=8.0), hive(noise_scale=3.0)
    ambient = [h["ambient_temp_c"] - c["ambient_temp_c"] for c, h in zip(calm, hot)]
    assert 7.0 < statistics.mean(ambient) < 9.0
    hum_noise = [abs(n["acoustic_freq_hz"] - c["acoustic_freq_hz"]) for c, n in zip(calm, noisy)]
    assert statistics.mean(hum_noise) > 5.0  # same hive, same draws: only the noise differs


@pytest.mark.parametrize("call,match", [
    (lambda: Fleet(0, 1), "at least one"),
    (lambda: Fleet(1, 1, first_device_id=65535 + 1), "u16"),
    (lambda: Fleet(1, 1, interval_s=0), "positive"),
    (lambda: Fleet(1, 1, noise_scale=-1), "noise_scale"),
    (lambda: Fleet(1, 1).inject("tornado", 1, 0), "unknown anomaly"),
    (lambda: Fleet(1, 1).inject("swarming", 2, 0), "no device 2"),
    (lambda: Fleet(1, 1).inject("sensor_fault", 1, 0, mode="smoke"), "unknown sensor fault"),
    (lambda: labelled_situations(-1), ">= 0"),
    (lambda: emit([], lambda b: None, rate=-1), "rate"),
])
def test_bad_input_is_a_bridge_error(call, match):
    with pytest.raises(BridgeError, match=match):
        call()


@pytest.mark.timeout(60)
def test_pty_sink_waits_for_its_reader_and_drains_before_closing():
    import threading

    from apiary.firmware_bridge.simulator import PtySink
    from apiary.firmware_bridge.sources import open_serial

    fleet = Fleet(1, 3, seed=2)
    frames = [f for f, _ in zip(fleet.frames(), range(300))]
    sink = PtySink()
    got, reader = [], StreamReader()

    def read_later():
        threading.Event().wait(0.3)  # the bridge starts after the simulator printed the pty path
        line = open_serial(sink.path)
        try:
            while len(got) < len(frames):
                data = line.read(max(1, line.in_waiting))
                got.extend(reader.feed(data))
        finally:
            line.close()

    t = threading.Thread(target=read_later)
    t.start()
    assert not sink.reader_present()
    stats = emit(frames, sink, rate=0)
    sink.close(linger_s=20)
    t.join(20)
    assert stats.frames == 300
    assert [(f.device_id, f.seq) for f in got] == [(f.device_id, f.seq) for f in frames]


def test_the_first_random_anomaly_starts_when_asked_and_none_before() -> None:
    fleet = Fleet(2, 4, seed=0)
    t0 = fleet.t
    got = fleet.inject_random(3, 7 * DAY, first_at_s=2 * HOUR)
    assert len(got) == 3 and got[0].start == t0 + 2 * HOUR
    assert min(a.start for a in got) == t0 + 2 * HOUR
    short = Fleet(2, 4, seed=0)  # a run too short for the whole anomaly still gets its start
    assert short.inject_random(1, 3 * HOUR, first_at_s=2.5 * HOUR)[0].start == short.t + 2.5 * HOUR
    lone = Fleet(1, 1, seed=0)  # the one device is taken then: the first waits for a free slot
    lone.inject("swarming", 1, lone.t + 2 * HOUR)
    assert all(a.start > lone.t + 2 * HOUR for a in lone.inject_random(1, 7 * DAY, first_at_s=2 * HOUR))


def test_cli_anomaly_after_is_wall_seconds_at_the_rate(tmp_path) -> None:
    """--anomaly-after 0.5 at 100 frames/s: the first anomalous frame comes right after the 50th (8 hives a tick)."""
    import json

    from typer.testing import CliRunner

    from apiary.cli import app

    labels = tmp_path / "labels.jsonl"
    result = CliRunner().invoke(app, ["simulate", "run", "--out", str(tmp_path / "cap.bin"), "--rate", "100",
                                      "--count", "160", "--anomalies", "1", "--anomaly-after", "0.5",
                                      "--labels", str(labels)])
    assert result.exit_code == 0, result.output
    frames = [json.loads(line) for line in labels.read_text().splitlines()]
    first = next(i for i, f in enumerate(frames) if f["label"] != "normal")
    assert 50 <= first < 50 + 2 * 8, first  # in the first tick (8 frames) from 0.5 s on, at the device's place
    assert "~0.5 s in" in result.output
