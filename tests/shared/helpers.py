"""Test helpers for anything that talks MQTT: wait for a condition, record what a handler receives, the
shipped ACL broker, foreign clients (raw payloads, a device process with a Last Will)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack

from apiary.shared.config import MqttConfig
from apiary.shared.protocol import Body, Envelope, encode, make

ROOT = Path(__file__).resolve().parents[2]


def wait_until(pred: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


class Inbox:
    """A thread-safe MQTT handler that records (topic, envelope) pairs."""

    def __init__(self) -> None:
        self.items: list[tuple[str, Envelope]] = []
        self._lock = threading.Lock()

    def __call__(self, topic: str, env: Envelope) -> None:
        with self._lock:
            self.items.append((topic, env))

    @property
    def envs(self) -> list[Envelope]:
        with self._lock:
            return [e for _, e in self.items]

    def wait(self, n: int, timeout: float = 15.0) -> list[Envelope]:
        wait_until(lambda: len(self.items) >= n, timeout, f"{n} messages (have {len(self.items)})")
        return self.envs


class AclBroker:
    """Mosquitto from the shipped auth config and ACL (``deploy/mosquitto/apiary.acl``).

    Users: ``cloud`` (all of ``apiary/#``), ``bridge`` (writes events) and the devices
    ``hive-0001`` and ``hive-0002`` (each only under ``apiary/v1/+/<its id>/#``), as a fleet runs it.
    """

    PASSWORDS = {"cloud": "pw-cloud", "bridge": "pw-bridge", "hive-0001": "pw-hive-0001", "hive-0002": "pw-hive-0002"}

    def __init__(self, directory: Path) -> None:
        from apiary.shared.brokers import AUTH_CONFIG, MosquittoBroker, make_password_file

        passwd = make_password_file(directory / "passwd", self.PASSWORDS)
        self.broker = MosquittoBroker(data_dir=directory / "mosquitto", config=AUTH_CONFIG,
                                      variables={"password_file": str(passwd)})

    def login(self, user: str) -> MqttConfig:
        """How ``user`` reaches the broker (fast reconnects, for tests)."""
        return self.broker.config.model_copy(update={"username": user, "password": self.PASSWORDS[user],
                                                     "reconnect_min_s": 0.1, "reconnect_max_s": 0.5})


def publish_raw(config: MqttConfig, topic: str, payload: bytes, *, retain: bool = False) -> None:
    """Publish bytes our encoder would refuse, as a foreign client does: ``mosquitto_pub`` at QoS 1.

    It returns once the broker acknowledged the message, so a later publish by any client
    reaches a subscriber after it (Mosquitto queues to subscribers before it acknowledges).
    """
    with tempfile.NamedTemporaryFile(suffix=".msgpack") as f:
        f.write(payload)
        f.flush()
        cmd = ["mosquitto_pub", "-h", config.host, "-p", str(config.port), "-q", "1", "-t", topic, "-f", f.name,
               "-i", f"raw-{os.getpid()}"]
        if config.username is not None:
            cmd += ["-u", config.username, "-P", config.password or ""]
        if retain:
            cmd.append("-r")
        subprocess.run(cmd, check=True, timeout=30, capture_output=True)


def forged_payload(body: Body, **fields: Any) -> bytes:
    """``body`` in a valid envelope, then ``fields`` written over its wire body (values no sender of ours makes)."""
    raw = msgpack.unpackb(encode(make(body, sender="forger")))
    raw["body"].update(fields)
    return msgpack.packb(raw, use_bin_type=True)


_DEVICE_SCRIPT = textwrap.dedent("""
    import sys, time
    from apiary.shared import topics
    from apiary.shared.config import MqttConfig
    from apiary.shared.protocol import DeviceState, make
    from apiary.shared.transport import MqttTransport
    config, site, device, session = MqttConfig.model_validate_json(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])

    def state(status):
        body = DeviceState(site=site, device=device, status=status, online=status != "death", session=session)
        return make(body, sender=device)

    t = MqttTransport(config, device, will=(topics.state(site, device), state("death")))
    t.start(10)
    assert t.publish(topics.state(site, device), state("birth"), retain=True, timeout=10)
    print("up", flush=True)
    time.sleep(120)
""")


@contextlib.contextmanager
def device_with_will(config: MqttConfig, site: str, device: str, session: int) -> Iterator[subprocess.Popen]:
    """A device process that published its retained birth for ``session``, with its death as Last Will.

    ``proc.kill()`` is a power cut: no DISCONNECT, so the broker publishes the Last Will.
    """
    config = config.model_copy(update={"keepalive": 5})
    proc = subprocess.Popen([sys.executable, "-c", _DEVICE_SCRIPT, config.model_dump_json(), site, device,
                             str(session)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
