"""Crash and restart drills, end to end: the real `apiary cloud serve` (real model), a real Mosquitto, the edge agent.

At-least-once answering with exactly-once effect: whatever dies (the cloud mid-request, the
broker with the cloud back last, the edge with escalations in its outbox), every escalated
event gets exactly one final answer, from the cloud, and no request is computed twice.
The cloud runs with its defaults (a fixed worker id, a persistent session) and one database
across its restarts, as a deployment does. The in-process edge re-sends every 3 s, not its default 30 s:
the same re-send, sooner (the broker drill waits for one).
"""
from __future__ import annotations

import collections
import os
import re
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from apiary.edge.agent import EdgeAgent
from apiary.edge.settings import EdgeSettings
from apiary.shared.config import MqttConfig
from apiary.shared.protocol import SensorEvent, Severity
from tests.edge.helpers import DEVICE, SITE, RecordingModel, reading
from tests.edge.test_agent_mqtt import Bridge, Observer, agent_process, fast, outbox_rows
from tests.shared.helpers import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
WORKER = "cloud-drill"
RESEND_S = 3.0  # the in-process edge's re-send interval (default 30 s)


def critical(seq: int) -> SensorEvent:
    return reading(seq, severity=Severity.CRITICAL, flags=("hive_temp_c_high",), hive_temp_c=40.5 + seq / 10)


