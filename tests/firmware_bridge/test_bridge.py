"""The bridge core against an in-memory link: mapping, de-duplication, bounded buffering, state messages.

The same behaviour against a real Mosquitto is in test_bridge_mqtt.py.
"""
from __future__ import annotations

import threading
import time

import pytest

from apiary.firmware_bridge.bridge import Bridge, death_will
from apiary.firmware_bridge.frames import encode_frame
from apiary.firmware_bridge.settings import BridgeSettings
from apiary.firmware_bridge.store import BridgeStore
from apiary.shared import topics
from apiary.shared.protocol import DeviceState, Envelope, SensorEvent, Severity, decode, encode

READINGS = {"hive_temp_c": 34.5, "hive_weight_kg": 40.0, "battery_v": 3.95}


class MemoryLink:
    """An in-memory stand-in for MqttTransport: records publishes, can be taken down and up."""

    def __init__(self, up: bool = True) -> None:
        self.up = up
        self.sent: list[tuple[str, Envelope, bool]] = []
        self.listeners = []
        self.stats = {"published": 0, "acked": 0}
        self.lock = threading.Lock()

    @property
    def connected(self) -> bool:
        return self.up

    def add_link_listener(self, fn) -> None:
        self.listeners.append(fn)

    def set_link(self, up: bool) -> None:
        self.up = up
        for fn in self.listeners:
            fn(up)

    def publish(self, topic, env, *, qos=1, retain=False, timeout=None) -> bool:
        if not self.up:
            return False
        assert qos == 1
        with self.lock:
            self.sent.append((topic, decode(encode(env)), retain))  # through the real wire codec
            self.stats["published"] += 1
            self.stats["acked"] += 1
        return True

    def events(self) -> list[tuple[str, SensorEvent]]:
        with self.lock:
            return [(t, e.body) for t, e, _ in self.sent if isinstance(e.body, SensorEvent)]

    def states(self) -> list[DeviceState]:
        with self.lock:
            return [e.body for t, e, _ in self.sent if isinstance(e.body, DeviceState)]


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


@pytest.fixture
def link():
    return MemoryLink()


def make_bridge(link, **kw) -> Bridge:
    truth = kw.pop("truth_lookup", None)
    store = kw.pop("store", None)
    return Bridge(BridgeSettings(**{"sites": {7: "orchard"}, **kw}), link, truth_lookup=truth, session=11,
                  store=store).start()


def durable_bridge(link, tmp_path, budget=1 << 24, **kw) -> Bridge:
    return make_bridge(link, store=BridgeStore(tmp_path / "bridge.db", spill_budget_bytes=budget), **kw)


@pytest.mark.timeout(30)
def test_frames_become_events_on_the_device_topic(link):
    bridge = make_bridge(link)
    bridge.feed(encode_frame(7, 1, 1_750_000_000, READINGS) + encode_frame(3, 9, 1_750_000_000, {**READINGS,
                                                                                               "hive_temp_c": 39.5}))
    assert wait_for(lambda: len(link.events()) == 2)
    (t1, e1), (t2, e2) = link.events()
    assert t1 == topics.event("orchard", "hive-0007") and t2 == topics.event("site-0", "hive-0003")
    assert (e1.site, e1.device, e1.seq, e1.timestamp, e1.readings) == ("orchard", "hive-0007", 1, 1.75e9, READINGS)
    assert e1.severity is Severity.INFO and e1.flags == [] and e1.truth is None
    assert e2.severity is Severity.CRITICAL and e2.flags == ["hive_temp_c_high"]
    assert bridge.stop()


@pytest.mark.timeout(30)
def test_birth_updates_and_death_carry_counters(link):
    bridge = make_bridge(link, state_interval_s=0.05)
    bridge.feed(encode_frame(7, 1, 1, READINGS) + encode_frame(7, 1, 1, READINGS) + encode_frame(7, 4, 1, READINGS))
    assert wait_for(lambda: any(s.status == "update" and s.counters.get("published") == 2 for s in link.states()))
    bridge.stop()
    states = link.states()
    assert states[0].status == "birth" and states[0].online and states[0].role == "bridge"
    assert states[-1].status == "death" and not states[-1].online and states[-1].session == 11
    assert all(s.device == "bridge-0" and s.site == "site-0" for s in states)
    c = states[-1].counters
    assert (c["frames_ok"], c["duplicates"], c["gaps"], c["published"], c["dropped"]) == (3, 1, 2, 2, 0)
    assert all(retain for t, e, retain in link.sent if isinstance(e.body, DeviceState))
    assert {t for t, e, _ in link.sent if isinstance(e.body, DeviceState)} == {topics.state("site-0", "bridge-0")}


