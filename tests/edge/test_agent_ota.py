"""OTA through the edge agent on a real Mosquitto: the command arrives on the device's ota/cmd topic, the signed image
comes over HTTP, the new model is health-checked and switched to live while events keep being answered.

Real models throughout: the shipped student (built-in) and a copy of it signed with a test key under a new
version and file name (the update), answered by llama.cpp. The refusals (tampered, downgrade, oversize, a disk
that cannot hold the update) use small signed images: they are refused before any model would load.
"""
from __future__ import annotations

import collections
import contextlib
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from typing import Iterator

import pytest

from apiary.edge.agent import EdgeAgent
from apiary.edge.settings import EdgeSettings, OtaSettings, PolicySettings
from apiary.shared import image, topics
from apiary.shared.config import MqttConfig
from apiary.shared.protocol import DeviceState, Envelope, OtaCommand, OtaStatus, SensorEvent, Severity, make
from apiary.shared.transport import MqttTransport
from tests.edge.helpers import DEVICE, SITE, FileServer, agent_process, reading
from tests.shared.helpers import Inbox, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FINAL = ("committed", "rolled_back", "refused", "failed", "deferred")
LOW_BATTERY_V, GOOD_BATTERY_V = 3.5, 3.95  # 12 % and 75 % state of charge: below and above ota.min_soc (40 %)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return image.write_keypair(tmp_path_factory.mktemp("keys"), "ota")


@pytest.fixture(scope="module")
def update(tmp_path_factory: pytest.TempPathFactory, keys: tuple[Path, Path], student_gguf: Path) -> image.ImageInfo:
    """The student again, as a new release: another file name (so answers tell the models apart), signed by the test key."""
    root = tmp_path_factory.mktemp("update")
    model = root / "student-2027.gguf"
    shutil.copyfile(student_gguf, model)
    return image.build_image(root / "edge-2027.1.0.tar", model, "2027.1.0", keys[0],
                             power_profile={"name": "test", "threads": 1, "n_ctx": 2048})


def command(info: image.ImageInfo, url: str, **override) -> OtaCommand:
    fields = dict(site=SITE, device=DEVICE, image_version=info.manifest.image_version, url=url, sha256=info.sha256,
                  signature=info.signature, size=info.size)
    return OtaCommand(**{**fields, **override})


def event(seq: int, battery_v: float = GOOD_BATTERY_V) -> SensorEvent:
    """A warning (robbing-like traffic) that the model must answer; link=never keeps every answer on the edge."""
    return reading(seq, severity=Severity.WARNING, flags=("bee_traffic_high",), bee_traffic=9000.0, battery_v=battery_v)


class Field:
    """The bridge and the operator: publishes events and OTA commands, watches answers, state and OTA status."""

    def __init__(self, config: MqttConfig) -> None:
        self.answers, self.states, self.status = Inbox(), Inbox(), Inbox()
        self.t = MqttTransport(config, "field-test", persistent=False)
        self.t.subscribe(topics.answer(SITE, DEVICE), self.answers)
        self.t.subscribe(topics.state(SITE, DEVICE), self.states)
        self.t.subscribe(topics.ota_status(SITE, DEVICE), self.status)
        self.t.start()

    def send(self, body) -> None:
        topic = topics.ota_command(SITE, DEVICE) if isinstance(body, OtaCommand) else topics.event(SITE, DEVICE)
        assert self.t.publish(topic, make(body, sender="field-test"), timeout=5)

    def answer(self, seq: int, timeout: float = 120.0) -> Envelope:
        wait_until(lambda: any(e.body.event_seq == seq for e in self.answers.envs), timeout, f"the answer to #{seq}")
        return next(e for e in self.answers.envs if e.body.event_seq == seq)

    def ask(self, seq: int, battery_v: float = GOOD_BATTERY_V) -> Envelope:
        self.send(event(seq, battery_v))
        return self.answer(seq)

    def statuses(self) -> list[OtaStatus]:
        return [e.body for e in self.status.envs]

    def phases(self) -> list[str]:
        return [s.phase for s in self.statuses() if s.phase != "downloading"]

    def final(self, n: int, timeout: float = 300.0) -> OtaStatus:
        """The n-th final status (committed, refused, ...) of this test."""
        wait_until(lambda: sum(s.phase in FINAL for s in self.statuses()) >= n, timeout, f"final OTA status #{n}")
        return [s for s in self.statuses() if s.phase in FINAL][n - 1]

    def state(self, status: str, session: int) -> DeviceState | None:
        return next((e.body for e in self.states.envs if e.body.status == status and e.body.session == session), None)

    def stop(self) -> None:
        self.t.stop()


