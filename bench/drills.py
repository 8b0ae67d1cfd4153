"""Crash and restart drills through the real processes: per drill, events sent / answered / answered twice / lost.

* ``cloud-kill``: `apiary cloud serve` is killed with SIGKILL while it computes critical escalations,
  then restarted (same worker id, same database).
* ``broker-restart``: Mosquitto restarts while the cloud is frozen (SIGSTOP), so the edge is back
  first and escalates to a broker with no cloud connected; then the cloud thaws.
* ``edge-kill``: the cloud is away; `apiary edge run` escalates, is killed with SIGKILL with its
  escalations unanswered, restarts, and only then does the cloud come back.
* ``bridge-burst``: `apiary simulate run --rate 0` sends a burst of frames as fast as it can to
  `apiary bridge udp` (with its state file), on a live broker.

For the first three every event is critical, so the edge answers locally, escalates, and only the
cloud's answer is final: "answered" counts final answers per event on the answer topic. For the
burst, "answered" counts sensor events published, once per (device, seq). The target in every row
is 0 lost and 0 answered twice.
"""
from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import typer

DRILLS = ("cloud-kill", "broker-restart", "edge-kill", "bridge-burst")
SITE, DEVICE = "drill", "hive-0001"
ROOT = Path(__file__).resolve().parents[1]


def _wait(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def _apiary(args: list[str], log: Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "APIARY_LOG_FORMAT": "text", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "apiary", *args], cwd=cwd, env=env, stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT)


class Watch:
    """An operator's view of the broker (persistent session): answers, escalations, events and states."""

    def __init__(self, config: Any, name: str) -> None:
        from apiary.shared import topics
        from apiary.shared.transport import MqttTransport

        self.lock = threading.Lock()
        self.answers: collections.Counter[tuple[str, int]] = collections.Counter()
        self.answer_tiers: collections.Counter[str] = collections.Counter()
        self.escalated: set[int] = set()
        self.events: collections.Counter[tuple[str, int]] = collections.Counter()
        self.births = 0
        self.transport = MqttTransport(config, name, persistent=True)
        self.transport.subscribe(topics.all_of("answer", SITE), self._answer)
        self.transport.subscribe(topics.all_of("escalate", SITE), self._escalation)
        self.transport.subscribe(topics.state(SITE, DEVICE), self._state)
        self.transport.subscribe(topics.all_of("event"), self._event, dedup=False)
        self.transport.start(30)

    def _answer(self, topic: str, env: Any) -> None:
        with self.lock:
            self.answers[(env.body.device, env.body.event_seq)] += 1
            self.answer_tiers[env.body.tier] += 1

    def _escalation(self, topic: str, env: Any) -> None:
        with self.lock:
            self.escalated.add(env.body.event.seq)

    def _state(self, topic: str, env: Any) -> None:
        if env.body.status == "birth":
            with self.lock:
                self.births += 1

    def _event(self, topic: str, env: Any) -> None:
        with self.lock:
            self.events[(env.body.device, env.body.seq)] += 1

    def close(self) -> None:
        self.transport.stop(flush_timeout=0)


class Feeder:
    """Publishes critical events for the drill's device, each retried until the broker acknowledged it."""

    def __init__(self, config: Any) -> None:
        from apiary.shared.transport import MqttTransport

        self.transport = MqttTransport(config, "drill-feeder", persistent=True).start(30)

    def send(self, seqs: list[int]) -> None:
        from apiary.shared import topics
        from apiary.shared.protocol import SensorEvent, Severity, make

        for seq in seqs:
            body = SensorEvent(site=SITE, device=DEVICE, seq=seq, timestamp=time.time(), severity=Severity.CRITICAL,
                               flags=["hive_temp_c_high"],
                               readings={"hive_temp_c": 40.5 + seq / 10, "hive_humidity_pct": 41.0,
                                         "ambient_temp_c": 39.0, "hive_weight_kg": 41.0, "acoustic_db": 61.0,
                                         "acoustic_freq_hz": 300.0, "bee_traffic": 1500.0, "battery_v": 3.9,
                                         "solar_w": 6.0})
            env = make(body, sender="drill-feeder")
            _wait(lambda: self.transport.publish(topics.event(SITE, DEVICE), env, timeout=5.0), 120,
                  f"the broker to take event {seq}")

    def close(self) -> None:
        self.transport.stop(flush_timeout=0)