class CloudProcess:
    """`apiary cloud serve` with one worker id and one database across its restarts; ``kill()`` is kill -9."""

    def __init__(self, config: MqttConfig, directory: Path, model: Path) -> None:
        self.db, self.log = directory / "cloud.db", directory / "cloud.log"
        self.cmd = [sys.executable, "-c", "from apiary.cli import app; app()", "cloud", "serve", "--port", "0",
                    "--model", str(model), "--broker", config.url, "--db", str(self.db), "--worker-id", WORKER,
                    "--api-key-file", str(directory / "keys.jsonl"), "--images", str(directory / "images")]
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> "CloudProcess":
        """Start it and wait until it serves (the worker subscribed before the HTTP server came up)."""
        env = {**os.environ, "APIARY__CLOUD__KV_CACHE_MB": "64", "APIARY_LOG_FORMAT": "text",
               "PYTHONPATH": str(ROOT)}
        start = self.log.stat().st_size if self.log.exists() else 0
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=open(self.log, "ab"),
                                     stderr=subprocess.STDOUT)

        def listening() -> str | None:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            found = re.search(r"listening on (http://\S+)", self.log.read_text()[start:])
            return found.group(1) if found else None

        wait_until(lambda: listening() is not None, 120, "the cloud service up")
        self.url = listening()
        return self

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def claims(self) -> dict[str, str]:
        """request id -> claim state in the cloud's database ('pending' while computed, 'done')."""
        if not self.db.exists():
            return {}
        db = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=10)
        try:
            return dict(db.execute("SELECT request_id, state FROM escalations"))
        except sqlite3.OperationalError:  # the schema is not there yet
            return {}
        finally:
            db.close()

    def computed(self) -> float:
        """Escalations this process computed to an "ok" answer (its Prometheus counter)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        found = re.search(r'^apiary_escalations_total\{outcome="ok"\} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0


@pytest.fixture
def cloud(mosquitto, tmp_path: Path, gguf_path: Path):
    process = CloudProcess(fast(mosquitto.config), tmp_path, gguf_path)
    yield process
    process.close()


@pytest.fixture
def mesh(mosquitto, tmp_path: Path):
    """An observer and a bridge on the broker; an in-process edge agent (recording model) started by the test."""
    config = fast(mosquitto.config)
    observer, bridge, agents = Observer(config), Bridge(config), []

    def agent() -> EdgeAgent:
        settings = EdgeSettings(threads=1, state_dir=str(tmp_path / "state"), escalation_deadline_s=600.0,
                                escalation_resend_s=RESEND_S)
        agents.append(EdgeAgent(settings, site=SITE, device=DEVICE, mqtt=config, model=RecordingModel()).start())
        return agents[-1]

    yield observer, bridge, agent
    for a in agents:
        a.stop()
    bridge.stop()
    observer.transport.stop()


def answered_once_by_the_cloud(observer: Observer, agent: EdgeAgent, seqs: list[int]) -> None:
    wait_until(lambda: set(observer.answers_by_seq()) >= set(seqs), 180,
               f"answers for {seqs} (have {sorted(observer.answers_by_seq())})")
    assert observer.answers_by_seq() == collections.Counter(seqs)
    assert {e.body.tier for e in observer.answers.envs} == {"cloud"}
    # one final answer per escalation at the edge, however many cloud replies came
    counters = agent.store.counters()
    assert counters.get("answered_cloud") == len(seqs) and "answered_fallback" not in counters


def test_cloud_killed_mid_request_answers_after_its_restart_exactly_once(cloud, mesh) -> None:
    observer, bridge, start_agent = mesh
    cloud.start()
    agent = start_agent()
    for seq in (1, 2):
        bridge.send(critical(seq))
    wait_until(lambda: len(cloud.claims()) == 2, 120, "both escalations claimed by the cloud")
    cloud.kill()
    at_kill = cloud.claims()
    assert "pending" in at_kill.values(), at_kill  # killed mid-request
    cloud.start()  # same worker id, same database
    answered_once_by_the_cloud(observer, agent, [1, 2])
    wait_until(lambda: set(cloud.claims().values()) == {"done"}, 30, "every claim finished")
    assert len(cloud.claims()) == 2
    # the restarted process computed exactly the requests the killed one left unfinished, each once
    assert cloud.computed() == list(at_kill.values()).count("pending")


def test_broker_restart_with_the_cloud_back_last_drops_nothing(cloud, mesh, mosquitto) -> None:
    observer, bridge, start_agent = mesh
    cloud.start()
    agent = start_agent()
    bridge.send(critical(1))
    wait_until(lambda: 1 in observer.answers_by_seq(), 120, "the first answer")
    cloud.proc.send_signal(signal.SIGSTOP)  # the cloud will see the broker go away only after the edge is back
    mosquitto.restart()
    wait_until(lambda: agent.transport.connected and agent.transport.stats["reconnects"] >= 1, 30,
               "the edge back on the broker")
    for seq in (2, 3):
        bridge.send(critical(seq))
    wait_until(lambda: {e.body.event.seq for e in observer.escalations.envs} >= {2, 3}, 60,
               "both escalations taken by the broker while no cloud was connected")
    cloud.proc.send_signal(signal.SIGCONT)
    answered_once_by_the_cloud(observer, agent, [1, 2, 3])


def test_edge_killed_with_escalations_in_its_outbox_delivers_them_after_restart_once(cloud, mosquitto, tmp_path: Path,
                                                                                      gguf_path: Path) -> None:
    config = fast(mosquitto.config)
    state_dir, log, cfg_file = tmp_path / "state", tmp_path / "agent.log", tmp_path / "apiary.toml"
    cfg_file.write_text(f'[edge]\nthreads = 1\nmodel_path = "{gguf_path}"\nescalation_deadline_s = 600\n'
                        "[mqtt]\nreconnect_max_s = 0.5\n")
    observer, bridge = Observer(config), Bridge(config)
    agent = None
    try:
        cloud.start()
        cloud.kill()  # the cloud is away: the escalations wait for it at the broker, or nowhere
        agent = agent_process(config, state_dir, cfg_file, log)
        wait_until(lambda: observer.state("birth", 1) is not None, 60, "the edge's birth (session 1)")
        for seq in (1, 2):
            bridge.send(critical(seq))
        wait_until(lambda: {e.body.event.seq for e in observer.escalations.envs} == {1, 2}, 90, "both escalations")
        assert sorted(kind for _, kind in outbox_rows(state_dir)) == ["escalation"] * 2
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        agent = agent_process(config, state_dir, cfg_file, log)  # the edge is back before the cloud
        wait_until(lambda: observer.state("birth", 2) is not None, 60, "the edge's birth (session 2)")
        cloud.start()
        wait_until(lambda: set(observer.answers_by_seq()) == {1, 2}, 180,
                   f"answers for [1, 2] (have {sorted(observer.answers_by_seq())})")
        assert observer.answers_by_seq() == collections.Counter([1, 2])
        assert {e.body.tier for e in observer.answers.envs} == {"cloud"}
        wait_until(lambda: outbox_rows(state_dir) == [], 30, "an empty outbox")
        assert set(cloud.claims().values()) == {"done"} and len(cloud.claims()) == 2
        assert cloud.computed() == 2  # each escalation computed once, by the restarted cloud
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(30) == 0, log.read_text()[-3000:]
        counters = dict(sqlite3.connect(f"file:{state_dir / f'{SITE}.{DEVICE}.sqlite3'}?mode=ro", uri=True)
                        .execute("SELECT key, value FROM meta"))
        assert counters["answered_cloud"] == 2 and "answered_fallback" not in counters
    finally:
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait(10)
        bridge.stop()
        observer.transport.stop()
