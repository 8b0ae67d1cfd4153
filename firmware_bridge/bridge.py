"""The bridge process: decoded frames in, validated sensor events out to MQTT.

Two threads and a bounded queue between them. The *reader* (whatever source calls
:meth:`Bridge.feed` / :meth:`Bridge.feed_datagram`) only decodes, checks sequence
numbers and appends to the outbox, so it never waits on the network. The *publisher*
thread maps frames to :class:`SensorEvent` (severity from thresholds), publishes QoS 1
to the device's event topic while the link is up, and otherwise lets the outbox fill.
With a :class:`~firmware_bridge.store.BridgeStore` (the CLI bridges' default) frames past
the memory buffer spill to SQLite and are published from there in order, and sequence
windows survive restarts (a replayed frame is never published twice); without one, when
the outbox is full the oldest frame is dropped and counted: fresh readings matter more
than old ones. The bridge announces itself with a retained birth state (and a
Last Will death) and publishes its counters every ``state_interval_s``.
"""
from __future__ import annotations

import itertools
import sqlite3
import threading
import time
import uuid
from collections import deque
from typing import Callable, Protocol

from apiary.shared import topics
from apiary.shared.config import MqttConfig
from apiary.shared.logs import get_logger
from apiary.shared.protocol import DeviceState, Envelope, SensorEvent, make

from apiary.firmware_bridge.events import frame_to_event
from apiary.firmware_bridge.frames import Frame
from apiary.firmware_bridge.sequence import SequenceTracker, Verdict
from apiary.firmware_bridge.settings import BridgeSettings
from apiary.firmware_bridge.store import BridgeStore
from apiary.firmware_bridge.stream import StreamReader

log = get_logger(__name__)

TruthLookup = Callable[[int, int], "str | None"]  # (device_id, seq) -> ground-truth label; simulation only
LATENCY_SAMPLES = 100_000
SPILL_READ = 1024  # spilled frames read back into memory at a time
Queued = tuple[Frame, float, float, "int | None"]  # frame, received (monotonic), received (wall), spill row


class Publisher(Protocol):
    """What the bridge needs from ``apiary.shared.transport.MqttTransport``."""

    @property
    def connected(self) -> bool: ...

    def publish(self, topic: str, env: Envelope, *, qos: int = 1, retain: bool = False,
                timeout: float | None = None) -> bool: ...

    def add_link_listener(self, fn: Callable[[bool], None]) -> None: ...