@pytest.fixture
def field(mosquitto) -> Iterator[Field]:
    f = Field(mosquitto.config)
    yield f
    f.stop()


def stop_process(agent: subprocess.Popen, log: Path) -> None:
    agent.send_signal(signal.SIGTERM)
    try:
        assert agent.wait(60) == 0, log.read_text()[-3000:]
    except subprocess.TimeoutExpired:
        agent.kill()
        raise


def test_edge_run_takes_an_update_over_mqtt_and_switches_models_while_answering(
        mosquitto, field: Field, server: FileServer, tmp_path: Path, keys: tuple[Path, Path],
        update: image.ImageInfo, student_gguf: Path) -> None:
    """`edge run` with the shipped student: an OTA command deferred for a low battery, taken up once the battery
    recovers, a download caught half-way while events are answered and then cut by the server (resumed with a
    Range request), the health check, the live switch, the new version reported; after a restart the device runs
    the new image."""
    server.files["edge.tar"] = update.path
    state_dir, log, cfg = tmp_path / "state", tmp_path / "agent.log", tmp_path / "apiary.toml"
    cfg.write_text(f'[edge]\nthreads = 1\nmodel_path = "{student_gguf}"\n[edge.policy]\nlink = "never"\n'
                   f'[edge.ota]\npublic_key = "{keys[1].read_text().strip()}"\n[mqtt]\nreconnect_max_s = 0.5\n')
    old = f"{student_gguf.name}:{student_gguf.stat().st_size}"
    new = f"student-2027.gguf:{update.manifest.model.size}"
    agent = agent_process(mosquitto.config, state_dir, cfg, log)
    try:
        wait_until(lambda: field.state("birth", 1) is not None, 120, "the agent's birth")
        birth = field.state("birth", 1)
        assert birth.model_version == old and birth.image_version is None  # the shipped image is not the test key's

        assert field.ask(1, LOW_BATTERY_V).body.model == old
        field.send(command(update, server.url("edge.tar")))
        deferred = field.final(1)
        assert deferred.phase == "deferred" and "battery at 12%" in deferred.detail, deferred.detail
        assert not server.requests  # nothing downloaded on a low battery

        half, quarter = update.size // 2, update.size // 4
        gate = server.hold_next["edge.tar"] = (half, threading.Event())
        server.cut_next["edge.tar"] = quarter  # once released, the link drops a quarter further on
        assert field.ask(2).body.model == old  # this reading shows the battery recovered: the update goes on
        wait_until(server.held.is_set, 120, "the download to reach its middle")
        for seq in (3, 4):  # the download is stuck half-way; events are answered all the same
            assert field.ask(seq).body.model == old
        assert set(field.phases()) <= {"received", "deferred"}  # still downloading
        gate[1].set()

        seq = 4
        while not any(e.body.model == new for e in field.answers.envs):  # closed loop: one event per answer
            seq += 1
            assert seq < 60, field.phases()
            field.ask(seq)
        assert field.final(2).phase == "committed", field.statuses()[-1].detail
        assert field.phases() == ["received", "deferred", "received", "downloaded", "verified", "installed",
                                  "health_check", "committed"]
        assert "loaded in the agent, probe answered" in field.final(2).detail
        assert server.requests == [("edge.tar", None), ("edge.tar", f"bytes={half + quarter}-")]  # resumed

        by_seq = collections.Counter(e.body.event_seq for e in field.answers.envs)
        assert by_seq == collections.Counter(range(1, seq + 1)), by_seq  # every event answered, once
        models = [field.answer(s).body.model for s in range(1, seq + 1)]
        switched = models.index(new)
        assert set(models[:switched]) == {old} and set(models[switched:]) == {new}, models  # one switch, no restart
        wait_until(lambda: any(e.body.image_version == "2027.1.0" and e.body.session == 1 for e in field.states.envs),
                   60, "a state update with the new image version")
        assert field.state("death", 1) is None  # the same session throughout

        stop_process(agent, log)
        agent = agent_process(mosquitto.config, state_dir, cfg, log)
        wait_until(lambda: field.state("birth", 2) is not None, 120, "the birth after a restart")
        birth = field.state("birth", 2)
        assert (birth.image_version, birth.model_version) == ("2027.1.0", new)  # the slot, not the configured model
        assert field.ask(seq + 1).body.model == new
        assert not list((state_dir / f"{SITE}.{DEVICE}.ota" / "downloads").iterdir())
    finally:
        if agent.poll() is None:
            stop_process(agent, log)


