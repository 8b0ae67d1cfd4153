"""The README as a newcomer follows it: what it tells them to type works as written."""
from __future__ import annotations

import json
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

from apiary.cloud.settings import CloudSettings
from apiary.shared import topics
from apiary.shared.brokers import free_port, wait_for_port
from apiary.shared.config import MqttConfig
from apiary.shared.hostname import host_name
from apiary.shared.protocol import Envelope
from apiary.shared.transport import MqttTransport
from tests.apiary.test_demo import check_a_whole_run

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DEMO_DEVICES = 6  # `apiary demo`'s default fleet: 3 sites x 2 hives, one edge agent each
# The demo's --duration in the step 1 test: long enough for step 2's two blocks to run against it. The traffic
# starts while the cloud loads: under the AVX2 rehearsal beside another test worker the cloud was up after 29 s of
# a 40 s run, its answers took ~15 s each, and step 2's Python block found the demo gone.
STEP_1_TRAFFIC_S = 60


def walkthrough_step(n: int, lang: str = "bash") -> str:
    """The shell block of the README's walk-through step ``n`` (its first ```bash block, or ```lang)."""
    text = README.read_text()
    start, end = text.index(f"**{n}. "), text.find(f"**{n + 1}. ")
    block = re.search(rf"```{lang}\n(.*?)```", text[start:end if end > 0 else None], re.S)
    assert block, f"step {n} has no {lang} block"
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


def _stop_group(proc: subprocess.Popen, broker_port: int | None, grace_s: float = 60.0) -> None:
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
    # `apiary broker` stops it on SIGTERM; this is for a SIGKILL above
    for pid in _mosquittos_on(broker_port) if broker_port is not None else ():
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


NOISE = ("Client is not connected", "terminate called", "Traceback", "Aborted")  # never at a clean shutdown


def _json_documents(text: str) -> list:
    """The JSON documents curl printed one after another (no newline between them)."""
    decoder, docs, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        doc, i = decoder.raw_decode(text, i)
        docs.append(doc)
    return docs


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_steps_1_and_2_run_as_written_and_answers_arrive(tmp_path: Path) -> None:
    """Step 1's block run by bash in a fresh folder, with a short --duration added; while it runs, step 2's curl
    block (bash, with the URL and KEY the demo's `export` line gives) and its Python block. The demo answers every
    event that needed one before it exits, says so in its summary, and no component logs error noise; the run
    shows everything test_demo.check_a_whole_run asks (both tiers, the rollout, no process left)."""
    demo = walkthrough_step(1)
    assert re.match(r"\.venv/bin/apiary demo\b", demo.strip()), demo
    script = re.sub(r"(\.venv/bin/apiary demo)\b", rf"\1 --duration {STEP_1_TRAFFIC_S}", demo, count=1)
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")  # the block's paths are relative to a checkout
    log = tmp_path / "step1.log"
    proc = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    python_block = None
    try:
        deadline = time.monotonic() + 180
        while not (m := re.search(r"^shell (export URL=(\S+) KEY=(\S+))$", log.read_text(), re.M)):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        export, url, key = m.groups()
        # step 2's two blocks at once, as two terminals would (each waits on a chat answer)
        code = f"import os\nURL, KEY = os.environ['URL'], os.environ['KEY']\n{walkthrough_step(2, 'python')}"
        python_block = subprocess.Popen([str(ROOT / ".venv/bin/python"), "-c", code], cwd=tmp_path,
                                        env={**os.environ, "URL": url, "KEY": key}, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        step2 = subprocess.run(["bash", "-c", f"{export}\n{walkthrough_step(2)}"], cwd=tmp_path,
                               capture_output=True, text=True, timeout=180)  # the export line pasted first
        assert step2.returncode == 0, step2.stderr
        chat, devices, escalations = _json_documents(step2.stdout)
        assert chat["choices"][0]["message"]["content"].strip(), chat
        assert len(devices) >= 6 and all(d["site"] and d["device"] for d in devices), devices
        assert isinstance(escalations, list) and len(escalations) <= 5
        printed, errors = python_block.communicate(timeout=180)
        assert python_block.returncode == 0 and printed.strip(), errors
        assert proc.wait(300) == 0, log.read_text()[-4000:]
    finally:
        if python_block is not None and python_block.poll() is None:
            python_block.kill()
        if proc.poll() is None:
            _stop_group(proc, None)
    out = log.read_text()
    row = re.search(r"answered / needing an answer\s*│\s*(\d+) / (\d+)", out)
    assert row and int(row.group(2)) > 0 and row.group(1) == row.group(2), out[-4000:]
    [summary_path] = (tmp_path / "results" / "demo").glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["unanswered"] == 0 and summary["left_unanswered"] == [] and summary["drain"]["complete"]
    assert summary["first_answer_after_launch_s"] is not None and summary["answers_by_tier"].get("edge", 0) > 0
    check_a_whole_run(summary_path.parent, out, DEMO_DEVICES)  # everything tests/apiary/test_demo.py asks of a run
    for path in [log, *summary_path.parent.glob("logs/*.log")]:
        noisy = [line for line in path.read_text(errors="replace").splitlines() if any(n in line for n in NOISE)]
        assert not noisy, (path.name, noisy)