@dataclass
class Stage:
    """One drill's processes in one folder: Mosquitto, the cloud and the edge, started and killed on demand."""

    folder: Path
    broker: Any = None
    cloud: subprocess.Popen | None = None
    edge: subprocess.Popen | None = None
    cloud_starts: int = 0
    notes: list[str] = field(default_factory=list)

    def start_broker(self) -> Any:
        from apiary.shared.brokers import MosquittoBroker

        self.broker = MosquittoBroker(data_dir=self.folder / "mosquitto")
        self.broker.start()
        return self.broker.config.model_copy(update={"reconnect_min_s": 0.1, "reconnect_max_s": 0.5})

    def start_cloud(self, timeout: float = 300.0) -> None:
        log = self.folder / "cloud.log"
        before = log.stat().st_size if log.exists() else 0
        self.cloud = _apiary(["cloud", "serve", "--port", "0", "--broker", self.broker.config.url,
                              "--db", str(self.folder / "cloud.db"), "--worker-id", "drill-cloud",
                              "--api-key-file", str(self.folder / "keys.jsonl"),
                              "--images", str(self.folder / "images")], log, self.folder)
        self.cloud_starts += 1

        def up() -> bool:
            if self.cloud.poll() is not None:
                raise RuntimeError(f"the cloud exited: {log.read_text()[-2000:]}")
            return "listening on http" in log.read_text()[before:]

        _wait(up, timeout, "the cloud service")

    def start_edge(self) -> None:
        cfg = self.folder / "edge.toml"
        cfg.write_text('[edge]\nthreads = 1\nescalation_deadline_s = 900\n[mqtt]\nreconnect_max_s = 0.5\n')
        self.edge = _apiary(["edge", "run", "--site", SITE, "--device", DEVICE, "--broker", self.broker.config.url,
                             "--state-dir", str(self.folder / "edge"), "--config", str(cfg)],
                            self.folder / "edge.log", self.folder)

    def claims(self) -> dict[str, str]:
        """request id -> claim state in the cloud's database ('pending' while computed, 'done')."""
        path = self.folder / "cloud.db"
        if not path.exists():
            return {}
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
        try:
            return dict(db.execute("SELECT request_id, state FROM escalations"))
        except sqlite3.OperationalError:
            return {}
        finally:
            db.close()

    @staticmethod
    def kill(proc: subprocess.Popen | None) -> None:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)

    def close(self) -> None:
        for proc in (self.edge, self.cloud):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.kill(proc)
        if self.broker is not None:
            self.broker.close()


def _count(stage: Stage, watch: Watch, seqs: list[int], drain: float) -> tuple[int, int, int]:
    """Wait up to ``drain`` for a final answer to every event; then (answered, answered twice, lost)."""
    want = {(DEVICE, s) for s in seqs}
    try:
        _wait(lambda: want <= set(watch.answers), drain, "an answer to every event")
    except TimeoutError:
        pass
    time.sleep(3.0)  # a second answer would arrive now
    with watch.lock:
        answered = sum(1 for k in want if watch.answers[k])
        twice = sum(1 for k in want if watch.answers[k] > 1)
        tiers = ", ".join(f"{n} by the {tier}" for tier, n in sorted(watch.answer_tiers.items()))
    stage.notes.append(f"answers: {tiers or 'none'}")
    return answered, twice, len(want) - answered


@contextlib.contextmanager
def _mesh(stage: Stage, *, cloud_away: bool = False) -> Iterator[tuple[Watch, Feeder]]:
    """Broker, cloud (killed again when ``cloud_away``) and an edge that announced itself; a watcher and a feeder."""
    config = stage.start_broker()
    watch, feeder = Watch(config, "drill-watch"), Feeder(config)
    try:
        stage.start_cloud()
        if cloud_away:
            stage.kill(stage.cloud)  # escalations wait for it
        stage.start_edge()
        _wait(lambda: watch.births >= 1, 180, "the edge's birth")
        yield watch, feeder
    finally:
        feeder.close()
        watch.close()


def drill_cloud_kill(stage: Stage, n: int, drain: float) -> tuple[int, int, int]:
    with _mesh(stage) as (watch, feeder):
        seqs = list(range(1, n + 1))
        feeder.send(seqs)
        _wait(lambda: "pending" in stage.claims().values(), 300, "the cloud computing an escalation")
        stage.kill(stage.cloud)
        stage.notes.append(f"killed with {list(stage.claims().values()).count('pending')} claims pending")
        stage.start_cloud()
        return _count(stage, watch, seqs, drain)


def drill_broker_restart(stage: Stage, n: int, drain: float) -> tuple[int, int, int]:
    with _mesh(stage) as (watch, feeder):
        feeder.send([1])
        _wait(lambda: (DEVICE, 1) in watch.answers, 300, "the first answer")
        stage.cloud.send_signal(signal.SIGSTOP)  # the cloud notices the restart only after the edge is back
        births = watch.births
        stage.broker.restart()
        _wait(lambda: watch.births > births, 120, "the edge back on the broker")
        seqs = list(range(2, n + 2))
        feeder.send(seqs)
        _wait(lambda: set(seqs) <= watch.escalated, 300, "the escalations at the broker, no cloud connected")
        stage.notes.append("edge back and escalating before the cloud")
        stage.cloud.send_signal(signal.SIGCONT)
        return _count(stage, watch, [1, *seqs], drain)


def drill_edge_kill(stage: Stage, n: int, drain: float) -> tuple[int, int, int]:
    with _mesh(stage, cloud_away=True) as (watch, feeder):
        seqs = list(range(1, n + 1))
        feeder.send(seqs)
        _wait(lambda: set(seqs) <= watch.escalated, 300, "every escalation sent")
        stage.kill(stage.edge)
        stage.notes.append(f"edge killed with {n} escalations unanswered")
        stage.start_edge()
        _wait(lambda: watch.births >= 2, 180, "the edge's second birth")
        stage.start_cloud()
        return _count(stage, watch, seqs, drain)


