"""OTA on the device: real downloads over HTTP (with cut connections), real signed images, real llama.cpp checks.

The HTTP server here is a real threaded ``http.server`` that honours Range requests and can
drop the connection part-way through a file, like a flaky field link.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import socket
import threading
from pathlib import Path

import pytest

from apiary.edge.ota import BootState, HealthCheckFailed, LlamaHealthCheck, OtaUpdater
from apiary.shared import image, topics
from apiary.shared.protocol import OtaCommand, OtaStatus
from tests.edge.helpers import FileServer

SITE, DEVICE = "farm-1", "hive-0007"


class Recorder:
    """Collects what the updater publishes (the MQTT test below uses a real broker instead)."""

    def __init__(self) -> None:
        self.published: list[tuple[str, OtaStatus]] = []

    def publish(self, topic: str, env, *, qos: int = 1, retain: bool = False, timeout: float | None = None) -> bool:
        self.published.append((topic, env.body))
        return True

    @property
    def phases(self) -> list[str]:
        return [s.phase for _, s in self.published if s.phase != "downloading"]


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return image.write_keypair(tmp_path_factory.mktemp("keys"), "ota")


@pytest.fixture(scope="module")
def real_image(tmp_path_factory: pytest.TempPathFactory, keys: tuple[Path, Path], gguf_path: Path) -> image.ImageInfo:
    """The real SmolLM2 Q4 GGUF in a signed image (one llama.cpp thread: the test machine is shared)."""
    return image.build_image(tmp_path_factory.mktemp("img") / "v1.tar", gguf_path, "1.0.0", keys[0],
                             power_profile={"name": "test", "threads": 1, "n_ctx": 2048})


def small_image(tmp_path: Path, key: Path, version: str, payload: bytes = b"GGUF" + bytes(range(256)) * 2000,
                filename: str = "model.gguf") -> image.ImageInfo:
    model = tmp_path / f"src-{version}" / filename
    model.parent.mkdir(parents=True, exist_ok=True)
    model.write_bytes(payload)
    return image.build_image(tmp_path / f"{version}.tar", model, version, key, power_profile={"threads": 1})


def command(info: image.ImageInfo, url: str, **override) -> OtaCommand:
    fields = dict(site=SITE, device=DEVICE, image_version=info.manifest.image_version, url=url, sha256=info.sha256,
                  signature=info.signature, size=info.size)
    return OtaCommand(**{**fields, **override})


def ok_check(model: Path, manifest: image.Manifest) -> str:
    """For tests about transfer and slots, not about the model: the file must be the one the manifest names."""
    assert hashlib.sha256(model.read_bytes()).hexdigest() == manifest.model.sha256
    return "file ok"


def updater(state: Path, pub: Path, rec: Recorder | None = None, **kw) -> OtaUpdater:
    return OtaUpdater(state, rec, SITE, DEVICE, pub.read_text(), retry_delay_s=0.01, **kw)


def tree_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*"))
            if p.is_file()}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_image_installs_passes_health_check_and_commits(tmp_path: Path, server: FileServer,
                                                             keys: tuple[Path, Path], real_image: image.ImageInfo) -> None:
    server.files["v1.tar"] = real_image.path
    rec = Recorder()
    ota = updater(tmp_path / "state", keys[1], rec, health_check=LlamaHealthCheck(budget_s=240))
    assert ota.active_model_path() is None  # nothing installed: the agent runs its built-in model
    final = ota.handle(command(real_image, server.url("v1.tar")))
    assert final.phase == "committed", final.detail
    assert "probe answered" in final.detail
    assert rec.phases == ["received", "downloaded", "verified", "installed", "health_check", "committed"]
    assert all(t == topics.ota_status(SITE, DEVICE) for t, _ in rec.published)
    progress = [s.progress for _, s in rec.published if s.phase == "downloading"]
    assert progress and progress == sorted(progress) and progress[-1] == 1.0
    path = ota.active_model_path()
    assert path == tmp_path / "state" / "slots" / "a" / real_image.manifest.model.filename
    assert image.sha256_file(path) == real_image.manifest.model.sha256
    assert ota.store.read() == BootState(active="a", previous=None, trial=False)
    assert not list((tmp_path / "state" / "downloads").iterdir())  # the archive is not kept once installed
    # The same command again is a no-op, not a reinstall.
    again = ota.handle(command(real_image, server.url("v1.tar")))
    assert (again.phase, again.detail) == ("committed", "already running this image")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_model_that_fails_to_load_rolls_back_to_the_previous_slot(tmp_path: Path, server: FileServer,
                                                                  keys: tuple[Path, Path]) -> None:
    good = small_image(tmp_path, keys[0], "1.0.0")
    broken = small_image(tmp_path, keys[0], "2.0.0", payload=b"GGUF\x03\x00\x00\x00" + b"\xff" * 5000)
    server.files.update({"good.tar": good.path, "broken.tar": broken.path})
    state = tmp_path / "state"
    assert updater(state, keys[1], health_check=ok_check).handle(command(good, server.url("good.tar"))).phase == "committed"
    before = tree_digest(state / "slots" / "a")
    rec = Recorder()
    ota = updater(state, keys[1], rec, health_check=LlamaHealthCheck(budget_s=120))  # the real llama.cpp check
    final = ota.handle(command(broken, server.url("broken.tar")))
    assert final.phase == "rolled_back" and "health check failed" in final.detail, final.detail
    assert rec.phases == ["received", "downloaded", "verified", "installed", "health_check", "rolled_back"]
    assert [s.slot for _, s in rec.published if s.phase in ("installed", "rolled_back")] == ["b", "a"]
    assert ota.store.read() == BootState(active="a", previous=None, trial=False)
    assert ota.active_version() == "1.0.0" and tree_digest(state / "slots" / "a") == before


def test_health_check_rejects_unfinished_or_unparseable_answers(tmp_path: Path, keys: tuple[Path, Path],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The verdict logic on the child's report (the child itself runs in the real-model tests)."""
    import subprocess

    info = small_image(tmp_path, keys[0], "1.0.0")
    reports = [{"finished": False, "action": None, "text": "{", "completion_tokens": 96, "load_s": 0, "answer_s": 0},
               {"finished": True, "action": None, "text": "{}", "completion_tokens": 3, "load_s": 0, "answer_s": 0},
               {"finished": True, "action": {"assessment": "normal", "urgency": "low"}, "text": "",
                "completion_tokens": 30, "load_s": 0, "answer_s": 0}]
    for report, why in zip(reports, ["did not finish", "not a valid action", "expected heat_stress"]):
        monkeypatch.setattr(subprocess, "run", lambda *a, _r=report, **k: subprocess.CompletedProcess(
            a, 0, stdout=json.dumps(_r) + "\n", stderr=""))
        with pytest.raises(HealthCheckFailed, match=why):
            LlamaHealthCheck(expect_assessment="heat_stress")(tmp_path / "m.gguf", info.manifest)

    def too_slow(*a, **k):
        raise subprocess.TimeoutExpired(a, 1)
    monkeypatch.setattr(subprocess, "run", too_slow)
    with pytest.raises(HealthCheckFailed, match="within"):
        LlamaHealthCheck(budget_s=1)(tmp_path / "m.gguf", info.manifest)


