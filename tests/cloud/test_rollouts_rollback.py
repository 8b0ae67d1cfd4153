"""Signed rollbacks through the cloud, end to end: `apiary image rollback --url` (POST /v1/fleet/ota with the grant)
and `apiary image rollout --operator-key` (POST /v1/fleet/rollouts with a grant per device) take a running agent on a
real Mosquitto back to older images, which it health-checks with llama.cpp and reports committed; the fleet API
shows each older version."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from apiary.cli import app
from apiary.edge.agent import EdgeAgent
from apiary.edge.model import LocalModel
from apiary.edge.settings import EdgeSettings, OtaSettings, PolicySettings
from apiary.shared import assets, image

SITE, DEVICE = "meadow", "hive-9"


def until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_cli_takes_a_running_agent_back_through_the_cloud_only_with_operator_grants(
        mosquitto, make_service, keys, tmp_path: Path) -> None:
    service = make_service(broker=mosquitto.config.url, worker_id="cloud-rollback", escalations=False)
    api_key = keys.create(["operator"])
    signing, public = image.write_keypair(tmp_path / "signing", "ota")
    operator, operator_pub = image.write_keypair(tmp_path / "signing", "operator")
    student = assets.edge_model("edge-student")
    images = tmp_path / "images"
    images.mkdir(exist_ok=True)
    built: dict[str, image.ImageInfo] = {}
    for version in ("2027.1.0", "2026.12.0", "2026.11.0"):  # the student under three versions and file names
        src = tmp_path / "src" / f"student-{version}.gguf"
        src.parent.mkdir(exist_ok=True)
        shutil.copyfile(student, src)
        built[version] = image.build_image(images / f"edge-{version}.tar", src, version, signing,
                                           power_profile={"name": "test", "threads": 1, "n_ctx": 2048})
    running = tmp_path / "builtin"  # the device's built-in model: 2027.1.0 unpacked, the version floor
    image.unpack_image(built["2027.1.0"].path, running, public)
    model = LocalModel(running / "student-2027.1.0.gguf", n_ctx=2048, threads=1)
    settings = EdgeSettings(threads=1, policy=PolicySettings(link="never"),
                            ota=OtaSettings(public_key=public.read_text().strip(),
                                            operator_keys=[operator_pub.read_text().strip()]))
    agent = EdgeAgent(settings, site=SITE, device=DEVICE, mqtt=mosquitto.config, model=model,
                      state_dir=tmp_path / "edge")
    http = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=30)

    def device() -> dict:
        return next((d for d in http.get("/v1/fleet/devices", params={"site": SITE}).json()
                     if d["device"] == DEVICE), {})

    cli = CliRunner()
    agent.start()
    try:
        until(lambda: device().get("online") and device().get("image_version") == "2027.1.0", 30, "the agent's birth")
        unsigned = cli.invoke(app, ["image", "command", str(built["2026.12.0"].path), "--site", SITE, "--device",
                                    DEVICE, "--url", f"{service.url}/v1/images/edge-2026.12.0.tar", "--public-key",
                                    str(public), "--broker", mosquitto.config.url])
        assert unsigned.exit_code == 0, unsigned.output
        refused = until(lambda: (device().get("last_ota") or {}).get("phase") == "refused" and device(), 60,
                        "the unsigned downgrade refused")
        assert "downgrade: 2026.12.0 is older than the running 2027.1.0" in refused["last_ota"]["detail"]

        back = cli.invoke(app, ["image", "rollback", str(built["2026.12.0"].path), "--site", SITE, "--device", DEVICE,
                                "--operator-key", str(operator), "--public-key", str(public), "--url", service.url,
                                "--api-key", api_key])
        assert back.exit_code == 0, back.output
        assert f"rollback of {SITE}/{DEVICE} to 2026.12.0 sent on" in back.output
        after = until(lambda: device().get("image_version") == "2026.12.0" and device(), 300, "the rollback")
        assert after["last_ota"]["phase"] == "committed"
        assert after["model_version"] == f"student-2026.12.0.gguf:{built['2026.12.0'].manifest.model.size}"

        wave = cli.invoke(app, ["image", "rollout", str(built["2026.11.0"].path), "--url", service.url,
                                "--api-key", api_key, "--site", SITE, "--operator-key", str(operator),
                                "--poll", "0.5"])
        assert wave.exit_code == 0, wave.output
        assert "completed: 1 of 1 devices committed 2026.11.0" in wave.output, wave.output
        assert until(lambda: device().get("image_version") == "2026.11.0", 60, "the fleet on 2026.11.0")
        assert agent.image_version == "2026.11.0"
    finally:
        agent.stop()
        http.close()
        model.close()
