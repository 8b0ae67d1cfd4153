"""Signed operator rollback: an OTA command for an older image installs only with a rollback grant signed by an
operator key the device trusts, for this device and image, before it expires, and only once.

The updater tests use small signed images and a file check; the agent test runs on a real Mosquitto with the
shipped student (real llama.cpp health checks), the commands published on the device's ota/cmd topic.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from apiary.edge.ota import NONCE_FILE, OtaUpdater
from apiary.shared import image
from apiary.shared.protocol import OtaCommand, RollbackGrant, decode, encode, make
from tests.edge.helpers import DEVICE as AGENT_DEVICE, SITE as AGENT_SITE, FileServer
from tests.edge.test_agent_ota import Field, builtin, field, running_agent, update  # noqa: F401 (fixtures)
from tests.edge.test_ota import Recorder, command, ok_check, small_image, tree_digest
from tests.shared.helpers import wait_until

SITE, DEVICE = "farm-1", "hive-0007"  # tests.edge.test_ota's device


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The image signing key (the fixtures imported from test_agent_ota sign with it too)."""
    return image.write_keypair(tmp_path_factory.mktemp("keys"), "ota")


@pytest.fixture(scope="module")
def operator(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return image.write_keypair(tmp_path_factory.mktemp("operator"), "operator")


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return image.write_keypair(tmp_path_factory.mktemp("stranger"), "stranger")


def updater(state: Path, keys: tuple[Path, Path], operator_keys: list, rec: Recorder | None = None,
            **kw) -> OtaUpdater:
    return OtaUpdater(state, rec, SITE, DEVICE, keys[1].read_text(), retry_delay_s=0.01, health_check=ok_check,
                      operator_keys=operator_keys, **kw)


def test_the_grant_signs_the_commands_fixed_fields_and_travels_in_the_envelope(operator: tuple[Path, Path]) -> None:
    cmd = OtaCommand(site=SITE, device=DEVICE, image_version="2026.1.0", url="http://x/a.tar", sha256="ab" * 32,
                     signature="cd" * 64, size=10)
    signed = image.sign_rollback(cmd, operator[0], ttl_s=600, now=1000.0, nonce="00" * 16)
    assert signed.rollback == RollbackGrant(expires=1600, nonce="00" * 16, signature=signed.rollback.signature)
    assert json.loads(cmd.rollback_message(1600, "00" * 16)) == {
        "site": SITE, "device": DEVICE, "image_version": "2026.1.0", "sha256": "ab" * 32, "rollback": True,
        "expires": 1600, "nonce": "00" * 16}
    wire = decode(encode(make(signed, sender="op"))).body
    assert wire == signed and image.verify_rollback(wire, [operator[1].read_text()]) == operator[1].read_text().strip()
    moved = wire.model_copy(update={"device": "hive-0008"})  # the same grant on another device's command
    with pytest.raises(image.ImageError, match="does not verify"):
        image.verify_rollback(moved, [operator[1].read_text()])
    with pytest.raises(image.ImageError, match="positive lifetime"):
        image.sign_rollback(cmd, operator[0], ttl_s=0)


def test_a_signed_rollback_installs_the_older_image_once(tmp_path: Path, server: FileServer, keys: tuple[Path, Path],
                                                         operator: tuple[Path, Path]) -> None:
    """2026.2.0 runs; a granted command takes it back to 2026.1.0; after an upgrade to 2026.2.0 again, the same
    command (a replay) is refused, also by an updater started afresh (the spent nonce is on disk)."""
    v1, v2 = small_image(tmp_path, keys[0], "2026.1.0"), small_image(tmp_path, keys[0], "2026.2.0")
    server.files.update({"v1.tar": v1.path, "v2.tar": v2.path})
    state, ops = tmp_path / "state", [operator[1].read_text()]
    assert updater(state, keys, ops).handle(command(v2, server.url("v2.tar"))).phase == "committed"

    rollback = image.sign_rollback(command(v1, server.url("v1.tar")), operator[0], ttl_s=600)
    rec = Recorder()
    ota = updater(state, keys, ops, rec)
    final = ota.handle(rollback)
    assert final.phase == "committed", final.detail
    assert rec.phases == ["received", "downloaded", "verified", "installed", "health_check", "committed"]
    assert "operator-signed rollback" in next(st.detail for _, st in rec.published if st.phase == "verified")
    assert ota.running_version() == "2026.1.0"
    assert ota.handle(rollback).detail == "already running this image"  # harmless: nothing changes

    assert ota.handle(command(v2, server.url("v2.tar"))).phase == "committed"
    for again in (ota, updater(state, keys, ops)):  # the replay, before and after a restart
        before = tree_digest(state / "slots")
        replayed = again.handle(rollback)
        assert replayed.phase == "refused", replayed.detail
        assert replayed.detail == f"rollback: nonce {rollback.rollback.nonce} was used before (a replayed command)"
        assert again.running_version() == "2026.2.0" and tree_digest(state / "slots") == before
    assert list(json.loads((state / NONCE_FILE).read_text())) == [rollback.rollback.nonce]


@pytest.mark.parametrize("case", ["unsigned", "foreign_key", "expired", "other_device", "other_image", "overlong",
                                  "no_operator_keys"])
def test_a_rollback_that_does_not_verify_is_refused_before_any_download(
        tmp_path: Path, server: FileServer, keys: tuple[Path, Path], operator: tuple[Path, Path],
        stranger: tuple[Path, Path], case: str) -> None:
    v1, v2 = small_image(tmp_path, keys[0], "2026.1.0"), small_image(tmp_path, keys[0], "2026.2.0")
    server.files.update({"v1.tar": v1.path, "v2.tar": v2.path})
    state = tmp_path / "state"
    ops = [] if case == "no_operator_keys" else [operator[1].read_text()]
    assert updater(state, keys, ops).handle(command(v2, server.url("v2.tar"))).phase == "committed"
    requests, before = len(server.requests), tree_digest(state / "slots")
    older = command(v1, server.url("v1.tar"))
    if case == "unsigned":
        cmd = older
    elif case == "foreign_key":
        cmd = image.sign_rollback(older, stranger[0], ttl_s=600)
    elif case == "expired":
        cmd = image.sign_rollback(older, operator[0], ttl_s=60, now=time.time() - 120)
    elif case == "other_device":  # a valid grant for hive-0008, put on this device's command
        other = image.sign_rollback(older.model_copy(update={"device": "hive-0008"}), operator[0], ttl_s=600)
        cmd = older.model_copy(update={"rollback": other.rollback})
    elif case == "other_image":  # a grant for another archive of the same version
        other = image.sign_rollback(older.model_copy(update={"sha256": "0" * 64}), operator[0], ttl_s=600)
        cmd = older.model_copy(update={"rollback": other.rollback})
    elif case == "overlong":
        cmd = image.sign_rollback(older, operator[0], ttl_s=90 * 86400)
    else:
        cmd = image.sign_rollback(older, operator[0], ttl_s=600)
    expected = {
        "unsigned": "downgrade: 2026.1.0 is older than the running 2026.2.0 (anti-rollback: going back takes a "
                    "rollback command signed by an operator key this device trusts",
        "foreign_key": "rollback: the rollback grant's signature does not verify with any operator key",
        "other_device": "rollback: the rollback grant's signature does not verify",
        "other_image": "rollback: the rollback grant's signature does not verify",
        "expired": "rollback: the grant expired 6",  # 60 s ago, give or take the test's own seconds
        "overlong": "rollback: the grant is valid for 90 days, more than the 30 this device accepts",
        "no_operator_keys": "rollback: this device trusts no operator key ([edge.ota] operator_keys)",
    }[case]
    rec = Recorder()
    final = updater(state, keys, ops, rec).handle(cmd)
    assert final.phase == "refused" and final.detail.startswith(expected), final.detail
    assert rec.phases == ["received", "refused"] and len(server.requests) == requests  # not a byte fetched
    assert tree_digest(state / "slots") == before and not (state / NONCE_FILE).exists()


def test_an_operator_key_the_agent_cannot_use_stops_edge_run_at_start(tmp_path: Path) -> None:
    from tests.edge.test_cli import run

    cfg = tmp_path / "apiary.toml"
    cfg.write_text('[edge.ota]\noperator_keys = ["' + "00" * 31 + '"]\n')  # 31 bytes: neither a key nor a file
    r = run("run", "--site", "north", "--device", "d1", "--broker", "mqtt://127.0.0.1:1", "--config", str(cfg),
            "--state-dir", str(tmp_path), "--model", str(tmp_path / "none.gguf"))
    assert r.exit_code == 2 and "error: [edge.ota] operator_keys: cannot read key file" in r.output, r.output


@pytest.fixture(scope="module")
def older(tmp_path_factory: pytest.TempPathFactory, keys: tuple[Path, Path], student_gguf: Path) -> image.ImageInfo:
    """The student as an older release (2026.12.0, below the built-in 2027.1.0), under its own file name."""
    root = tmp_path_factory.mktemp("older")
    model = root / "student-2026.gguf"
    shutil.copyfile(student_gguf, model)
    return image.build_image(root / "edge-2026.12.0.tar", model, "2026.12.0", keys[0],
                             power_profile={"name": "test", "threads": 1, "n_ctx": 2048})


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_agent_on_mosquitto_takes_only_a_valid_signed_rollback(
        mosquitto, field: Field, server: FileServer, tmp_path: Path, keys: tuple[Path, Path],  # noqa: F811
        operator: tuple[Path, Path], stranger: tuple[Path, Path], builtin, older: image.ImageInfo,  # noqa: F811
        update: image.ImageInfo) -> None:  # noqa: F811
    """The agent runs the built-in 2027.1.0. Unsigned, foreign-signed, expired and other-device rollbacks to
    2026.12.0 arrive on its ota/cmd topic and are refused with their reasons while the old model answers; the
    valid one installs, passes the health check and answers; after 2027.1.0 is installed again, the same valid
    command replayed is refused."""
    server.files.update({"older.tar": older.path, "update.tar": update.path})
    back = OtaCommand(site=AGENT_SITE, device=AGENT_DEVICE, image_version="2026.12.0", url=server.url("older.tar"),
                      sha256=older.sha256, signature=older.signature, size=older.size)
    other = image.sign_rollback(back.model_copy(update={"device": AGENT_DEVICE + "-other"}), operator[0], ttl_s=600)
    refused = [
        (back, "downgrade: 2026.12.0 is older than the running 2027.1.0"),
        (image.sign_rollback(back, stranger[0], ttl_s=600), "rollback: the rollback grant's signature does not verify"),
        (image.sign_rollback(back, operator[0], ttl_s=60, now=time.time() - 600), "rollback: the grant expired"),
        (back.model_copy(update={"rollback": other.rollback}), "rollback: the rollback grant's signature does not"),
    ]
    valid = image.sign_rollback(back, operator[0], ttl_s=600)
    with running_agent(mosquitto.config, field, tmp_path / "state", keys[1], builtin,
                       operator_keys=[operator[1].read_text().strip()]) as agent:
        for n, (cmd, why) in enumerate(refused, start=1):
            field.send(cmd)
            final = field.final(n)
            assert final.phase == "refused" and final.detail.startswith(why), final.detail
            assert field.ask(n).body.model == builtin.version  # the old model answers on
        assert not server.requests

        field.send(valid)
        final = field.final(len(refused) + 1)
        assert final.phase == "committed", final.detail
        wait_until(lambda: agent.image_version == "2026.12.0", 60, "the agent on the older image")
        answer = field.ask(10)
        assert answer.body.model == f"student-2026.gguf:{older.manifest.model.size}" and answer.body.status == "ok"
        wait_until(lambda: any(e.body.image_version == "2026.12.0" for e in field.states.envs), 60,
                   "a state update with the older image version")

        field.send(OtaCommand(site=AGENT_SITE, device=AGENT_DEVICE, image_version="2027.1.0", url=server.url("update.tar"),
                              sha256=update.sha256, signature=update.signature, size=update.size))
        assert field.final(len(refused) + 2).phase == "committed"
        wait_until(lambda: agent.image_version == "2027.1.0", 60, "the agent back on 2027.1.0")
        field.send(valid)  # the replay
        final = field.final(len(refused) + 3)
        assert final.phase == "refused" and "was used before (a replayed command)" in final.detail, final.detail
        assert agent.image_version == "2027.1.0" and field.ask(11).body.status == "ok"


def test_apiary_image_rollback_signs_per_device_grants_that_the_device_installs(
        tmp_path: Path, server: FileServer, keys: tuple[Path, Path], operator: tuple[Path, Path], mosquitto) -> None:
    """`apiary image rollback --broker`: one command per device on its ota/cmd topic, each with its own grant;
    the device's updater installs the older image from it."""
    from typer.testing import CliRunner

    from apiary.cli import app
    from apiary.shared import topics
    from apiary.shared.transport import MqttTransport
    from tests.shared.helpers import Inbox

    v1, v2 = small_image(tmp_path, keys[0], "2026.1.0"), small_image(tmp_path, keys[0], "2026.2.0")
    server.files.update({"v1.tar": v1.path, "v2.tar": v2.path})
    ops = [operator[1].read_text()]
    ota = updater(tmp_path / "state", keys, ops)
    assert ota.handle(command(v2, server.url("v2.tar"))).phase == "committed"
    inbox = Inbox()
    with MqttTransport(mosquitto.config, "devices-watch", persistent=False) as watch:
        watch.subscribe(topics.all_of("ota/cmd", site=SITE), inbox)
        assert watch.wait_subscribed(10)
        r = CliRunner().invoke(app, ["image", "rollback", str(v1.path), "--site", SITE, "--device", DEVICE,
                                     "--device", "hive-0008", "--operator-key", str(operator[0]), "--public-key",
                                     str(keys[1]), "--ttl", "600", "--broker", mosquitto.config.url,
                                     "--download-url", server.url("v1.tar")])
        assert r.exit_code == 0, r.output
        wait_until(lambda: len(inbox.envs) == 2, 10, "two rollback commands")
    assert f"rollback of {SITE}/{DEVICE} to 2026.1.0 published on {topics.ota_command(SITE, DEVICE)}" in r.output
    cmds = {e.body.device: e.body for e in inbox.envs}
    assert cmds[DEVICE].rollback.nonce != cmds["hive-0008"].rollback.nonce
    assert ota.handle(cmds[DEVICE]).phase == "committed" and ota.running_version() == "2026.1.0"
    r = CliRunner().invoke(app, ["image", "rollback", str(v1.path), "--site", SITE, "--device", DEVICE,
                                 "--operator-key", str(operator[0]), "--public-key", str(keys[1])])
    assert r.exit_code == 2 and "give either --url and --api-key" in r.output