@pytest.mark.parametrize("case", ["tampered", "wrong_key", "wrong_hash", "wrong_version", "other_device"])
def test_untrusted_images_are_refused_and_the_running_slot_is_untouched(
        tmp_path: Path, server: FileServer, keys: tuple[Path, Path], case: str) -> None:
    good = small_image(tmp_path, keys[0], "1.0.0")
    server.files["good.tar"] = good.path
    state = tmp_path / "state"
    assert updater(state, keys[1], health_check=ok_check).handle(command(good, server.url("good.tar"))).phase == "committed"
    before_slots, before_boot = tree_digest(state / "slots"), (state / "boot.json").read_bytes()

    if case == "wrong_key":
        other_priv, _ = image.write_keypair(tmp_path / "other", "other")
        new = small_image(tmp_path, other_priv, "2.0.0")
    else:
        new = small_image(tmp_path, keys[0], "2.0.0")
    cmd = command(new, server.url("new.tar"))
    if case == "tampered":  # flip one byte of the model inside the archive; the command carries the new hash
        import tarfile

        with tarfile.open(new.path) as tar:
            at = tar.getmember("model/model.gguf").offset_data + 1000
        data = bytearray(new.path.read_bytes())
        data[at] ^= 0xFF
        tampered = tmp_path / "tampered.tar"
        tampered.write_bytes(bytes(data))
        server.files["new.tar"] = tampered
        cmd = command(new, server.url("new.tar"), sha256=image.sha256_file(tampered))
    else:
        server.files["new.tar"] = new.path
    if case == "wrong_hash":
        cmd = command(new, server.url("new.tar"), sha256="ab" * 32)
    if case == "wrong_version":
        cmd = command(new, server.url("new.tar"), image_version="3.0.0")
    if case == "other_device":
        cmd = command(new, server.url("new.tar"), device="hive-9999")

    rec = Recorder()
    final = updater(state, keys[1], rec, health_check=ok_check).handle(cmd)
    expected = {"tampered": "model_hash", "wrong_key": "signature", "wrong_hash": "hash", "wrong_version": "version",
                "other_device": "not this device"}[case]
    assert final.phase == "refused" and expected in final.detail, final.detail
    assert rec.phases[-1] == "refused" and "installed" not in rec.phases and "health_check" not in rec.phases
    assert tree_digest(state / "slots") == before_slots and (state / "boot.json").read_bytes() == before_boot
    assert not list((state / "downloads").iterdir())  # a refused file is not kept (a retry must start clean)