@pytest.fixture(scope="module")
def builtin(tmp_path_factory: pytest.TempPathFactory, update: image.ImageInfo, keys: tuple[Path, Path]):
    """The device's built-in model: the 2027.1.0 image unpacked, as the shipped student is (its signed manifest
    beside the GGUF makes 2027.1.0 the version floor)."""
    from apiary.edge.model import LocalModel

    dest = tmp_path_factory.mktemp("builtin")
    image.unpack_image(update.path, dest, keys[1])
    model = LocalModel(dest / update.manifest.model.filename, n_ctx=2048, threads=1)
    yield model
    model.close()


@contextlib.contextmanager
def running_agent(config: MqttConfig, field: Field, state_dir: Path, key: Path, model, **ota) -> Iterator[EdgeAgent]:
    """An in-process agent with ``model`` built in, trusting ``key`` for OTA ([edge.ota] overrides in ``ota``)."""
    settings = EdgeSettings(threads=1, policy=PolicySettings(link="never"),
                            ota=OtaSettings(public_key=key.read_text().strip(), **ota))
    agent = EdgeAgent(settings, site=SITE, device=DEVICE, mqtt=config, model=model, state_dir=state_dir)
    agent.start()
    try:
        wait_until(lambda: field.state("birth", 1) is not None, 30, "the agent's birth")
        yield agent
    finally:
        agent.stop()


def small_signed(tmp_path: Path, key: Path, version: str) -> image.ImageInfo:
    model = tmp_path / f"src-{version}" / "model.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"GGUF" + bytes(range(256)) * 2000)
    return image.build_image(tmp_path / f"{version}.tar", model, version, key)


