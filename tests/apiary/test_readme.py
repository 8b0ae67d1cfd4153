"""The README as a newcomer follows it: what it tells them to type works as written."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Iterator

import pytest

from cloud.settings import CloudSettings
from shared import topics
from shared.brokers import free_port, wait_for_port
from shared.config import MqttConfig
from shared.hostname import host_name
from shared.protocol import Envelope
from shared.transport import MqttTransport

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def walkthrough_step(n: int) -> str:
    """The shell block of the README's walk-through step ``n`` (its first ```bash block)."""
    text = README.read_text()
    start, end = text.index(f"**{n}. "), text.find(f"**{n + 1}. ")
    block = re.search(r"```bash\n(.*?)```", text[start:end if end > 0 else None], re.S)
    assert block, f"step {n} has no shell block"
    return block.group(1)


def test_the_readme_asks_for_the_model_id_cloud_serve_serves() -> None:
    """Every `model` the README sends (curl, openai client) is the id `apiary cloud serve` serves by default."""
    asked = re.findall(r'\bmodel"?\s*[:=]\s*"([^"]+)"', README.read_text())
    assert len(asked) >= 2 and set(asked) == {CloudSettings().model_name}, asked


class Watcher:
    """Answers and bridge states on the walk-through's site, as they arrive."""

    def __init__(self, config: MqttConfig, site: str, device: str) -> None:
        self.answers: list[Envelope] = []
        self.bridge_states: list[Envelope] = []
        self.changed = threading.Condition()
        self.transport = MqttTransport(config, "readme-watcher", persistent=False)
        self.transport.subscribe(topics.answer(site, device), self._answer)
        self.transport.subscribe(topics.all_of("state", site), self._state)

    def _answer(self, topic: str, env: Envelope) -> None:
        with self.changed:
            self.answers.append(env)
            self.changed.notify_all()

    def _state(self, topic: str, env: Envelope) -> None:
        if env.body.role == "bridge":
            with self.changed:
                self.bridge_states.append(env)
                self.changed.notify_all()

    def wait_answer(self, timeout: float) -> Envelope | None:
        with self.changed:
            self.changed.wait_for(lambda: self.answers, timeout)
            return self.answers[0] if self.answers else None


def _stop_group(proc: subprocess.Popen, broker_port: int, grace_s: float = 60.0) -> None:
    """SIGTERM every process the block started (as Ctrl-C would stop each), wait until all are gone (SIGKILL
    after ``grace_s``), then make sure Mosquitto, in a session of its own, is gone too."""
    deadline = time.monotonic() + grace_s
    sig = signal.SIGTERM
    while True:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        proc.poll()  # reap bash itself
        time.sleep(0.5)
        sig = 0 if time.monotonic() < deadline else signal.SIGKILL
    proc.wait(10)
    for pid in _mosquittos_on(broker_port):  # `apiary broker` stops it on SIGTERM; this is for a SIGKILL above
        os.kill(pid, signal.SIGTERM)


def _mosquittos_on(port: int) -> Iterator[int]:
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if argv[0].endswith(b"mosquitto") and f"listener {port} ".encode() in Path(argv[2].decode()).read_bytes():
                yield int(entry.name)
        except (OSError, IndexError, ValueError):
            continue


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_step_3_runs_as_written_and_an_answer_arrives(tmp_path: Path, gguf_path: Path) -> None:
    """Step 3's block run by bash as it stands, in a fresh folder. Substituted, and nothing else: free ports for
    1883 (MQTT), 5683 (UDP) and 8000 (HTTP), and a pseudo-terminal for /dev/ttyUSB0 (no sensor is plugged
    in). Configured through the environment, as process-level tests do: the edge runs the registry's
    SmolLM2 on one llama.cpp thread (APIARY_CONFIG), the cloud's KV cache is 64 MB."""
    block = walkthrough_step(3)
    for command in ("broker --mosquitto", "bridge serial", "bridge udp", "edge run", "cloud serve", "simulate run"):
        assert f".venv/bin/apiary {command}" in block, command
    site, device = re.search(r"edge run --site (\S+) --device (\S+)", block).groups()
    master, slave = os.openpty()
    ports = {"1883": free_port(), "8000": free_port()}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        ports["5683"] = s.getsockname()[1]
    script = block.replace("/dev/ttyUSB0", os.ttyname(slave))
    for port, free in ports.items():
        script = re.sub(rf"\b{port}\b", str(free), script)
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")  # the block's paths are relative to a checkout
    config = tmp_path / "apiary.toml"
    config.write_text(f'[edge]\nthreads = 1\nmodel_path = "{gguf_path}"\n')
    env = {**os.environ, "APIARY_CONFIG": str(config), "APIARY__CLOUD__KV_CACHE_MB": "64"}
    log = tmp_path / "step3.log"
    proc = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, env=env, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    watcher = None
    try:
        assert wait_for_port("127.0.0.1", ports["1883"], 60, alive=lambda: proc.poll() is None), log.read_text()
        watcher = Watcher(MqttConfig(port=ports["1883"]), site, device)
        watcher.transport.start(timeout=30)
        answer = watcher.wait_answer(600)
        assert answer is not None, log.read_text()[-6000:]
        assert answer.body.status == "ok" and (answer.body.site, answer.body.device) == (site, device)
        # Two bridges on one host, each under its own default name: no session takeovers, no Last Will.
        with watcher.changed:
            states = list(watcher.bridge_states)
        names = {f"bridge-{host_name()}-serial", f"bridge-{host_name()}-udp"}
        assert {e.body.device for e in states} == names, [e.body for e in states]
        assert Counter(e.body.device for e in states if e.body.status == "birth") == dict.fromkeys(names, 1)
        assert not [e for e in states if e.body.status == "death"]
        assert proc.poll() is None, log.read_text()[-6000:]
    finally:
        if watcher is not None:
            watcher.transport.stop()
        _stop_group(proc, ports["1883"])
        os.close(master)
        os.close(slave)
