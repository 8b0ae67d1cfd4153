"""Fleet rollouts on a real Mosquitto with real edge agents: the cloud service (recorder, REST API, image route,
rollout driver), in-process agents sharing the shipped student as their built-in model, and updates signed by a test
key: the student again under a new version (which commits), and a GGUF llama.cpp cannot load (which fails its health
check). No events are sent: a committed model is switched to at once, and nothing else needs the models.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from typer.testing import CliRunner

from apiary.cli import app
from apiary.edge.agent import EdgeAgent
from apiary.edge.model import LocalModel
from apiary.edge.settings import EdgeSettings, OtaSettings, PolicySettings
from apiary.shared import image
from tests.edge.helpers import ROOT, FileServer
from tests.shared.helpers import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SITE = "meadow"
NEW = "2027.1.0"


@pytest.fixture(scope="module")
def signing(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return image.write_keypair(tmp_path_factory.mktemp("keys"), "fleet")


@pytest.fixture(scope="module")
def student() -> Path:
    from apiary.shared import assets

    return assets.edge_model("edge-student")


@pytest.fixture(scope="module")
def built_in(student: Path) -> Iterator[LocalModel]:
    """One built-in model for every agent: a model handed to an agent is never closed by it, and no event asks it."""
    model = LocalModel(student, n_ctx=2048, threads=1)
    yield model
    model.close()


def good_image(images: Path, student: Path, key: Path) -> image.ImageInfo:
    src = images.parent / "src" / "student-2027.gguf"
    src.parent.mkdir(exist_ok=True)
    shutil.copyfile(student, src)
    return image.build_image(images / f"edge-{NEW}.tar", src, NEW, key,
                             power_profile={"name": "test", "threads": 1, "n_ctx": 2048})


def broken_image(images: Path, key: Path) -> image.ImageInfo:
    src = images.parent / "src" / "broken.gguf"
    src.parent.mkdir(exist_ok=True)
    src.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 5000)
    return image.build_image(images / "edge-2027.2.0.tar", src, "2027.2.0", key, power_profile={"threads": 1})


@contextlib.contextmanager
def agents(mosquitto, tmp_path: Path, public_key: Path, model: LocalModel, names: list[str]
           ) -> Iterator[dict[str, EdgeAgent]]:
    settings = EdgeSettings(threads=1, policy=PolicySettings(link="never"),
                            ota=OtaSettings(public_key=public_key.read_text().strip()))
    running: dict[str, EdgeAgent] = {}
    try:
        for name in names:
            running[name] = EdgeAgent(settings, site=SITE, device=name, mqtt=mosquitto.config, model=model,
                                      state_dir=tmp_path / "edge" / name)
            running[name].start()
        yield running
    finally:
        for agent in running.values():
            agent.stop()


class Operator:
    def __init__(self, url: str, key: str) -> None:
        self.key = key
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)

    def fleet(self) -> dict[str, dict]:
        return {d["device"]: d for d in self.http.get("/v1/fleet/devices", params={"site": SITE}).json()}

    def wait_online(self, names: list[str]) -> None:
        wait_until(lambda: all(self.fleet().get(n, {}).get("online") for n in names), 60, f"{names} online")

    def rollout(self, rollout_id: str) -> dict:
        r = self.http.get(f"/v1/fleet/rollouts/{rollout_id}")
        assert r.status_code == 200, r.text
        return r.json()

    def finished(self, rollout_id: str, timeout: float = 600) -> dict:
        wait_until(lambda: self.rollout(rollout_id)["state"] != "running", timeout, f"rollout {rollout_id} to end")
        return self.rollout(rollout_id)

    def ota(self, device: str) -> list[dict]:
        return self.http.get(f"/v1/fleet/devices/{SITE}/{device}/ota").json()


@pytest.fixture
def operator_key(keys) -> str:
    return keys.create(["operator"])


def test_apiary_image_rollout_takes_the_canary_then_the_rest_to_the_new_image(
        mosquitto, make_service, operator_key: str, tmp_path: Path, signing, student: Path, built_in) -> None:
    service = make_service(broker=mosquitto.config.url, worker_id="cloud-rollout", escalations=False)
    images = tmp_path / "images"
    images.mkdir(exist_ok=True)
    info = good_image(images, student, signing[0])
    names = ["hive-1", "hive-2", "hive-3"]
    op = Operator(service.url, operator_key)
    with agents(mosquitto, tmp_path, signing[1], built_in, names) as running:
        op.wait_online(names)
        result = CliRunner().invoke(app, ["image", "rollout", info.path.name, "--url", service.url, "--api-key",
                                          operator_key, "--site", SITE, "--canary", "0.3", "--sha256", info.sha256,
                                          "--poll", "0.2"])
        assert result.exit_code == 0, result.output
        lines = result.stdout.splitlines()  # the progress the CLI prints (log lines go to stderr)
        assert lines[0].endswith(f"{NEW} ({info.path.name}) to 3 devices in 2 waves, 1 in the canary wave"), lines[0]
        assert lines[-1].startswith(f"completed: 3 of 3 devices committed {NEW}"), result.output
        # the canary committed before the others' commands went out
        committed = next(i for i, line in enumerate(lines) if line.startswith("  meadow/hive-1  wave 1  committed"))
        assert lines.index("wave 2 of 2") > committed, result.output
        assert all(line.split()[1] == "wave" and line.split()[2] == "2" for line in lines
                   if line.startswith("  meadow/hive-2") or line.startswith("  meadow/hive-3")), result.output

        listed = op.http.get("/v1/fleet/rollouts").json()
        assert [(r["state"], r["counts"]) for r in listed] == [("completed", {"committed": 3})]
        done = op.rollout(listed[0]["id"])
        canary, rest = done["devices"][0], done["devices"][1:]
        assert (canary["device"], canary["wave"]) == ("hive-1", 0) and [d["wave"] for d in rest] == [1, 1]
        assert all(d["sent_at"] >= canary["updated_at"] for d in rest)  # sent after the canary's commit arrived
        assert done["url"] == f"{service.url}/v1/images/{info.path.name}" and done["sha256"] == info.sha256

        fleet = op.fleet()
        assert {n: fleet[n]["image_version"] for n in names} == {n: NEW for n in names}
        assert {n: running[n].image_version for n in names} == {n: NEW for n in names}
        # a device already on the image commits at once
        again = op.http.post("/v1/fleet/rollouts", json={"filename": info.path.name,
                                                          "devices": [{"site": SITE, "device": "hive-2"}],
                                                          "canary": 1.0})
        assert again.status_code == 201, again.text
        finished = op.finished(again.json()["id"], 120)
        assert finished["state"] == "completed"
        assert "already running this image" in finished["devices"][0]["detail"]


def test_a_canary_that_fails_its_health_check_aborts_the_rollout_and_the_rest_never_get_a_command(
        mosquitto, make_service, operator_key: str, tmp_path: Path, signing, built_in) -> None:
    service = make_service(broker=mosquitto.config.url, worker_id="cloud-rollout", escalations=False)
    images = tmp_path / "images"
    images.mkdir(exist_ok=True)
    info = broken_image(images, signing[0])
    names = ["hive-1", "hive-2"]
    op = Operator(service.url, operator_key)
    with agents(mosquitto, tmp_path, signing[1], built_in, names) as running:
        op.wait_online(names)
        r = op.http.post("/v1/fleet/rollouts", json={"filename": info.path.name, "all": True, "canary": 0.5})
        assert r.status_code == 201, r.text
        created = r.json()
        canary_now, rest_now = created["devices"]
        assert (canary_now["device"], canary_now["wave"], rest_now["device"], rest_now["wave"], rest_now["phase"]) \
            == ("hive-1", 0, "hive-2", 1, "pending")
        # the canary's command went out before the answer (the device may already have reported progress)
        assert canary_now["phase"] != "pending" and canary_now["sent_at"] is not None, canary_now
        conflict = op.http.post("/v1/fleet/rollouts", json={"filename": info.path.name, "site": SITE})
        assert conflict.status_code == 409 and created["id"] in conflict.json()["error"]["message"]

        done = op.finished(created["id"], 300)
        assert done["state"] == "aborted" and "1 of 1 devices rolled back" in done["reason"], done["reason"]
        canary, other = done["devices"]
        assert (canary["phase"], canary["outcome"]) == ("rolled_back", "failed")
        assert "health check failed" in canary["detail"], canary["detail"]
        assert (other["phase"], other["outcome"], other["sent_at"]) == ("skipped", "skipped", None)
        assert op.ota("hive-2") == []
        assert [s["phase"] for s in op.ota("hive-1")][0] == "rolled_back"
        fleet = op.fleet()
        assert fleet["hive-1"]["image_version"] is None and fleet["hive-2"]["image_version"] is None
        assert running["hive-1"].image_version is None
        assert op.http.get("/v1/fleet/rollouts", params={"state": "aborted"}).json()[0]["id"] == created["id"]

        cli = ["image", "rollout", "--url", service.url, "--api-key", operator_key, "--poll", "0.2"]
        refused = CliRunner().invoke(app, [*cli, "nope.tar", "--site", SITE])
        assert refused.exit_code == 2 and "refused the rollout (404): image 'nope.tar' is not in the images" \
            in refused.output, refused.output
        # now the other device on its own: it fails the same way, and the command says so with exit status 1
        alone = CliRunner().invoke(app, [*cli, info.path.name, "--device", f"{SITE}/hive-2", "--canary", "1"])
        assert alone.exit_code == 1, alone.output
        assert alone.output.splitlines()[-1].startswith("aborted: wave 1 of 1: 1 of 1 devices rolled back"), \
            alone.output
        assert "  meadow/hive-2  wave 1  rolled_back (health check failed" in alone.output


def test_a_cloud_restart_mid_rollout_resumes_it(mosquitto, make_service, operator_key: str, tmp_path: Path, signing,
                                                 student: Path, built_in) -> None:
    """`apiary image rollout` (its own process) starts a rollout; the canary's download is held half-way while the
    cloud stops, the command finds it gone, and a new cloud process (same store, worker id and port) starts. Once the
    download goes on, the new process sees the canary commit and sends the second wave, and the command, still
    polling, prints the end. The images come from a file server standing where a proxy in front of the cloud would
    be (``public_url``), so they stay reachable while the cloud restarts."""
    images = tmp_path / "images"
    images.mkdir(exist_ok=True)
    info = good_image(images, student, signing[0])
    files = FileServer()
    files.thread.start()
    name = f"v1/images/{info.path.name}"
    files.files[name] = info.path
    gate = threading.Event()
    files.hold_next[name] = (info.size // 2, gate)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cloud = dict(broker=mosquitto.config.url, worker_id="cloud-rollout", escalations=False, port=port,
                 public_url=files.url("").rstrip("/"))
    names = ["hive-1", "hive-2"]
    out, err = tmp_path / "cli.out", tmp_path / "cli.err"
    cli = None
    try:
        first = make_service(**cloud)
        op = Operator(first.url, operator_key)
        with agents(mosquitto, tmp_path, signing[1], built_in, names) as running:
            op.wait_online(names)
            with open(out, "w") as stdout, open(err, "w") as stderr:
                cli = subprocess.Popen([str(Path(sys.executable).parent / "apiary"), "image", "rollout",
                                        info.path.name, "--url", first.url, "--api-key", operator_key, "--site", SITE,
                                        "--canary", "0.5", "--poll", "0.2"], cwd=ROOT, stdout=stdout, stderr=stderr,
                                       env={**os.environ, "PYTHONPATH": str(ROOT)})
            wait_until(files.held.is_set, 120, "the canary's download to reach its middle")
            rollout_id = op.http.get("/v1/fleet/rollouts").json()[0]["id"]
            first.stop()
            wait_until(lambda: "trying again" in err.read_text(), 60, "the command to find the cloud gone")

            second = make_service(**cloud)
            assert second.url == first.url
            mid = op.rollout(rollout_id)
            assert mid["state"] == "running" and mid["wave"] == 0
            assert [d["phase"] for d in mid["devices"]][1] == "pending"
            gate.set()
            assert cli.wait(600) == 0, out.read_text() + err.read_text()
            lines = out.read_text().splitlines()
            said = err.read_text().splitlines()
            assert len(said) == 2 and "trying again" in said[0] and said[1] == f"{first.url} answers again", said
            assert lines[-1].startswith(f"completed: 2 of 2 devices committed {NEW}"), lines
            assert "wave 2 of 2" in lines and "  meadow/hive-2  wave 2  committed" in "\n".join(lines)

            done = op.rollout(rollout_id)
            assert [(d["device"], d["wave"], d["outcome"]) for d in done["devices"]] == [
                ("hive-1", 0, "committed"), ("hive-2", 1, "committed")]
            assert sum(s["phase"] == "received" for s in op.ota("hive-1")) == 1  # the canary got one command
            assert [path for path, _ in files.requests] == [name, name]  # one download each, none repeated
            assert {n: op.fleet()[n]["image_version"] for n in names} == {n: NEW for n in names}
            assert {n: running[n].image_version for n in names} == {n: NEW for n in names}
    finally:
        gate.set()
        if cli is not None and cli.poll() is None:
            cli.kill()
            cli.wait()
        files.httpd.shutdown()
        files.httpd.server_close()
