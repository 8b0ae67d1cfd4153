"""OTA through the cloud: `POST /v1/fleet/ota` reaches a running edge agent, which downloads the image from the
cloud's own image route, installs it, switches models, and the fleet API shows the new image version.

Real everything: Mosquitto, the cloud service (recorder, REST API, image route), the edge agent with the shipped
student, and an update that is the student again signed by a test key under a new version and file name.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import pytest

from apiary.cloud.store import SqliteStore
from apiary.edge.agent import EdgeAgent
from apiary.edge.model import LocalModel
from apiary.edge.settings import EdgeSettings, OtaSettings, PolicySettings
from apiary.shared import assets, image
from apiary.shared.protocol import DeviceState

SITE, DEVICE = "meadow", "hive-7"


def until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_the_fleet_keeps_the_image_version_a_live_switch_reported_when_the_last_will_arrives(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "cloud.db")
    node = dict(site=SITE, device=DEVICE, session=3)

    def image_version() -> str | None:
        return store.devices(SITE)[0]["image_version"]

    store.record_state(DeviceState(status="birth", online=True, image_version="2026.12.0", model_version="a:1", **node))
    store.record_state(DeviceState(status="update", online=True, **node))  # an update without versions
    assert image_version() == "2026.12.0"
    store.record_state(DeviceState(status="update", online=True, image_version="2027.1.0", model_version="b:2", **node))
    # The Last Will was composed at connect time, before the switch: it marks the device offline, nothing more.
    store.record_state(DeviceState(status="death", online=False, image_version="2026.12.0", model_version="a:1",
                                   **node))
    d = store.devices(SITE)[0]
    assert (d["online"], d["image_version"], d["model_version"]) == (False, "2027.1.0", "b:2")
    # A birth states the whole truth: an installed image that no longer loads, the built-in model of no known image.
    store.record_state(DeviceState(status="birth", online=True, model_version="a:1", **{**node, "session": 4}))
    assert image_version() is None
    store.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fleet_ota_reaches_a_running_agent_and_the_fleet_shows_its_new_image(mosquitto, make_service, keys,
                                                                            tmp_path: Path) -> None:
    service = make_service(broker=mosquitto.config.url, worker_id="cloud-ota", escalations=False)
    operator = keys.create(["operator"])
    private, public = image.write_keypair(tmp_path / "signing", "ota")
    student = assets.edge_model("edge-student")
    src = tmp_path / "src" / "student-2027.gguf"
    src.parent.mkdir()
    shutil.copyfile(student, src)
    images = tmp_path / "images"
    images.mkdir(exist_ok=True)
    info = image.build_image(images / "edge-2027.1.0.tar", src, "2027.1.0", private,
                             power_profile={"name": "test", "threads": 1, "n_ctx": 2048})

    built_in = LocalModel(student, n_ctx=2048, threads=1)
    settings = EdgeSettings(threads=1, policy=PolicySettings(link="never"),
                            ota=OtaSettings(public_key=public.read_text().strip()))
    agent = EdgeAgent(settings, site=SITE, device=DEVICE, mqtt=mosquitto.config, model=built_in,
                      state_dir=tmp_path / "edge")
    http = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {operator}"}, timeout=30)

    def device() -> dict:
        return next((d for d in http.get("/v1/fleet/devices", params={"site": SITE}).json()
                     if d["device"] == DEVICE), {})

    agent.start()
    try:
        before = until(lambda: device().get("online") and device(), 30, "the agent's birth in the fleet")
        assert before["image_version"] is None and before["model_version"].startswith(student.name)
        r = http.post("/v1/fleet/ota", json={"site": SITE, "device": DEVICE, "image_version": "2027.1.0",
                                             "filename": info.path.name, "sha256": info.sha256,
                                             "signature": info.signature, "size": info.size})
        assert r.status_code == 200, r.text
        assert [(t["device"], t["acked"]) for t in r.json()["targets"]] == [(DEVICE, True)]

        after = until(lambda: (device().get("image_version") == "2027.1.0" and device()), 300,
                      "the new image version in the fleet")
        assert after["model_version"] == f"student-2027.gguf:{info.manifest.model.size}"
        assert after["last_ota"]["phase"] == "committed" and after["online"]
        reports = http.get(f"/v1/fleet/devices/{SITE}/{DEVICE}/ota").json()
        phases = [p["phase"] for p in reversed(reports) if p["phase"] != "downloading"]
        assert phases == ["received", "downloaded", "verified", "installed", "health_check", "committed"]
        assert agent.image_version == "2027.1.0"
    finally:
        agent.stop()
        http.close()
        built_in.close()
