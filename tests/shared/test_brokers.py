"""The brokers the mesh runs on: the shipped Mosquitto configs, the embedded amqtt, `apiary broker`."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import paho.mqtt.client as paho
import pytest

from apiary.shared import topics
from apiary.shared.brokers import (AUTH_CONFIG, DEFAULT_ACL, TLS_CONFIG, BrokerError, EmbeddedBroker, MosquittoBroker,
                            free_port, make_password_file, wait_for_port)
from apiary.shared.config import MqttConfig
from apiary.shared.protocol import SensorEvent, make
from apiary.shared.transport import MqttTransport

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]


def conf_values(text: str) -> dict[str, list[str]]:
    """Option -> values of a rendered Mosquitto config (comments dropped)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, _, value = line.partition(" ")
            out.setdefault(key, []).append(value.strip())
    return out


def test_shipped_config_sets_limits_for_bursts_and_persistence(tmp_path) -> None:
    broker = MosquittoBroker(port=18830, data_dir=tmp_path)
    values = conf_values(broker.render())
    assert values["listener"] == ["18830 127.0.0.1"], "loopback only"
    assert values["persistence"] == ["true"]
    assert values["persistence_location"] == [f"{tmp_path}/"]
    assert int(values["autosave_interval"][0]) <= 10
    # A 5,000-message QoS 1 burst must fit the per-client queue with room to spare,
    # and the byte cap must hold it too (envelopes are ~300 B; allow 10x).
    assert int(values["max_queued_messages"][0]) >= 5000 * 10
    assert int(values["max_queued_bytes"][0]) >= 5000 * 3000
    assert 0 < int(values["max_inflight_messages"][0]) <= 1000
    assert int(values["max_packet_size"][0]) > MqttConfig().max_payload
    assert "${" not in broker.render()


def test_secured_configs_demand_passwords_and_acls(tmp_path) -> None:
    with pytest.raises(BrokerError, match="password_file"):
        MosquittoBroker(data_dir=tmp_path, config=AUTH_CONFIG).render()
    auth = conf_values(MosquittoBroker(data_dir=tmp_path, config=AUTH_CONFIG,
                                       variables={"password_file": "/x/passwd"}).render())
    assert auth["allow_anonymous"] == ["false"]
    assert auth["password_file"] == ["/x/passwd"] and auth["acl_file"] == [str(DEFAULT_ACL)]
    tls = conf_values(MosquittoBroker(data_dir=tmp_path, config=TLS_CONFIG, variables={
        "password_file": "p", "cafile": "ca", "certfile": "crt", "keyfile": "key"}).render())
    assert tls["allow_anonymous"] == ["false"] and tls["certfile"] == ["crt"]
    acl = DEFAULT_ACL.read_text()
    assert "pattern readwrite apiary/v1/+/%u/#" in acl


def test_password_file_is_hashed_and_validated(tmp_path) -> None:
    path = make_password_file(tmp_path / "passwd", {"hive-01": "s3cret", "cloud": "other"})
    lines = path.read_text().splitlines()
    assert sorted(line.split(":", 1)[0] for line in lines) == ["cloud", "hive-01"]
    assert "s3cret" not in path.read_text()
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(BrokerError):
        make_password_file(tmp_path / "bad", {"a:b": "x"})
    with pytest.raises(BrokerError):
        make_password_file(tmp_path / "empty", {})


def test_mosquitto_start_restart_stop(tmp_path) -> None:
    broker = MosquittoBroker(data_dir=tmp_path)
    try:
        cfg = broker.start()
        assert cfg.port > 0 and broker.running
        broker.restart()
        assert broker.config.port == cfg.port and broker.running
        assert (tmp_path / "mosquitto.db").exists(), "a clean stop writes the persistence database"
        broker.stop()
        assert not broker.running
        assert not wait_for_port("127.0.0.1", cfg.port, timeout=0.3)
    finally:
        broker.close()
    assert tmp_path.exists(), "a caller-owned data dir is kept"


def test_mosquitto_bad_config_fails_with_its_log(tmp_path) -> None:
    template = tmp_path / "broken.conf"
    template.write_text("listener ${port} ${host}\nno_such_option 1\n")
    broker = MosquittoBroker(data_dir=tmp_path / "data", config=template)
    with pytest.raises(BrokerError, match="no_such_option|Unknown configuration"):
        broker.start(timeout=5)
    assert not broker.running
    with pytest.raises(BrokerError, match="cannot read"):
        MosquittoBroker(data_dir=tmp_path, config=tmp_path / "missing.conf").start()


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a LISTEN socket on ``port``, from /proc/net/tcp (IPv4)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if state == "0A" and int(p, 16) == port:
            found.add(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return found


def test_embedded_broker_binds_loopback_and_refuses_mqtt5_at_once() -> None:
    broker = EmbeddedBroker()
    cfg = broker.start()
    try:
        assert listening_addresses(cfg.port) == {"127.0.0.1"}
        outcome: list[str] = []
        raw = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="v5-probe", protocol=paho.MQTTv5)
        raw.on_connect = lambda c, u, f, reason, p: outcome.append(reason.getName())
        raw.connect(cfg.host, cfg.port)
        raw.loop_start()
        deadline = time.monotonic() + 5
        while not outcome and time.monotonic() < deadline:
            time.sleep(0.01)
        raw.disconnect()
        raw.loop_stop()
        assert outcome[:1] == ["Unsupported protocol version"]
    finally:
        broker.stop()
    assert not broker.running
    assert not wait_for_port("127.0.0.1", cfg.port, timeout=0.3)