def test_interrupted_download_resumes_from_the_partial_offset(tmp_path: Path, server: FileServer,
                                                              keys: tuple[Path, Path]) -> None:
    info = small_image(tmp_path, keys[0], "1.0.0")
    server.files["img.tar"] = info.path
    cut = info.size * 2 // 5
    server.cut_next["img.tar"] = cut
    rec = Recorder()
    final = updater(tmp_path / "state", keys[1], rec, health_check=ok_check).handle(command(info, server.url("img.tar")))
    assert final.phase == "committed", final.detail
    assert server.requests == [("img.tar", None), ("img.tar", f"bytes={cut}-")]  # resumed, not restarted
    assert image.sha256_file(tmp_path / "state" / "slots" / "a" / "model.gguf") == info.manifest.model.sha256


def test_partial_download_survives_a_restart_and_resumes(tmp_path: Path, server: FileServer,
                                                         keys: tuple[Path, Path]) -> None:
    info = small_image(tmp_path, keys[0], "1.0.0")
    server.files["img.tar"] = info.path
    server.cut_next["img.tar"] = 50_000
    state = tmp_path / "state"
    first = updater(state, keys[1], health_check=ok_check, max_attempts=1).handle(command(info, server.url("img.tar")))
    assert first.phase == "failed" and "partial file kept" in first.detail
    part = next((state / "downloads").glob("*.part"))
    assert part.stat().st_size == 50_000
    # The device restarts (a new updater on the same state) and the cloud repeats the command.
    second = updater(state, keys[1], health_check=ok_check).handle(command(info, server.url("img.tar")))
    assert second.phase == "committed", second.detail
    assert server.requests[-1] == ("img.tar", "bytes=50000-")