class Bridge:
    """Frames to events. ``truth_lookup`` fills ``SensorEvent.truth`` and exists only for the
    simulator driving the bridge in-process (demo and evaluation); real devices never have it."""

    def __init__(self, settings: BridgeSettings, transport: Publisher, *, truth_lookup: TruthLookup | None = None,
                 session: int | None = None, store: BridgeStore | None = None) -> None:
        self.settings = settings
        self.transport = transport
        self.truth_lookup = truth_lookup
        self.session = session if session is not None else int(time.time())
        self.reader = StreamReader()
        self.sequence = SequenceTracker()
        self.store = store
        if store is not None:
            self.sequence.restore(store.devices())
        self.latencies: deque[float] = deque(maxlen=LATENCY_SAMPLES)  # frame received -> handed to MQTT, seconds
        self.dropped = 0
        self.published = 0
        self.rejected = 0  # frames whose event could not be built (logged); never silently lost
        self.owns_transport = False  # stop() also stops the transport (set by connect())
        self.max_buffered = 0
        self._outbox: deque[Queued] = deque()
        self._history: dict[int, tuple[float, dict[str, float]]] = {}
        # envelope ids: a random per-run prefix and a counter (uuid4 per event costs a syscall each)
        self._id_prefix = uuid.uuid4().hex[:16]
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._busy = False  # the publisher holds frames taken from the outbox
        self._link_up = bool(transport.connected)
        self._birth_due = True
        self._stopping = False
        self._thread: threading.Thread | None = None
        transport.add_link_listener(self._on_link)

    # -- reader side ----------------------------------------------------------------------------
    def feed(self, data: bytes | bytearray | memoryview, *, received: float | None = None) -> int:
        """Bytes from a stream (serial, capture file) in any chunking; returns frames accepted."""
        return self._accept(self.reader.feed(data), received)

    def end_of_stream(self, *, received: float | None = None) -> int:
        """The stream ended or went idle: give up on a partial frame, recover what hides behind it."""
        return self._accept(self.reader.finish(), received)

    def feed_datagram(self, data: bytes | bytearray | memoryview, *, received: float | None = None) -> int:
        """One datagram holding one or more whole frames; nothing carries over to the next one."""
        frames = self.reader.feed(data)
        return self._accept(frames + self.reader.finish(), received)

    def _accept(self, frames: list[Frame], received: float | None) -> int:
        if not frames:
            return 0
        mono = time.monotonic() if received is None else received
        wall = time.time()
        fresh = []
        with self._cv:
            for f in frames:
                verdict = self.sequence.check(f.device_id, f.seq, boot=f.boot, timestamp=f.timestamp)
                if verdict.accepted:
                    fresh.append(f)
                elif verdict is Verdict.REPLAYED:
                    self._log_replay(f)
            if self.store is None:
                for f in fresh:
                    if len(self._outbox) >= self.settings.buffer_size:
                        self._outbox.popleft()
                        self.dropped += 1
                    self._outbox.append((f, mono, wall, None))
            else:
                room = 0 if self.store.unread else max(0, self.settings.buffer_size - len(self._outbox))
                self._outbox.extend((f, mono, wall, None) for f in fresh[:room])
                self._record(fresh[room:], wall)
            if len(self._outbox) > self.max_buffered:
                self.max_buffered = len(self._outbox)
            self._cv.notify()
        return len(fresh)

    def _record(self, spill: list[Frame], wall: float) -> None:
        """Windows and spilled frames to the store; a full disk drops the spilled frames, loudly."""
        assert self.store is not None
        try:
            pushed_out = self.store.record(self.sequence.take_changed(), [(f, wall) for f in spill])
        except sqlite3.Error as e:
            self.dropped += len(spill)
            log.error("bridge state file %s failed (%s): %d frames dropped, %d in all", self.store.path, e,
                      len(spill), self.dropped)
            return
        if pushed_out:
            self.dropped += pushed_out
            log.error("spill budget of %d bytes full: the %d oldest spilled frames dropped, %d in all",
                      self.store.spill_budget_bytes, pushed_out, self.dropped)

    def _log_replay(self, frame: Frame) -> None:
        n = self.sequence.counters.replayed
        if n & (n - 1) == 0:  # 1st, 2nd, 4th, 8th ...: loud at first, never a flood
            how = f"boot {frame.boot}" if frame.boot is not None else "no boot counter"
            log.warning("device %d seq %d (%s) is a replay or older than frames already published: dropped "
                        "(%d so far). Firmware that reboots must send its boot counter (docs/frames.md).",
                        frame.device_id, frame.seq, how, n)

    # -- publisher side -------------------------------------------------------------------------
    def start(self) -> "Bridge":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"bridge-{self.settings.name}", daemon=True)
            self._thread.start()
        return self

    def stop(self, drain_timeout: float = 10.0) -> bool:
        """Publish what is buffered (while the link allows, up to ``drain_timeout``), then a
        retained death state. Returns True if nothing was left behind. Stop the source first."""
        if self._stopping:
            return not self._outbox
        drained = self.wait_idle(drain_timeout)
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        if self.store is not None:
            self._keep_unsent()
        if self.transport.connected:
            try:
                self._publish_state("death", timeout=5.0)
            except Exception as e:  # stopping must not fail because the link is going away
                log.warning("could not publish the bridge's death state: %s", e)
        if self.owns_transport:
            self.transport.stop()  # type: ignore[attr-defined]
        if self.store is not None:
            self.store.close()
        return drained

    def _keep_unsent(self) -> None:
        """Frames only in memory go to the store, in order, for the next start to publish."""
        assert self.store is not None
        with self._cv:
            items = list(self._outbox)
            self._outbox.clear()
        first_spilled = next((i for i, item in enumerate(items) if item[3] is not None), len(items))
        older = [(f, wall) for f, _, wall, row in items[:first_spilled]]
        newer = [(f, wall) for f, _, wall, row in items[first_spilled:] if row is None]
        try:
            self.store.record(self.sequence.take_changed())
            self.store.keep_unsent(older, newer)
        except sqlite3.Error as e:
            self.dropped += len(older) + len(newer)
            log.error("could not keep %d unpublished frames in %s: %s", len(older) + len(newer), self.store.path, e)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every accepted frame has been handed to MQTT."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._outbox or self._busy or self._unread():
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None:
                    return False
                self._cv.wait(min(left, 0.05))
        return True

    def _on_link(self, up: bool) -> None:
        with self._cv:
            self._link_up = up
            if up:
                self._birth_due = True
            self._cv.notify_all()

    def _run(self) -> None:
        interval = self.settings.state_interval_s
        next_state = time.monotonic() + interval
        while True:
            with self._cv:
                while not self._stopping and not (self._link_up and (self._outbox or self._birth_due or self._unread())) \
                        and time.monotonic() < next_state:
                    self._cv.wait(max(0.0, next_state - time.monotonic()))
                if self._stopping:
                    return
                batch = []
                if self._link_up:
                    self._read_spilled()
                    while self._outbox and len(batch) < 256:
                        batch.append(self._outbox.popleft())
                    self._busy = bool(batch)
                birth = self._birth_due and self._link_up
                if birth:
                    self._birth_due = False
            try:
                if birth:
                    self._publish_state("birth")
                if batch:
                    self._publish_batch(batch)
                if time.monotonic() >= next_state:
                    if self._link_up:
                        self._publish_state("update")
                    next_state = time.monotonic() + interval
            except Exception:  # the transport misbehaving must not kill the publisher; frames were re-queued
                log.exception("bridge publisher error; retrying")
                time.sleep(0.5)

    def _unread(self) -> bool:
        return self.store is not None and self.store.unread > 0

    def _read_spilled(self) -> None:
        """Refill memory from the spill table (in order) once memory has drained to half."""
        if self._unread() and len(self._outbox) <= self.settings.buffer_size // 2:
            assert self.store is not None
            offset = time.monotonic() - time.time()
            self._outbox.extend((s.frame, s.received + offset, s.received, s.row) for s in self.store.take(SPILL_READ))

    def _publish_batch(self, batch: list[Queued]) -> None:
        i = 0
        done: list[int] = []  # spill rows whose frames are handled
        try:
            while i < len(batch):
                frame, mono, wall, row = batch[i]
                try:
                    topic, env = self._envelope(frame, wall)
                except Exception:  # a frame the mesh cannot express must not stop the bridge
                    log.exception("cannot build an event from device %d seq %d", frame.device_id, frame.seq)
                    self.rejected += 1
                    if row is not None:
                        done.append(row)
                    i += 1
                    continue
                self._wait_for_window()
                if not self.transport.publish(topic, env, qos=1):
                    break  # link went down under us: keep this frame and the rest for later
                self._remember(frame)
                self.latencies.append(time.monotonic() - mono)
                self.published += 1
                if row is not None:
                    done.append(row)
                i += 1
        finally:
            if done:
                assert self.store is not None
                self.store.done(done)
            with self._cv:
                if i < len(batch):
                    self._outbox.extendleft(reversed(batch[i:]))
                    while self.store is None and len(self._outbox) > self.settings.buffer_size:
                        self._outbox.popleft()  # still the oldest that go
                        self.dropped += 1
                    self._link_up = bool(self.transport.connected)
                self._busy = False
                self._cv.notify_all()
        if i < len(batch):
            time.sleep(0.02)  # refused while the link looked up: do not spin

    def _wait_for_window(self) -> None:
        """Keep at most ``max_in_flight`` publishes unacknowledged, so a backlog waits in the bounded,
        counted outbox rather than in the MQTT client's unbounded queue."""
        stats = getattr(self.transport, "stats", None)
        if stats is None:
            return
        limit, deadline = self.settings.max_in_flight, time.monotonic() + 5.0
        while stats["published"] - stats["acked"] >= limit and self._link_up and time.monotonic() < deadline:
            time.sleep(0.0005)

    def event_for(self, frame: Frame, received_wall: float | None = None) -> SensorEvent:
        """The event this frame becomes (uses the device's previous reading for trend rules)."""
        s = self.settings
        truth = self.truth_lookup(frame.device_id, frame.seq) if self.truth_lookup else None
        prev = self._history.get(frame.device_id)
        return frame_to_event(frame, site=s.site_of(frame.device_id), node=s.node_of(frame.device_id),
                              previous=prev, thresholds=s.thresholds, received_at=received_wall, truth=truth)

    def _envelope(self, frame: Frame, wall: float) -> tuple[str, Envelope]:
        event = self.event_for(frame, wall)
        env = make(event, sender=self.settings.name, id=f"{self._id_prefix}{next(self._ids):x}")
        return topics.event(event.site, event.device), env

    def _remember(self, frame: Frame) -> None:
        ts = float(frame.timestamp)
        prev = self._history.get(frame.device_id)
        if frame.timestamp and (prev is None or ts >= prev[0]):
            self._history[frame.device_id] = (ts, frame.readings)

    # -- state ----------------------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        with self._cv:
            buffered = len(self._outbox)
        spilled = self.store.spilled if self.store is not None else 0
        return {**self.reader.counters.as_dict(), **self.sequence.counters.as_dict(), "dropped": self.dropped,
                "buffered": buffered, "max_buffered": self.max_buffered, "spilled": spilled,
                "published": self.published, "rejected": self.rejected}

    def state(self, status: str) -> DeviceState:
        s = self.settings
        return DeviceState(site=s.default_site, device=s.name, status=status, online=status != "death",
                           session=self.session, role="bridge", counters=self.counters())

    def _publish_state(self, status: str, timeout: float | None = None) -> bool:
        s = self.settings
        env = make(self.state(status), sender=s.name)
        return self.transport.publish(topics.state(s.default_site, s.name), env, qos=1, retain=True, timeout=timeout)