def raw_client(cfg: MqttConfig, client_id: str, *, clean: bool = True) -> tuple[paho.Client, list[bytes], list[str]]:
    """A plain paho client (3.1.1) recording what it receives and why it was disconnected."""
    got: list[bytes] = []
    gone: list[str] = []
    c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv311,
                    clean_session=clean)
    c.on_message = lambda _c, _u, msg: got.append(msg.payload)
    c.on_disconnect = lambda _c, _u, _f, reason, _p: gone.append(str(reason))
    c.connect(cfg.host, cfg.port)
    c.loop_start()
    return c, got, gone


def until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_embedded_broker_disconnects_a_client_sending_an_oversized_packet() -> None:
    """A 200 MB publish pushed a subscriber of the embedded broker to 616 MiB (#15, observation 8): now its
    sender is cut off at the fixed header, as Mosquitto's max_packet_size does, and nothing is relayed."""
    import apiary.shared.brokers as brokers

    broker = EmbeddedBroker()
    cfg = broker.start()
    try:
        sub, got, _ = raw_client(cfg, "sub")
        sub.subscribe("t/#", qos=1)
        big, _, big_gone = raw_client(cfg, "big")
        assert until(lambda: big.is_connected() and sub.is_connected())
        big.publish("t/big", b"x" * (brokers.MAX_PACKET_SIZE + 1), qos=1)
        assert until(lambda: bool(big_gone)), "the oversized sender stayed connected"
        small, _, _ = raw_client(cfg, "small")
        assert until(small.is_connected)
        small.publish("t/small", b"ok", qos=1)
        assert until(lambda: got == [b"ok"]), got
        for c in (sub, big, small):
            c.disconnect()
            c.loop_stop()
    finally:
        broker.stop()


def test_embedded_broker_bounds_the_queue_of_an_offline_session(monkeypatch) -> None:
    import apiary.shared.brokers as brokers

    monkeypatch.setattr(brokers, "MAX_QUEUED_MESSAGES", 5)
    broker = EmbeddedBroker()
    cfg = broker.start()
    try:
        sub, _, _ = raw_client(cfg, "sleepy", clean=False)
        assert until(sub.is_connected)
        sub.subscribe("t/#", qos=1)
        time.sleep(0.3)
        sub.disconnect()
        sub.loop_stop()
        pub, _, _ = raw_client(cfg, "pub")
        assert until(pub.is_connected)
        for i in range(20):
            pub.publish("t/x", str(i).encode(), qos=1).wait_for_publish(5)
        back, got, _ = raw_client(cfg, "sleepy", clean=False)
        assert until(lambda: len(got) >= 5)
        time.sleep(0.5)  # anything past the limit would arrive now
        assert got == [str(i).encode() for i in range(5)]
        for c in (pub, back):
            c.disconnect()
            c.loop_stop()
    finally:
        broker.stop()


def test_embedded_broker_survives_subscriptions_while_it_replays_retained_messages() -> None:
    """amqtt replays retained messages to a connecting client topic by topic, awaiting each; a subscription
    from another client meanwhile raised "dictionary changed size during iteration" and ended the new
    client's session (a traceback in `apiary demo`'s log). Here the replay is slowed down so that the
    subscriptions surely land inside it: the new client stays connected and gets what is published."""
    import asyncio

    broker = EmbeddedBroker()
    cfg = broker.start()
    amqtt = broker._broker
    replay = amqtt._publish_retained_messages_for_subscription

    async def slow_replay(*args, **kwargs):
        await asyncio.sleep(0.05)
        return await replay(*args, **kwargs)

    amqtt._publish_retained_messages_for_subscription = slow_replay
    clients = []
    try:
        busy, _, _ = raw_client(cfg, "busy")
        clients.append(busy)
        assert until(busy.is_connected)
        for i in range(10):
            busy.subscribe(f"old/{i}", qos=1)
        assert until(lambda: len(amqtt._subscriptions) == 10)
        late, got, gone = raw_client(cfg, "late")
        clients.append(late)
        for i in range(10):  # while the late client's replay walks the ten old topics
            busy.subscribe(f"new/{i}", qos=1)
            time.sleep(0.02)
        assert until(lambda: len(amqtt._subscriptions) == 20)
        late.subscribe("late/x", qos=1)
        assert until(lambda: "late/x" in amqtt._subscriptions)
        pub, _, _ = raw_client(cfg, "pub")
        clients.append(pub)
        assert until(pub.is_connected)
        pub.publish("late/x", b"still here", qos=1).wait_for_publish(5)
        assert until(lambda: got == [b"still here"]), gone
        assert gone == [] and late.is_connected()
    finally:
        for c in clients:
            c.disconnect()
            c.loop_stop()
        broker.stop()


