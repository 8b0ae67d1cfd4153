"""End to end into a real Mosquitto: serial over a pty, UDP, a broker outage, the CLI.

N frames in, N events out: none lost, none doubled, order per device kept.
"""
from __future__ import annotations

import json
import os
import threading
import time
import tty

import pytest
from typer.testing import CliRunner

from apiary.cli import app
from apiary.firmware_bridge.bridge import connect
from apiary.firmware_bridge.settings import BridgeSettings
from apiary.firmware_bridge.simulator import FdSink, Fleet, UdpSink
from apiary.firmware_bridge.sources import open_serial, open_udp, run_serial, run_udp
from apiary.shared import topics
from apiary.shared.protocol import DeviceState, SensorEvent
from apiary.shared.transport import MqttTransport


class Collector:
    """A persistent-session subscriber recording every event and bridge state it receives."""

    def __init__(self, config, client_id="collector"):
        self.events: list[SensorEvent] = []
        self.states: list[DeviceState] = []
        self.lock = threading.Lock()
        self.t = MqttTransport(config, client_id, persistent=True)
        self.t.start()
        self.t.subscribe(topics.all_of("event"), self._on_event)
        self.t.subscribe(topics.all_of("state"), self._on_state)

    def _on_event(self, topic, env):
        assert topic == topics.event(env.body.site, env.body.device)
        with self.lock:
            self.events.append(env.body)

    def _on_state(self, topic, env):
        with self.lock:
            self.states.append(env.body)

    def wait(self, n, timeout=60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(self.events) < n:
            time.sleep(0.02)
        time.sleep(0.3)  # anything extra (a duplicate) would land now
        with self.lock:
            return list(self.events)


@pytest.fixture(autouse=True)
def restore_logging():
    """The CLI installs the apiary log handler on the root logger; leave logging as other tests expect it."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def collector(mosquitto):
    c = Collector(mosquitto.config)
    yield c
    c.t.stop()


def sim_frames(n, seed=5):
    fleet = Fleet(2, 3, seed=seed, interval_s=60.0)
    fleet.inject_random(4, n // 6 * 60.0)
    frames = []
    while len(frames) < n:
        frames += fleet.tick()
    return fleet, frames[:n]


def assert_exactly_once_in_order(events, frames, fleet):
    """Every frame became exactly one event; per device the events arrived in frame order."""
    settings = BridgeSettings(sites=fleet.sites())
    want = [(settings.node_of(f.device_id), f.seq) for f in frames]
    got = [(e.device, e.seq) for e in events]
    assert len(got) == len(want) and set(got) == set(want)  # none lost, none doubled
    for node in {d for d, _ in want}:
        assert [s for d, s in got if d == node] == [s for d, s in want if d == node]
    by_key = {(settings.node_of(f.device_id), f.seq): f for f in frames}
    for e in events:
        f = by_key[(e.device, e.seq)]
        assert e.site == f.site and e.timestamp == f.timestamp and e.truth == f.label
        assert e.readings == {k: v for k, v in f.readings.items() if v is not None}


@pytest.mark.timeout(120)
def test_serial_over_pty_into_mosquitto(mosquitto, collector):
    fleet, frames = sim_frames(600)
    master, slave = os.openpty()
    tty.setraw(slave)
    bridge = connect(BridgeSettings(name="pty-bridge", sites=fleet.sites()), mosquitto.config,
                     truth_lookup=fleet.truth)
    stop = threading.Event()
    reader = threading.Thread(target=run_serial, args=(bridge, open_serial(os.ttyname(slave)), stop))
    reader.start()
    try:
        sink = FdSink(master)
        for i, f in enumerate(frames):
            if i % 50 == 7:
                sink(b"\x00\xbe\xe5\x01\xffboot garbage\r\n")  # line noise between frames: forces resyncs
            sink(f.data)
        events = collector.wait(len(frames))
    finally:
        stop.set()
        reader.join(10)
        bridge.stop()
        os.close(master)
        os.close(slave)
    assert_exactly_once_in_order(events, frames, fleet)
    c = bridge.counters()
    assert (c["frames_ok"], c["published"], c["dropped"], c["gaps"], c["duplicates"]) == (600, 600, 0, 0, 0)
    assert c["resyncs"] == 12


@pytest.mark.timeout(120)
def test_udp_into_mosquitto(mosquitto, collector):
    fleet, frames = sim_frames(600, seed=9)
    bridge = connect(BridgeSettings(name="udp-bridge", sites=fleet.sites()), mosquitto.config,
                     truth_lookup=fleet.truth)
    sock = open_udp("127.0.0.1", 0)
    stop = threading.Event()
    reader = threading.Thread(target=run_udp, args=(bridge, sock, stop))
    reader.start()
    sink = UdpSink("127.0.0.1", sock.getsockname()[1])
    try:
        for i, f in enumerate(frames):
            sink(f.data)
            if i % 100 == 99:
                time.sleep(0.01)  # a gateway's pace, not a flood into the kernel's socket buffer
        events = collector.wait(len(frames))
    finally:
        sink.close()
        stop.set()
        reader.join(10)
        bridge.stop()
    assert_exactly_once_in_order(events, frames, fleet)
    assert bridge.counters()["published"] == 600


@pytest.mark.timeout(120)
def test_broker_outage_is_buffered_then_delivered(mosquitto, collector):
    fleet, frames = sim_frames(300, seed=11)
    bridge = connect(BridgeSettings(name="outage-bridge", sites=fleet.sites()), mosquitto.config,
                     truth_lookup=fleet.truth)
    try:
        for f in frames[:100]:
            bridge.feed(f.data)
        assert len(collector.wait(100)) == 100
        mosquitto.stop()
        deadline = time.monotonic() + 10
        while bridge.transport.connected and time.monotonic() < deadline:
            time.sleep(0.02)
        for f in frames[100:]:
            bridge.feed(f.data)  # the reader keeps going while the broker is gone
        time.sleep(0.2)
        assert bridge.counters()["buffered"] == 200
        mosquitto.start()
        events = collector.wait(300)
    finally:
        bridge.stop()
    assert_exactly_once_in_order(events, frames, fleet)
    c = bridge.counters()
    assert c["max_buffered"] >= 200 and c["dropped"] == 0 and c["published"] == 300
    births = [s for s in collector.states if s.device == "outage-bridge" and s.status == "birth"]
    assert len(births) >= 2 and all(s.role == "bridge" and s.online for s in births)  # re-born after the outage


@pytest.mark.timeout(180)
def test_a_burst_of_20000_frames_with_the_broker_up_loses_nothing(mosquitto, collector, tmp_path):
    """The in-memory buffer used to drop 3,792 of a 20,000-frame burst (#15, observation 7): past it frames
    now spill to the bridge's SQLite file and leave from there in order."""
    fleet, frames = sim_frames(20_000, seed=13)
    settings = BridgeSettings(name="burst-bridge", sites=fleet.sites(), buffer_size=500, state_dir=str(tmp_path))
    bridge = connect(settings, mosquitto.config, truth_lookup=fleet.truth)
    try:
        peak_spilled = 0
        for i in range(0, len(frames), 50):
            bridge.feed(b"".join(f.data for f in frames[i:i + 50]))
            peak_spilled = max(peak_spilled, bridge.counters()["spilled"])
        events = collector.wait(len(frames), timeout=150)
    finally:
        bridge.stop()
    assert peak_spilled > 0  # the burst did outrun the memory buffer
    assert_exactly_once_in_order(events, frames, fleet)
    c = bridge.counters()
    assert (c["dropped"], c["published"], c["spilled"]) == (0, 20_000, 0)


@pytest.mark.timeout(120)
def test_the_udp_bridge_remembers_what_it_published_across_a_kill_9(mosquitto, collector, tmp_path):
    """The real `apiary bridge udp` process, killed and restarted: a replay of frames it already published is
    dropped, and the device's next frame and a reboot it reports still go through."""
    import signal
    import subprocess
    import sys

    from apiary.firmware_bridge.frames import encode_frame

    readings = {"hive_temp_c": 34.5, "battery_v": 3.9}
    recorded = [encode_frame(3, seq, 1_750_000_000 + seq, readings, boot=4) for seq in range(100, 120)]

    def run_bridge():
        proc = subprocess.Popen([sys.executable, "-m", "apiary", "bridge", "udp", "--host", "127.0.0.1", "--port",
                                 "0", "--broker", mosquitto.config.url, "--name", "kill-bridge", "--site", "north"],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = proc.stdout.readline()
        assert "listening on udp://" in line, line
        return proc, UdpSink("127.0.0.1", int(line.split("udp://127.0.0.1:")[1].split(";")[0]))

    proc, sink = run_bridge()
    try:
        for data in recorded:
            sink(data)
        assert len(collector.wait(20)) == 20
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        sink.close()
        proc, sink = run_bridge()
        for data in recorded:  # replayed after the restart
            sink(data)
        sink(encode_frame(3, 120, 1_750_000_120, readings, boot=4))
        sink(encode_frame(3, 0, 1_750_000_200, readings, boot=5))
        events = collector.wait(22)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        sink.close()
    assert [e.seq for e in events] == list(range(100, 121)) + [0]
    counters = json.loads(out.strip().splitlines()[-1])
    assert (counters["duplicates"], counters["restarts"], counters["published"]) == (20, 1, 2)
    assert (tmp_path / ".apiary" / "bridge" / "kill-bridge.db").is_file()


@pytest.mark.timeout(60)
def test_retained_birth_then_death(mosquitto):
    bridge = connect(BridgeSettings(name="state-bridge", default_site="north"), mosquitto.config)
    time.sleep(0.2)
    late = Collector(mosquitto.config, "late-joiner")  # retained: a late subscriber still sees the bridge
    try:
        deadline = time.monotonic() + 10
        while not late.states and time.monotonic() < deadline:
            time.sleep(0.02)
        assert late.states[0].status == "birth" and late.states[0].site == "north"
        bridge.stop()
        while late.states[-1].status != "death" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert late.states[-1].status == "death" and late.states[-1].session == bridge.session
        assert late.states[-1].counters["published"] == 0
    finally:
        late.t.stop()


@pytest.mark.timeout(120)
def test_cli_simulate_capture_then_bridge_replay(mosquitto, collector, tmp_path):
    runner = CliRunner()
    capture, labels = tmp_path / "capture.bin", tmp_path / "labels.jsonl"
    sim = runner.invoke(app, ["simulate", "run", "--sites", "1", "--devices", "4", "--rate", "0", "--count", "240",
                              "--noise", "0.1", "--seed", "3", "--out", str(capture), "--labels", str(labels)])
    assert sim.exit_code == 0, sim.output
    stats = json.loads(sim.stdout.strip().splitlines()[-1])
    assert stats["frames"] == 240 and stats["corrupted"] > 0
    rep = runner.invoke(app, ["bridge", "replay", str(capture), "--broker", mosquitto.config.url,
                              "--name", "replayer"])
    assert rep.exit_code == 0, rep.output
    counters = json.loads(rep.stdout.strip().splitlines()[-1])
    intact = 240 - stats["corrupted"]
    assert counters["frames_ok"] == counters["published"] == intact
    events = collector.wait(intact)
    assert len(events) == intact and len({(e.device, e.seq) for e in events}) == intact
    truth = {(f"hive-{r['device_id']:04d}", r["seq"]) for r in map(json.loads, labels.read_text().splitlines())}
    assert {(e.device, e.seq) for e in events} <= truth
    assert all(e.truth is None for e in events)  # a real bridge never knows the truth


@pytest.mark.timeout(120)
def test_cli_simulate_in_process_bridge_carries_truth(mosquitto, collector, tmp_path):
    labels = tmp_path / "labels.jsonl"
    result = CliRunner().invoke(app, ["simulate", "run", "--sites", "2", "--devices", "2", "--rate", "0",
                                      "--count", "400", "--anomalies", "4", "--interval", "600", "--seed", "1",
                                      "--broker", mosquitto.config.url, "--labels", str(labels)])
    assert result.exit_code == 0, result.output
    events = collector.wait(400)
    truth = {(f"hive-{r['device_id']:04d}", r["seq"]): (r["site"], r["label"])
             for r in map(json.loads, labels.read_text().splitlines())}
    assert len(events) == 400
    assert {(e.device, e.seq): (e.site, e.truth) for e in events} == truth
    assert {e.truth for e in events} - {"normal"}  # some anomalies made it into the stream


def test_cli_rejects_bad_input(tmp_path):
    runner = CliRunner()
    for args, message in [
        (["simulate", "run", "--out", str(tmp_path / "x"), "--inject", "tornado:1@2"], "unknown anomaly"),
        (["simulate", "run", "--out", str(tmp_path / "x"), "--inject", "swarming:99@2"], "no device 99"),
        (["simulate", "run", "--out", str(tmp_path / "x"), "--inject", "swarming"], "KIND:DEVICE@HOURS"),
        (["simulate", "run"], "exactly one"),
        (["simulate", "run", "--out", str(tmp_path / "x"), "--udp", "127.0.0.1:9"], "exactly one"),
        (["bridge", "replay", str(tmp_path / "missing.bin")], "not found"),
        (["bridge", "serial", str(tmp_path / "no-such-tty"), "--broker", "mqtt://127.0.0.1:1"], "error"),
    ]:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)


@pytest.mark.timeout(90)
def test_killed_bridge_process_leaves_a_retained_death(mosquitto, tmp_path):
    """SIGKILL the real `apiary bridge udp` process: the broker publishes its Last Will."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "apiary", "bridge", "udp", "--host", "127.0.0.1", "--port", "0",
                             "--broker", mosquitto.config.url, "--name", "lwt-bridge", "--site", "north"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    watcher = Collector(mosquitto.config, "lwt-watcher")
    try:
        deadline = time.monotonic() + 60
        while not any(s.device == "lwt-bridge" and s.status == "birth" for s in watcher.states):
            assert time.monotonic() < deadline and proc.poll() is None, "bridge never announced itself"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        while not any(s.device == "lwt-bridge" and s.status == "death" for s in watcher.states):
            assert time.monotonic() < deadline, "no Last Will"
            time.sleep(0.05)
        death = [s for s in watcher.states if s.device == "lwt-bridge"][-1]
        birth = [s for s in watcher.states if s.device == "lwt-bridge" and s.status == "birth"][0]
        assert not death.online and death.site == "north" and death.session == birth.session
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
        watcher.t.stop()