def drill_bridge_burst(stage: Stage, frames: int, drain: float, buffer: int) -> tuple[int, int, int]:
    import json

    config = stage.start_broker()
    watch = Watch(config, "drill-watch")
    try:
        bridge_log = stage.folder / "bridge.log"
        bridge = _apiary(["bridge", "udp", "--host", "127.0.0.1", "--port", "0", "--broker",
                          stage.broker.config.url, "--name", "drill-bridge", "--site", SITE], bridge_log, stage.folder,
                         env={"APIARY__BRIDGE__BUFFER_SIZE": str(buffer)} if buffer else None)
        port = 0

        def listening() -> bool:
            nonlocal port
            if bridge.poll() is not None:
                raise RuntimeError(f"the bridge exited: {bridge_log.read_text()[-2000:]}")
            found = re.search(r"listening on udp://127\.0\.0\.1:(\d+)", bridge_log.read_text())
            port = int(found.group(1)) if found else 0
            return bool(port)

        _wait(listening, 60, "the UDP bridge")
        sim = subprocess.run([sys.executable, "-m", "apiary", "simulate", "run", "--rate", "0", "--count",
                              str(frames), "--udp", f"127.0.0.1:{port}"], cwd=stage.folder,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
        if sim.returncode != 0:
            raise RuntimeError(f"the simulator failed: {sim.stderr[-2000:]}")
        try:
            _wait(lambda: len(watch.events) >= frames, drain, "every frame published")
        except TimeoutError:
            pass
        time.sleep(2.0)
        bridge.send_signal(signal.SIGTERM)
        bridge.wait(60)
        counters = json.loads([ln for ln in bridge_log.read_text().splitlines() if ln.startswith("{")][-1])
        stage.notes.append(f"bridge: {counters.get('dropped', 0)} dropped, peak {counters.get('max_buffered', 0)} "
                           f"in memory (buffer {buffer or 'default'}, the rest spilled to disk), "
                           f"{counters.get('frames_ok', 0)} frames decoded")
        with watch.lock:
            published = len(watch.events)
            twice = sum(1 for c in watch.events.values() if c > 1)
        return published, twice, frames - published
    finally:
        watch.close()


def command(
    drills: str = typer.Option(",".join(DRILLS), help="comma-separated: " + ", ".join(DRILLS)),
    events: int = typer.Option(3, help="critical events per crash drill"),
    burst: int = typer.Option(20_000, help="frames in the bridge burst"),
    bridge_buffer: int = typer.Option(0, help="the bridge's memory buffer (frames) for the burst; past it frames "
                                              "spill to its state file [0: the bridge's default, 10,000]"),
    drain: float = typer.Option(600.0, help="seconds to wait for every answer after a drill"),
    results: Path = typer.Option(Path("results/bench/drills"), help="run folder (logs, databases)"),
) -> None:
    from apiary.bench.common import report
    from apiary.shared.logs import configure

    configure(level="WARNING", fmt="text")
    chosen = [d.strip() for d in drills.split(",") if d.strip()]
    unknown = sorted(set(chosen) - set(DRILLS))
    if unknown:
        raise typer.BadParameter(f"unknown drills {unknown}; choose from {', '.join(DRILLS)}")
    run_dir = (results / time.strftime("%Y%m%d-%H%M%S")).resolve()
    rows: list[list[Any]] = []
    for name in chosen:
        stage = Stage(run_dir / name)
        stage.folder.mkdir(parents=True, exist_ok=True)
        sent = burst if name == "bridge-burst" else events + (1 if name == "broker-restart" else 0)
        print(f"[drills] {name}: {sent} {'frames' if name == 'bridge-burst' else 'critical events'}", flush=True)
        t0 = time.monotonic()
        try:
            if name == "cloud-kill":
                answered, twice, lost = drill_cloud_kill(stage, events, drain)
            elif name == "broker-restart":
                answered, twice, lost = drill_broker_restart(stage, events, drain)
            elif name == "edge-kill":
                answered, twice, lost = drill_edge_kill(stage, events, drain)
            else:
                answered, twice, lost = drill_bridge_burst(stage, burst, drain, bridge_buffer)
        except (TimeoutError, RuntimeError) as e:
            answered, twice, lost = 0, 0, sent
            stage.notes.append(f"FAILED: {e}")
        finally:
            stage.close()
        rows.append([name, sent, answered, twice, lost, time.monotonic() - t0, "; ".join(stage.notes)])
    report("drills", "Crash and restart drills (target: 0 lost, 0 answered twice)",
           ["drill", "sent", "answered", "answered twice", "lost", "seconds", "notes"], rows,
           extra={"run_dir": str(run_dir)})
    if any(r[3] or r[4] for r in rows):
        raise typer.Exit(1)