def test_embedded_broker_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(BrokerError, match="amqtt"):
            EmbeddedBroker(port=s.getsockname()[1]).start(timeout=5)


@pytest.mark.parametrize("kind", ["embedded", "mosquitto"])
def test_apiary_broker_command_serves_until_ctrl_c(kind, tmp_path) -> None:
    port = free_port()
    args = [sys.executable, "-m", "apiary", "broker", "--port", str(port)]
    if kind == "mosquitto":
        args += ["--mosquitto", "--data-dir", str(tmp_path)]
    # Its own process group, so Ctrl-C can be delivered the way a terminal does: to the whole group.
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "APIARY_LOG_LEVEL": "WARNING"})
    try:
        assert wait_for_port("127.0.0.1", port, timeout=20, alive=lambda: proc.poll() is None), proc.stderr.read()
        cfg = MqttConfig(port=port)
        got = []
        sub = MqttTransport(cfg, "cli-sub", persistent=False).start()
        sub.subscribe(topics.all_of("event"), lambda t, e: got.append(e))
        pub = MqttTransport(cfg, "cli-pub", persistent=False).start()
        env = make(SensorEvent(site="s", device="hive-01", seq=1, timestamp=1.0, readings={}), sender="cli-pub")
        assert pub.publish(topics.event("s", "hive-01"), env, timeout=10)
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got and got[0].id == env.id
        pub.stop()
        sub.stop()
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert f"mqtt://127.0.0.1:{port}" in out and "broker stopped" in out
        assert not wait_for_port("127.0.0.1", port, timeout=0.3), "the broker outlived the command"
        if kind == "mosquitto":
            assert (tmp_path / "mosquitto.db").exists(), "Mosquitto was stopped cleanly and saved its state"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        kill_mosquitto_using(tmp_path / "mosquitto.conf")  # Mosquitto has its own session: never leave it behind


def kill_mosquitto_using(conf: Path) -> None:
    """SIGTERM the Mosquitto started with exactly this config file, if it is still running."""
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) >= 3 and argv[0].endswith(b"mosquitto") and argv[2] == str(conf).encode():
            os.kill(int(entry.name), signal.SIGTERM)


@pytest.mark.parametrize("kind", ["embedded", "mosquitto"])
def test_apiary_broker_command_reports_a_taken_port(kind, tmp_path) -> None:
    """Never "listening" (on someone else's socket) then "exited unexpectedly": the taken port, at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        args = [sys.executable, "-m", "apiary", "broker", "--port", str(port)]
        if kind == "mosquitto":
            args += ["--mosquitto", "--data-dir", str(tmp_path)]
        proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "error:" in proc.stderr and "Traceback" not in proc.stderr
    assert "listening" not in proc.stdout and "unexpectedly" not in proc.stderr
    if kind == "mosquitto":
        assert f"port {port}" in proc.stderr and "in use" in proc.stderr, proc.stderr


def test_mosquitto_on_a_taken_port_is_refused_before_it_starts(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        broker = MosquittoBroker(port=s.getsockname()[1], data_dir=tmp_path)
        with pytest.raises(BrokerError, match=f"port {s.getsockname()[1]} .*in use"):
            broker.start()
        assert not broker.running and not broker.conf_path.exists()


def test_embedded_broker_restarts_on_its_port_after_a_failed_shutdown(monkeypatch) -> None:
    """amqtt's shutdown was seen cancelled from inside (a client mid-handshake, under load): its listener stayed open and
    the restart on the same port failed ("address already in use"). The listener is closed anyway, and nothing amqtt
    left waiting is destroyed later with the loop closed ("Exception ignored", whose report broke pytest's AST parsing
    on Python 3.11 and ended a test run)."""
    import asyncio
    import gc

    unraisable: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    broker = EmbeddedBroker()
    broker.start()
    port = broker.port
    pub = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="hive-01", protocol=paho.MQTTv311)
    pub.connect("127.0.0.1", port)
    pub.loop_start()
    try:
        async def shutdown() -> None:  # what amqtt's shutdown did: cancelled midway, before closing its listener
            await asyncio.sleep(0)
            raise asyncio.CancelledError

        monkeypatch.setattr(broker._broker, "shutdown", shutdown)
        broker.stop()
        gc.collect()
        broker.start()  # the same port
        assert broker.port == port and broker.running
        got: list[bytes] = []
        sub = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="cloud", protocol=paho.MQTTv311)
        sub.on_message = lambda client, userdata, message: got.append(message.payload)
        sub.connect("127.0.0.1", port)
        sub.subscribe("t", qos=1)
        sub.loop_start()
        time.sleep(0.5)
        sub.publish("t", b"after the restart", qos=1).wait_for_publish(5)
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        sub.loop_stop()
        sub.disconnect()
        assert got == [b"after the restart"]
    finally:
        pub.loop_stop()
        broker.stop()
    gc.collect()
    assert unraisable == []