def test_death_will_matches_the_state_topic():
    topic, env = death_will(BridgeSettings(name="b1", default_site="north"), 5)
    assert topic == topics.state("north", "b1")
    assert env.body.status == "death" and env.body.session == 5 and not env.body.online


@pytest.mark.timeout(30)
def test_link_down_buffers_in_order_then_flushes(link):
    bridge = make_bridge(link)
    assert wait_for(lambda: len(link.states()) == 1)
    link.set_link(False)
    for seq in range(50):
        bridge.feed(encode_frame(7, seq, 1000 + seq, READINGS))
    assert wait_for(lambda: bridge.counters()["buffered"] == 50)
    assert link.events() == []
    link.set_link(True)
    assert wait_for(lambda: len(link.events()) == 50)
    assert [e.seq for _, e in link.events()] == list(range(50))
    assert [s.status for s in link.states()] == ["birth", "birth"]  # re-announced after the link came back
    assert bridge.stop()


@pytest.mark.timeout(30)
def test_full_buffer_drops_oldest_counts_it_and_never_blocks_the_reader(link):
    bridge = make_bridge(link, buffer_size=10)
    link.set_link(False)
    t0 = time.monotonic()
    for seq in range(1000):
        assert bridge.feed(encode_frame(7, seq, 1000 + seq, READINGS)) == 1
    assert time.monotonic() - t0 < 10  # not a timing threshold on speed: the reader just must not hang
    c = bridge.counters()
    assert (c["buffered"], c["dropped"], c["frames_ok"]) == (10, 990, 1000)
    link.set_link(True)
    assert wait_for(lambda: len(link.events()) == 10)
    assert [e.seq for _, e in link.events()] == list(range(990, 1000))  # the freshest survive
    bridge.stop()


@pytest.mark.timeout(30)
def test_link_dropping_mid_batch_keeps_the_rest(link):
    calls = {"n": 0}
    real_publish = link.publish

    def flaky(topic, env, **kw):
        if isinstance(env.body, SensorEvent):
            calls["n"] += 1
            if calls["n"] == 5:
                link.up = False  # the link drops while the publisher is inside a batch
                threading.Timer(0.1, link.set_link, args=(True,)).start()
        return real_publish(topic, env, **kw)

    link.publish = flaky
    bridge = make_bridge(link)
    link.set_link(False)
    bridge.feed(b"".join(encode_frame(7, seq, 1000 + seq, READINGS) for seq in range(20)))
    link.set_link(True)
    assert wait_for(lambda: len(link.events()) == 20)
    assert [e.seq for _, e in link.events()] == list(range(20))
    assert bridge.stop()


@pytest.mark.timeout(30)
def test_truth_lookup_fills_truth_and_failures_are_counted(link):
    def truth(device_id, seq):
        if seq == 2:
            raise RuntimeError("lookup broke")
        return "swarming" if device_id == 7 else None

    bridge = make_bridge(link, truth_lookup=truth)
    bridge.feed(encode_frame(7, 1, 1, READINGS) + encode_frame(7, 2, 1, READINGS) + encode_frame(8, 1, 1, READINGS))
    assert wait_for(lambda: len(link.events()) == 2)
    assert [(e.device, e.truth) for _, e in link.events()] == [("hive-0007", "swarming"), ("hive-0008", None)]
    bridge.stop()
    assert bridge.counters()["rejected"] == 1


@pytest.mark.timeout(30)
def test_weight_drop_uses_the_previous_frame_of_the_same_device(link):
    bridge = make_bridge(link)
    bridge.feed(encode_frame(7, 1, 1000, READINGS) + encode_frame(8, 1, 1000, {**READINGS, "hive_weight_kg": 30.0})
                + encode_frame(7, 2, 1300, {**READINGS, "hive_weight_kg": 38.0}))
    assert wait_for(lambda: len(link.events()) == 3)
    last = link.events()[-1][1]
    assert last.flags == ["hive_weight_drop"] and last.severity is Severity.CRITICAL
    bridge.stop()


@pytest.mark.timeout(30)
def test_device_without_clock_gets_receive_time(link):
    bridge = make_bridge(link)
    before = time.time()
    bridge.feed_datagram(encode_frame(7, 1, 0, READINGS))
    assert wait_for(lambda: len(link.events()) == 1)
    assert before <= link.events()[0][1].timestamp <= time.time()
    bridge.stop()


@pytest.mark.timeout(30)
def test_datagrams_do_not_carry_partial_frames_over(link):
    bridge = make_bridge(link)
    frame = encode_frame(7, 1, 1, READINGS)
    bridge.feed_datagram(frame[:10])
    bridge.feed_datagram(frame[10:])
    bridge.feed_datagram(frame + encode_frame(7, 2, 1, READINGS))
    assert wait_for(lambda: len(link.events()) == 2)
    c = bridge.counters()
    assert c["truncated"] >= 1 and c["frames_ok"] == 2 and c["duplicates"] == 0
    bridge.stop()


