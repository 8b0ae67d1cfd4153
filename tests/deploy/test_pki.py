"""`apiary pki`: a fleet CA and per-node certificates, and a real Mosquitto that takes the certificate as identity."""
from __future__ import annotations

import stat
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from apiary.cli import app
from apiary.deploy.pki import PkiError, init_ca, issue, write_acl
from apiary.shared import topics
from apiary.shared.brokers import MTLS_CONFIG, MosquittoBroker
from apiary.shared.config import MqttConfig, mqtt_settings
from apiary.shared.protocol import SensorEvent, make
from apiary.shared.transport import MqttTransport, TransportError

pytestmark = pytest.mark.timeout(120)
SITE = "s1"


def test_cli_makes_a_ca_and_certificates_and_refuses_mistakes(tmp_path: Path) -> None:
    runner = CliRunner()
    pki = tmp_path / "pki"
    result = runner.invoke(app, ["pki", "init", "--dir", str(pki)])
    assert result.exit_code == 0, result.output
    for args in (["issue", "hive-0001"], ["issue", "broker", "--server", "--host", "127.0.0.1", "--host", "localhost"]):
        result = runner.invoke(app, ["pki", *args, "--dir", str(pki)])
        assert result.exit_code == 0, result.output
    for key in ("ca.key", "hive-0001.key", "broker.key"):
        assert stat.S_IMODE((pki / key).stat().st_mode) == 0o600
    result = runner.invoke(app, ["pki", "issue", "cloud", "--role", "cloud", "--dir", str(pki)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["pki", "issue", "hive-0001", "--site", "orchard", "--dir", str(pki)])  # re-issued
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["pki", "acl", "--dir", str(pki), "--out", str(tmp_path / "fleet.acl")])
    assert result.exit_code == 0, result.output
    acl = (tmp_path / "fleet.acl").read_text()
    assert "user hive-0001\ntopic readwrite apiary/v1/orchard/hive-0001/#" in acl  # the latest issue counts
    assert "user cloud\ntopic readwrite apiary/#" in acl and "pattern" not in acl
    for args, message in [
        (["init", "--dir", str(pki)], "already holds a CA"),
        (["issue", "hive-0002", "--role", "king", "--dir", str(pki)], "role 'king'"),
        (["issue", "cloud-2", "--role", "cloud", "--site", "s1", "--dir", str(pki)], "binds a device"),
        (["acl", "--dir", str(tmp_path / "empty")], "issued no client certificates"),
        (["issue", "hive/0001", "--dir", str(pki)], "must be 1-64"),
        (["issue", "hive-0002", "--dir", str(tmp_path / "nowhere")], "no CA in"),
        (["issue", "b", "--server", "--host", "not a host", "--dir", str(pki)], "neither an IP address"),
    ]:
        result = runner.invoke(app, ["pki", *args])
        assert result.exit_code == 2 and message in result.output, (args, result.output)


def test_the_certificate_is_the_identity_on_a_real_mosquitto(tmp_path: Path) -> None:
    """hive-0001's certificate publishes only as hive-0001 and only on its site (the ACL `apiary pki acl` writes);
    no certificate, or one from another CA, gets nowhere."""
    pki = tmp_path / "pki"
    ca = init_ca(pki)
    server = issue(pki, "broker", server=True, hosts=["127.0.0.1"])
    issue(pki, "cloud", role="cloud")
    issue(pki, "hive-0001", site=SITE)
    init_ca(tmp_path / "rogue")
    issue(tmp_path / "rogue", "hive-0002")
    acl = write_acl(pki, tmp_path / "fleet.acl")
    broker = MosquittoBroker(data_dir=tmp_path / "broker", config=MTLS_CONFIG, variables={
        "cafile": str(ca.cert), "certfile": str(server.cert), "keyfile": str(server.key), "acl_file": str(acl)})
    plain = broker.start()

    def login(node: str, folder: Path = pki) -> MqttConfig:
        return MqttConfig(host=plain.host, port=plain.port, tls=True, ca_file=str(ca.cert),
                          cert_file=str(folder / f"{node}.crt"), key_file=str(folder / f"{node}.key"))

    received: list[tuple[str, int]] = []
    lock = threading.Lock()

    def on_event(topic, env) -> None:
        with lock:
            received.append((topic, env.body.seq))

    def event(device: str, seq: int):
        return make(SensorEvent(site=SITE, device=device, seq=seq, timestamp=1.0, readings={}), sender=device)

    started: list[MqttTransport] = []
    try:
        cloud = MqttTransport(login("cloud"), "cloud-recorder").start(10)
        started.append(cloud)
        cloud.subscribe(topics.all_of("event"), on_event)
        hive = MqttTransport(login("hive-0001"), "hive-0001").start(10)
        started.append(hive)
        assert hive.protocol == "5"  # so a refused publish is told in its PUBACK
        assert hive.publish(topics.event(SITE, "hive-0001"), event("hive-0001", 1), timeout=10)
        assert not hive.publish(topics.event(SITE, "hive-0002"), event("hive-0002", 2), timeout=10)
        phantom = make(SensorEvent(site="other-site", device="hive-0001", seq=3, timestamp=1.0, readings={}),
                       sender="hive-0001")
        assert not hive.publish(topics.event("other-site", "hive-0001"), phantom, timeout=10)  # not its site
        deadline = time.monotonic() + 10
        while not received and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # a forged event would have arrived by now
        assert received == [(topics.event(SITE, "hive-0001"), 1)]
        for cfg in (plain.model_copy(update={"tls": True, "ca_file": str(ca.cert)}),  # no client certificate
                    login("hive-0002", tmp_path / "rogue")):  # a certificate from another CA
            with pytest.raises(TransportError):
                MqttTransport(cfg, "intruder").start(timeout=3)
    finally:
        for t in started:
            t.stop(flush_timeout=0)
        broker.close()


def test_every_room_reads_the_broker_the_same_way(tmp_path: Path) -> None:
    """[mqtt] holds the node's certificate; --broker only says where: the certificate is still presented."""
    conf = tmp_path / "apiary.toml"
    conf.write_text('[mqtt]\nhost = "10.0.0.5"\ntls = true\nca_file = "ca.crt"\ncert_file = "hive-0001.crt"\n'
                    'key_file = "hive-0001.key"\nkeepalive = 20\n')
    from_file = mqtt_settings(conf, environ={})
    assert (from_file.host, from_file.port, from_file.tls, from_file.cert_file) == ("10.0.0.5", 1883, True,
                                                                                 "hive-0001.crt")
    over = mqtt_settings(conf, "mqtts://broker.example:8884", environ={})
    assert (over.host, over.port, over.tls, over.cert_file, over.keepalive) == ("broker.example", 8884, True,
                                                                              "hive-0001.crt", 20)
    from apiary.cloud.settings import load_settings

    cloud = load_settings(conf, broker="mqtts://broker.example:8884", db=str(tmp_path / "c.db"))
    assert cloud.mqtt is not None and (cloud.mqtt.cert_file, cloud.mqtt.port) == ("hive-0001.crt", 8884)
    with pytest.raises(PkiError):
        issue(tmp_path, "x")