def test_server_that_ignores_range_restarts_cleanly_and_oversize_is_refused(tmp_path: Path, server: FileServer,
                                                                            keys: tuple[Path, Path]) -> None:
    info = small_image(tmp_path, keys[0], "1.0.0")
    server.files["img.tar"] = info.path
    state = tmp_path / "state"
    downloads = state / "downloads"
    downloads.mkdir(parents=True)
    # A stale partial file longer than the announced size: discarded, fetched from the start.
    (downloads / f"1.0.0-{info.sha256[:16]}.tar.part").write_bytes(b"x" * (info.size + 10))
    assert updater(state, keys[1], health_check=ok_check).handle(command(info, server.url("img.tar"))).phase == "committed"
    assert server.requests[-1] == ("img.tar", None)
    # A command announcing fewer bytes than the server sends is refused before verification.
    bigger = small_image(tmp_path, keys[0], "2.0.0")
    server.files["big.tar"] = bigger.path
    final = updater(state, keys[1], health_check=ok_check).handle(
        command(bigger, server.url("big.tar"), size=bigger.size - 512))
    assert final.phase == "refused" and "more than the announced" in final.detail


def test_unreachable_server_fails_without_touching_slots(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    info = small_image(tmp_path, keys[0], "1.0.0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed right away: nothing listens there
    final = updater(tmp_path / "state", keys[1], health_check=ok_check, max_attempts=2).handle(
        command(info, f"http://127.0.0.1:{port}/img.tar"))
    assert final.phase == "failed" and "download failed" in final.detail
    assert not (tmp_path / "state" / "boot.json").exists()


class PowerCut(BaseException):
    """Stands for the process dying: not an Exception, so nothing in the updater catches it."""


def test_power_cut_during_trial_reverts_on_next_start(tmp_path: Path, server: FileServer,
                                                      keys: tuple[Path, Path]) -> None:
    v1, v2 = small_image(tmp_path, keys[0], "1.0.0"), small_image(tmp_path, keys[0], "2.0.0")
    server.files.update({"v1.tar": v1.path, "v2.tar": v2.path})
    state = tmp_path / "state"
    assert updater(state, keys[1], health_check=ok_check).handle(command(v1, server.url("v1.tar"))).phase == "committed"

    def cut(model: Path, manifest: image.Manifest) -> str:
        raise PowerCut()
    with pytest.raises(PowerCut):
        updater(state, keys[1], health_check=cut).handle(command(v2, server.url("v2.tar")))
    # On disk right now: switched to b, on trial.
    assert json.loads((state / "boot.json").read_text()) == {"active": "b", "previous": "a", "trial": True}
    rec = Recorder()
    rebooted = updater(state, keys[1], rec, health_check=ok_check)
    assert rebooted.active_version() == "1.0.0"
    assert rebooted.store.read() == BootState(active="a", previous=None, trial=False)
    assert rebooted.boot_status is not None and rebooted.boot_status.phase == "rolled_back"
    rebooted.announce_boot()
    assert rec.phases == ["rolled_back"] and rec.published[0][1].image_version == "2.0.0"
    # The update can simply be sent again and now commits into the same inactive slot.
    assert rebooted.handle(command(v2, server.url("v2.tar"))).phase == "committed"
    assert rebooted.store.read() == BootState(active="b", previous="a", trial=False)


def test_power_cut_while_unpacking_keeps_the_running_slot(tmp_path: Path, server: FileServer, keys: tuple[Path, Path],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    v1, v2, v3 = (small_image(tmp_path, keys[0], f"{i}.0.0") for i in (1, 2, 3))
    server.files.update({f"v{i}.tar": v.path for i, v in ((1, v1), (2, v2), (3, v3))})
    state = tmp_path / "state"
    ota = updater(state, keys[1], health_check=ok_check)
    assert ota.handle(command(v1, server.url("v1.tar"))).phase == "committed"
    assert ota.handle(command(v2, server.url("v2.tar"))).phase == "committed"
    assert ota.store.read() == BootState(active="b", previous="a", trial=False)

    real_unpack = image.unpack_image

    def unpack_then_die(path, dest, *a, **k):
        shutil.rmtree(dest)  # the slot is half gone...
        Path(dest).mkdir()
        (Path(dest) / "model.gguf").write_bytes(b"half")  # ...and half written
        raise PowerCut()
    monkeypatch.setattr(image, "unpack_image", unpack_then_die)
    with pytest.raises(PowerCut):
        ota.handle(command(v3, server.url("v3.tar")))
    monkeypatch.setattr(image, "unpack_image", real_unpack)
    # Slot a (the fallback) was being overwritten, so boot.json no longer points at it; b still runs.
    rebooted = updater(state, keys[1], health_check=ok_check)
    assert rebooted.store.read() == BootState(active="b", previous=None, trial=False)
    assert rebooted.active_version() == "2.0.0" and rebooted.boot_status is None
    assert rebooted.handle(command(v3, server.url("v3.tar"))).phase == "committed"
    assert rebooted.active_version() == "3.0.0"


def test_first_install_that_fails_falls_back_to_the_built_in_model(tmp_path: Path, server: FileServer,
                                                                   keys: tuple[Path, Path]) -> None:
    info = small_image(tmp_path, keys[0], "1.0.0")
    server.files["img.tar"] = info.path

    def bad(model: Path, manifest: image.Manifest) -> str:
        raise HealthCheckFailed("probe answered nothing")
    final = updater(tmp_path / "state", keys[1], health_check=bad).handle(command(info, server.url("img.tar")))
    assert final.phase == "rolled_back" and "built-in model" in final.detail
    ota = updater(tmp_path / "state", keys[1])
    assert ota.active_model_path() is None and ota.store.read() == BootState()


def test_corrupt_boot_state_boots_the_built_in_model(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    state = tmp_path / "state"
    state.mkdir()
    for junk in (b"{not json", b'{"active": "../../etc", "previous": null, "trial": false}', b"[]"):
        (state / "boot.json").write_bytes(junk)
        assert updater(state, keys[1]).active_model_path() is None
    with pytest.raises(image.ImageError):
        OtaUpdater(state, None, SITE, DEVICE, "not a key")


@pytest.mark.timeout(120)
def test_status_reaches_the_cloud_over_mosquitto(tmp_path: Path, server: FileServer, keys: tuple[Path, Path],
                                                 mosquitto) -> None:
    from apiary.shared.transport import MqttTransport

    info = small_image(tmp_path, keys[0], "1.0.0")
    server.files["img.tar"] = info.path
    got: list[OtaStatus] = []
    done = threading.Event()

    def on_status(topic: str, env) -> None:
        got.append(env.body)
        if env.body.phase in ("committed", "refused", "failed", "rolled_back"):
            done.set()

    with MqttTransport(mosquitto.config, "cloud-ota-watch") as cloud, MqttTransport(mosquitto.config, DEVICE) as edge:
        cloud.subscribe(topics.all_of("ota/status"), on_status)
        ota = OtaUpdater(tmp_path / "state", edge, SITE, DEVICE, keys[1], health_check=ok_check)
        final = ota.handle(command(info, server.url("img.tar")))
        assert done.wait(30)
    assert final.phase == "committed"
    phases = [s.phase for s in got if s.phase != "downloading"]
    assert phases == ["received", "downloaded", "verified", "installed", "health_check", "committed"]
    assert all((s.site, s.device, s.image_version) == (SITE, DEVICE, "1.0.0") for s in got)


def test_resume_works_against_a_starlette_file_route(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """The cloud API serves images with Starlette's FileResponse: its Range answers must resume our partial file."""
    import time

    import uvicorn
    from fastapi import FastAPI, Header
    from fastapi.responses import FileResponse

    info = small_image(tmp_path, keys[0], "1.0.0")
    app = FastAPI()
    seen: list[str | None] = []

    @app.get("/images/{name}")
    def image_file(name: str, range: str | None = Header(default=None)) -> FileResponse:
        seen.append(range)
        return FileResponse(info.path)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        state = tmp_path / "state"
        (state / "downloads").mkdir(parents=True)
        head = info.path.read_bytes()[:123_456]  # what an earlier, interrupted transfer left behind
        (state / "downloads" / f"1.0.0-{info.sha256[:16]}.tar.part").write_bytes(head)
        final = updater(state, keys[1], health_check=ok_check).handle(
            command(info, f"http://127.0.0.1:{port}/images/v1.tar"))
    finally:
        server.should_exit = True
        thread.join(10)
    assert final.phase == "committed", final.detail
    assert seen == ["bytes=123456-"]


@pytest.mark.timeout(300)
def test_probe_asks_the_model_in_its_own_prompt_style(ggufs: dict[str, Path]) -> None:
    from apiary.edge.ota import probe_model

    for name, style in (("short", "short"), ("plain", "examples")):
        result = probe_model(ggufs[name], max_tokens=4, threads=1)
        assert result["prompt_style"] == style and result["completion_tokens"] <= 4, name


# ---------------------------------------------------------------- device safety: refused before a byte is written


def test_image_versions_order_by_their_numbers() -> None:
    from apiary.edge.ota import is_older, version_key

    assert is_older("2026.2.0", "2026.12.0") and not is_older("2026.12.0", "2026.2.0")
    assert is_older("v9", "v10") and is_older("1.0", "1.0.1") and not is_older("1.0.0", "1.0.0")
    assert sorted(["2.0.0", "10.0.0", "1.9.9", "2026.1.0"], key=version_key) == ["1.9.9", "2.0.0", "10.0.0", "2026.1.0"]


def test_a_downgrade_is_refused_before_any_download(tmp_path: Path, server: FileServer, keys: tuple[Path, Path]) -> None:
    v1, v2 = small_image(tmp_path, keys[0], "2026.1.0"), small_image(tmp_path, keys[0], "2026.2.0")
    server.files.update({"v1.tar": v1.path, "v2.tar": v2.path})
    state = tmp_path / "state"
    assert updater(state, keys[1], health_check=ok_check).handle(command(v2, server.url("v2.tar"))).phase == "committed"
    before_slots, before_boot, requests = tree_digest(state / "slots"), (state / "boot.json").read_bytes(), len(server.requests)
    rec = Recorder()
    final = updater(state, keys[1], rec, health_check=ok_check).handle(command(v1, server.url("v1.tar")))
    assert final.phase == "refused" and "downgrade: 2026.1.0 is older than the running 2026.2.0" in final.detail
    assert rec.phases == ["received", "refused"] and len(server.requests) == requests  # not even downloaded
    assert tree_digest(state / "slots") == before_slots and (state / "boot.json").read_bytes() == before_boot
    assert not list((state / "downloads").iterdir())


def test_the_built_in_models_image_is_the_floor_until_a_slot_is_active(tmp_path: Path, server: FileServer,
                                                                       keys: tuple[Path, Path]) -> None:
    old, new = small_image(tmp_path, keys[0], "2026.2.0"), small_image(tmp_path, keys[0], "2026.12.1")
    server.files.update({"old.tar": old.path, "new.tar": new.path})
    ota = updater(tmp_path / "state", keys[1], health_check=ok_check, builtin_version="2026.12.0")
    assert ota.running_version() == "2026.12.0"
    refused = ota.handle(command(old, server.url("old.tar")))
    assert refused.phase == "refused" and "older than the running 2026.12.0" in refused.detail and not server.requests
    assert ota.handle(command(new, server.url("new.tar"))).phase == "committed"
    assert ota.running_version() == "2026.12.1"


def test_an_image_over_the_device_limit_is_refused_before_a_byte_is_written(tmp_path: Path, server: FileServer,
                                                                           keys: tuple[Path, Path]) -> None:
    info = small_image(tmp_path, keys[0], "1.0.0")
    server.files["img.tar"] = info.path
    state = tmp_path / "state"
    final = updater(state, keys[1], health_check=ok_check, max_image_bytes=info.size - 1).handle(
        command(info, server.url("img.tar")))
    assert final.phase == "refused" and f"too large: {info.size} bytes" in final.detail
    assert not server.requests and not list((state / "downloads").iterdir()) and not (state / "boot.json").exists()
    # At the limit it installs: the limit is the command's size, and the stream is cut at that size.
    assert updater(state, keys[1], health_check=ok_check, max_image_bytes=info.size).handle(
        command(info, server.url("img.tar"))).phase == "committed"


def test_an_update_the_disk_cannot_hold_with_the_stores_margin_is_refused(tmp_path: Path, server: FileServer,
                                                                         keys: tuple[Path, Path]) -> None:
    info = small_image(tmp_path, keys[0], "1.0.0")
    server.files["img.tar"] = info.path
    state = tmp_path / "state"
    (state / "downloads").mkdir(parents=True)
    part = state / "downloads" / f"1.0.0-{info.sha256[:16]}.tar.part"
    part.write_bytes(info.path.read_bytes()[:1000])  # an earlier interrupted try of this very image
    margin = shutil.disk_usage(tmp_path).total  # more than any disk has free: the disk is "full" for this update
    rec = Recorder()
    final = updater(state, keys[1], rec, health_check=ok_check, min_free_bytes=margin).handle(
        command(info, server.url("img.tar")))
    assert final.phase == "refused" and final.detail.startswith("disk: ")
    assert f"{info.size - 1000} to download, {info.size} to unpack, {margin} kept free" in final.detail
    assert rec.phases == ["received", "refused"] and not server.requests
    assert not list((state / "downloads").iterdir())  # no .part left behind


def test_a_low_battery_defers_the_update_and_pauses_a_download_which_resumes_later(
        tmp_path: Path, server: FileServer, keys: tuple[Path, Path]) -> None:
    from apiary.edge.energy import EnergyBudget

    info = small_image(tmp_path, keys[0], "1.0.0")
    server.files["img.tar"] = info.path
    budget = EnergyBudget()
    budget.observe({"battery_v": 3.5})  # 12 %
    asked: list[str | None] = []

    def defer() -> str | None:
        if len(asked) == 2:
            budget.observe({"battery_v": 3.55})  # the sun set again while the download ran
        asked.append(budget.defers_update(0.4))
        return asked[-1]

    state = tmp_path / "state"
    rec = Recorder()
    ota = updater(state, keys[1], rec, health_check=ok_check, defer=defer)
    first = ota.handle(command(info, server.url("img.tar")))
    assert first.phase == "deferred" and "battery at 12%, below the 40%" in first.detail
    assert not server.requests and not (state / "boot.json").exists()
    budget.observe({"battery_v": 3.9})  # 70 %: the update may start...
    second = ota.handle(command(info, server.url("img.tar")))  # ...and pauses at its first chunk
    assert second.phase == "deferred" and "download paused, partial file kept" in second.detail, second.detail
    kept = next((state / "downloads").glob("*.part")).stat().st_size
    assert 0 < kept < info.size
    budget.observe({"battery_v": 4.0})
    third = ota.handle(command(info, server.url("img.tar")))
    assert third.phase == "committed", third.detail
    assert server.requests == [("img.tar", None), ("img.tar", f"bytes={kept}-")]  # resumed where it paused
    assert [p for p in rec.phases if p != "received"] == ["deferred", "deferred", "downloaded", "verified",
                                                          "installed", "health_check", "committed"]


def test_what_a_download_of_another_image_left_is_deleted(tmp_path: Path, server: FileServer,
                                                          keys: tuple[Path, Path]) -> None:
    info = small_image(tmp_path, keys[0], "2.0.0")
    server.files["img.tar"] = info.path
    downloads = tmp_path / "state" / "downloads"
    downloads.mkdir(parents=True)
    (downloads / f"1.0.0-{'ab' * 8}.tar.part").write_bytes(b"x" * 5000)  # a version never finished
    final = updater(tmp_path / "state", keys[1], health_check=ok_check).handle(command(info, server.url("img.tar")))
    assert final.phase == "committed" and not list(downloads.iterdir())