def tampered(info: image.ImageInfo, out: Path) -> Path:
    import tarfile

    with tarfile.open(info.path) as tar:
        at = tar.getmember(f"model/{info.manifest.model.filename}").offset_data + 1000
    data = bytearray(info.path.read_bytes())
    data[at] ^= 0xFF
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("case", ["tampered", "downgrade", "oversize", "full_disk"])
def test_refused_updates_leave_the_old_model_answering_and_nothing_on_disk(
        mosquitto, field: Field, server: FileServer, tmp_path: Path, keys: tuple[Path, Path], builtin, case: str) -> None:
    if case == "tampered":
        info = small_signed(tmp_path, keys[0], "2027.2.0")
        server.files["img.tar"] = tampered(info, tmp_path / "tampered.tar")
        cmd = command(info, server.url("img.tar"), sha256=image.sha256_file(server.files["img.tar"]))
    elif case == "downgrade":  # validly signed, only older than what runs
        info = small_signed(tmp_path, keys[0], "2026.12.0")
        server.files["img.tar"] = info.path
        cmd = command(info, server.url("img.tar"))
    else:  # the case: a command announcing 400 MB of zeros; and a small image the disk cannot hold
        zeros = tmp_path / "zeros.tar"
        zeros.write_bytes(bytes(1 << 20))
        info = small_signed(tmp_path, keys[0], "2027.2.0")
        server.files.update({"img.tar": info.path, "zeros.tar": zeros})
        cmd = (command(info, server.url("zeros.tar"), size=400_000_000) if case == "oversize"
               else command(info, server.url("img.tar")))
    expected = {"tampered": "model_hash", "downgrade": "downgrade: 2026.12.0 is older than the running 2027.1.0",
                "oversize": "too large: 400000000 bytes", "full_disk": "disk: "}[case]
    margin = shutil.disk_usage(tmp_path).total if case == "full_disk" else 64 << 20  # full: more than it has
    with running_agent(mosquitto.config, field, tmp_path / "state", keys[1], builtin, max_image_bytes=64 << 20,
                       min_free_bytes=margin) as agent:
        assert field.state("birth", 1).image_version == "2027.1.0"
        assert field.ask(1).body.model == builtin.version
        field.send(cmd)
        final = field.final(1)
        assert final.phase == "refused" and expected in final.detail, final.detail
        assert "installed" not in field.phases() and "health_check" not in field.phases()
        assert server.requests == ([("img.tar", None)] if case == "tampered" else [])  # the others: not a byte
        answer = field.ask(2)  # the old model still answers, through a store that still works
        assert answer.body.model == builtin.version and answer.body.status == "ok", answer.body
        ota_dir = tmp_path / "state" / f"{SITE}.{DEVICE}.ota"
        assert not list((ota_dir / "downloads").iterdir())  # no .part, no archive
        assert not (ota_dir / "boot.json").exists() and agent.image_version == "2027.1.0"
        assert agent.store.counters()["answered_edge"] == 2


def test_an_update_whose_model_fails_the_health_check_rolls_back_and_the_old_model_answers(
        mosquitto, field: Field, server: FileServer, tmp_path: Path, keys: tuple[Path, Path], builtin) -> None:
    """A validly signed image whose GGUF llama.cpp cannot load: the child probe fails, the switch is undone, and the
    agent never stopped answering with the model it ran."""
    broken = tmp_path / "src" / "broken.gguf"
    broken.parent.mkdir()
    broken.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 5000)
    info = image.build_image(tmp_path / "broken.tar", broken, "2027.2.0", keys[0], power_profile={"threads": 1})
    server.files["img.tar"] = info.path
    with running_agent(mosquitto.config, field, tmp_path / "state", keys[1], builtin) as agent:
        field.send(command(info, server.url("img.tar")))
        final = field.final(1, timeout=300)
        assert final.phase == "rolled_back" and "health check failed" in final.detail, final.detail
        assert "back on the built-in model" in final.detail
        assert field.phases() == ["received", "downloaded", "verified", "installed", "health_check", "rolled_back"]
        answer = field.ask(1)
        assert answer.body.model == builtin.version and agent.image_version == "2027.1.0"
        assert agent.ota is not None and agent.ota.active_model_path() is None
        assert "models_switched" not in agent.store.counters()


def test_an_ota_command_naming_another_device_is_ignored_and_counted(mosquitto, field: Field, server: FileServer,
                                                                     tmp_path: Path, keys: tuple[Path, Path],
                                                                     builtin) -> None:
    info = small_signed(tmp_path, keys[0], "2027.2.0")
    server.files["img.tar"] = info.path
    with running_agent(mosquitto.config, field, tmp_path / "state", keys[1], builtin) as agent:
        foreign = command(info, server.url("img.tar"), device="hive-99")  # on our topic, for someone else
        assert field.t.publish(topics.ota_command(SITE, DEVICE), make(foreign, sender="field-test"), timeout=5)
        wait_until(lambda: agent.store.counters().get("foreign_ota_commands") == 1, 20, "the foreign command counted")
        field.ask(1)  # answered after the command was handled: nothing was started for it
        assert field.statuses() == [] and not server.requests
