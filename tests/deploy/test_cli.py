"""`apiary image …`, `apiary distill`, `apiary quantize` from the command line: happy paths and clear refusals."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from apiary.cli import app
from apiary.shared.protocol import OtaCommand

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def test_image_keygen_build_verify_and_command(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    r = invoke("image", "keygen", "--out-dir", keys, "--name", "site")
    assert r.exit_code == 0, r.output
    assert (keys / "site.key").is_file() and len((keys / "site.pub").read_text().strip()) == 64
    assert invoke("image", "keygen", "--out-dir", keys, "--name", "site").exit_code == 2  # never overwrites a key

    model = tmp_path / "student-q4_0.gguf"
    model.write_bytes(b"GGUF" + bytes(1000))
    edge_cfg = tmp_path / "edge.toml"
    edge_cfg.write_text("[policy]\nthreshold = -1.5\n")
    archive = tmp_path / "img.tar"
    r = invoke("image", "build", model, "--version", "2025.07.1", "--key", keys / "site.key", "--out", archive,
               "--edge-config", edge_cfg, "--threads", "1")
    assert r.exit_code == 0, r.output
    built = json.loads(r.output)
    assert built["image_version"] == "2025.07.1" and built["model"]["filename"] == model.name

    r = invoke("image", "verify", archive, "--public-key", keys / "site.pub", "--sha256", built["sha256"])
    assert r.exit_code == 0, r.output
    manifest = json.loads(r.output)["manifest"]
    assert manifest["edge_config"] == {"policy": {"threshold": -1.5}} and manifest["power_profile"]["threads"] == 1

    invoke("image", "keygen", "--out-dir", keys, "--name", "other")
    r = invoke("image", "verify", archive, "--public-key", keys / "other.pub")
    assert r.exit_code == 1 and "refused (signature)" in r.output

    r = invoke("image", "command", archive, "--site", "farm-1", "--device", "hive-0001",
               "--url", "http://cloud:8000/images/img.tar", "--public-key", keys / "site.pub")
    assert r.exit_code == 0, r.output
    cmd = OtaCommand.model_validate_json(r.output)
    assert (cmd.sha256, cmd.signature, cmd.size) == (built["sha256"], built["signature"], built["size"])


def test_image_command_publishes_to_mosquitto(tmp_path: Path, mosquitto) -> None:
    import threading

    from apiary.shared import image, topics
    from apiary.shared.transport import MqttTransport

    priv, pub = image.write_keypair(tmp_path, "k")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    info = image.build_image(tmp_path / "img.tar", model, "1.0.0", priv)
    got: list = []
    arrived = threading.Event()
    with MqttTransport(mosquitto.config, "edge-listener") as edge:
        edge.subscribe(topics.ota_command("farm-1", "hive-0001"), lambda t, env: (got.append(env.body), arrived.set()))
        r = invoke("image", "command", info.path, "--site", "farm-1", "--device", "hive-0001", "--url",
                   "http://cloud/img.tar", "--public-key", pub, "--broker", mosquitto.config.url)
        assert r.exit_code == 0, r.output
        assert arrived.wait(10)
    assert got[0].sha256 == info.sha256 and got[0].image_version == "1.0.0"


@pytest.mark.parametrize("args,message", [
    (["distill", "--steps", "0", "--teacher", "{model}"], "steps must be >= 1"),
    (["distill", "--teacher", "/no/such.gguf"], "teacher model not found"),
    (["quantize", "{tmp}/nothing"], "cannot export"),
    (["quantize", "{tmp}", "--qtype", "q2_k"], "qtype must be one of"),
    (["image", "build", "{model}", "--version", "1.0", "--key", "{tmp}/missing.key"], "cannot read key file"),
])
def test_bad_arguments_fail_with_a_clear_message(tmp_path: Path, args: list[str], message: str) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    r = invoke(*[a.format(tmp=tmp_path, model=model) for a in args])
    assert r.exit_code == 2 and message in r.output, r.output