@pytest.mark.timeout(60)
def test_past_the_memory_buffer_frames_spill_to_disk_and_none_is_dropped(link, tmp_path):
    """A burst past buffer_size used to drop frames with the broker up or down (#15, observation 7)."""
    bridge = durable_bridge(link, tmp_path, buffer_size=10)
    link.set_link(False)
    for seq in range(1000):
        assert bridge.feed(encode_frame(7, seq, 1000 + seq, READINGS)) == 1
    c = bridge.counters()
    assert (c["buffered"], c["spilled"], c["dropped"]) == (10, 990, 0)
    link.set_link(True)
    assert wait_for(lambda: len(link.events()) == 1000, timeout=30)
    assert [e.seq for _, e in link.events()] == list(range(1000))
    assert bridge.stop() and bridge.counters()["spilled"] == 0


@pytest.mark.timeout(60)
def test_frames_unpublished_at_stop_are_published_by_the_next_start_in_order(link, tmp_path):
    bridge = durable_bridge(link, tmp_path, buffer_size=10)
    link.set_link(False)
    bridge.feed(b"".join(encode_frame(7, seq, 1000 + seq, READINGS) for seq in range(30)))
    assert not bridge.stop(drain_timeout=0.2)  # the link is down: kept on disk, not lost
    again = durable_bridge(MemoryLink(up=False), tmp_path, buffer_size=10)
    again.feed(encode_frame(7, 30, 1030, READINGS))
    again.feed(encode_frame(7, 5, 1005, READINGS))  # published before? no, but already accepted: a duplicate
    assert again.counters()["duplicates"] == 1
    again.transport.set_link(True)
    assert wait_for(lambda: len(again.transport.events()) == 31, timeout=30)
    assert [e.seq for _, e in again.transport.events()] == list(range(31))
    assert again.stop()


@pytest.mark.timeout(60)
def test_replayed_frames_are_never_published_twice_even_after_a_restart(link, tmp_path):
    """Replaying seq 1-50 after seq 500 re-published all 50 (#15, observation 6)."""
    bridge = durable_bridge(link, tmp_path)
    recorded = [encode_frame(7, seq, 1_750_000_000 + seq, READINGS) for seq in range(451, 501)]
    old = [encode_frame(7, seq, 1_749_000_000 + seq, READINGS) for seq in range(1, 51)]
    bridge.feed(b"".join(recorded))
    bridge.feed(b"".join(old))
    assert wait_for(lambda: len(link.events()) == 50) and bridge.wait_idle(5)
    assert bridge.counters()["replayed"] == 50
    assert bridge.stop()
    fresh = MemoryLink()
    again = durable_bridge(fresh, tmp_path)
    again.feed(b"".join(recorded) + b"".join(old))  # the same frames after a bridge restart
    again.feed(encode_frame(7, 501, 1_750_000_501, READINGS))
    again.feed(encode_frame(7, 0, 1_750_000_900, READINGS, boot=1))  # a reboot the device says it had
    again.feed(encode_frame(7, 500, 1_750_000_500, READINGS))  # and the boot before it is over
    assert wait_for(lambda: len(fresh.events()) == 2) and again.wait_idle(5)
    time.sleep(0.1)
    assert [e.seq for _, e in fresh.events()] == [501, 0]
    c = again.counters()
    assert (c["duplicates"], c["replayed"], c["restarts"]) == (50, 51, 1)
    assert again.stop()


@pytest.mark.timeout(60)
def test_a_full_disk_drops_loudly_and_the_bridge_keeps_going(link, tmp_path, caplog):
    bridge = durable_bridge(link, tmp_path, buffer_size=5)
    link.set_link(False)
    pages = bridge.store._db.execute("PRAGMA page_count").fetchone()[0]
    bridge.store._db.execute(f"PRAGMA max_page_count = {pages}")  # the disk is full from now on
    with caplog.at_level("ERROR"):
        for seq in range(200):
            bridge.feed(encode_frame(7, seq, 1000 + seq, READINGS))
    c = bridge.counters()
    assert c["buffered"] == 5 and c["dropped"] + c["spilled"] == 195 and c["dropped"] > 0
    assert any("frames dropped" in r.getMessage() for r in caplog.records)
    bridge.store._db.execute("PRAGMA max_page_count = 1000000")  # space again
    bridge.feed(encode_frame(7, 500, 1500, READINGS))
    link.set_link(True)
    assert wait_for(lambda: len(link.events()) == 6 + c["spilled"], timeout=30)
    assert [e.seq for _, e in link.events()][-1] == 500
    assert bridge.stop()