def death_will(settings: BridgeSettings, session: int) -> tuple[str, Envelope]:
    """The retained Last Will the broker publishes if the bridge vanishes."""
    state = DeviceState(site=settings.default_site, device=settings.name, status="death", online=False,
                        session=session, role="bridge")
    return topics.state(settings.default_site, settings.name), make(state, sender=settings.name)


def open_store(settings: BridgeSettings) -> BridgeStore | None:
    """The bridge's state file, ``<state_dir>/<name>.db``, when ``state_dir`` is set (BridgeError if unusable)."""
    if settings.state_dir is None:
        return None
    from pathlib import Path

    return BridgeStore(Path(settings.state_dir) / f"{settings.name}.db",
                       spill_budget_bytes=int(settings.spill_budget_mb * 1024 * 1024))


def connect(settings: BridgeSettings, mqtt: MqttConfig, *, truth_lookup: TruthLookup | None = None,
            timeout: float = 10.0) -> Bridge:
    """A started bridge on a live MQTT link (persistent session, Last Will set)."""
    from apiary.shared.transport import MqttTransport

    session = int(time.time())
    transport = MqttTransport(mqtt, client_id=f"apiary-bridge-{settings.name}", persistent=True,
                              will=death_will(settings, session))
    store = open_store(settings)
    bridge = Bridge(settings, transport, truth_lookup=truth_lookup, session=session, store=store)
    bridge.owns_transport = True
    try:
        transport.start(timeout=timeout)
    except BaseException:
        if store is not None:
            store.close()
        raise
    return bridge.start()
