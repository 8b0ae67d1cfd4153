"""MQTT brokers the mesh runs on: a real Mosquitto from the shipped config, or an embedded one.

``MosquittoBroker`` renders ``deploy/mosquitto/*.conf`` (persistence on, queue limits set
for bursts) and runs Debian's ``mosquitto`` on a loopback port; tests and production use
the same file. ``EmbeddedBroker`` runs ``amqtt`` in a background thread, bound to
loopback: the zero-install default for ``apiary broker`` and ``apiary demo``. amqtt speaks
MQTT 3.1.1 only and has no shared subscriptions; the transport adapts to both (see
:mod:`apiary.shared.transport`).
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import getpass
import shutil
import signal
import socket
import string
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

from apiary.shared.config import MqttConfig
from apiary.shared.logs import get_logger

log = get_logger(__name__)

# deploy/ sits next to shared/ both in the source tree and in an installed wheel.
MOSQUITTO_DIR = Path(__file__).resolve().parent.parent / "deploy" / "mosquitto"
DEFAULT_CONFIG = MOSQUITTO_DIR / "mosquitto.conf"
AUTH_CONFIG = MOSQUITTO_DIR / "mosquitto-auth.conf"
TLS_CONFIG = MOSQUITTO_DIR / "mosquitto-tls.conf"
MTLS_CONFIG = MOSQUITTO_DIR / "mosquitto-mtls.conf"  # client certificates are the identity
DEFAULT_ACL = MOSQUITTO_DIR / "apiary.acl"
# The embedded broker holds the shipped Mosquitto config's limits (deploy/mosquitto/mosquitto.conf).
MAX_PACKET_SIZE = 266240  # max_packet_size: bytes after the fixed header; larger: the client is disconnected
MAX_QUEUED_MESSAGES = 100000  # max_queued_messages: per offline persistent session; beyond, new messages dropped


class BrokerError(RuntimeError):
    """A broker could not be configured, started or stopped."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (callers retry if someone takes it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _check_port_free(host: str, port: int) -> None:
    """:class:`BrokerError` when ``host:port`` cannot be listened on (bound as Mosquitto binds: SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen()
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise BrokerError(f"port {port} on {host} is in use: stop what listens there or choose another "
                                  "--port") from None
            raise BrokerError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def wait_for_port(host: str, port: int, timeout: float, alive: Callable[[], bool] | None = None) -> bool:
    """Poll until a TCP connect to host:port succeeds; stop early when ``alive()`` is false."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            return False
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.02)
    return False


def make_password_file(path: str | Path, users: dict[str, str]) -> Path:
    """Write a Mosquitto password file (hashed by ``mosquitto_passwd -b``) for ``users``."""
    tool = shutil.which("mosquitto_passwd")
    if tool is None:
        raise BrokerError("mosquitto_passwd not found: apt-get install mosquitto")
    if not users:
        raise BrokerError("a password file needs at least one user")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    path.chmod(0o600)
    for user, password in users.items():
        if not user or ":" in user:
            raise BrokerError(f"invalid MQTT username {user!r}")
        proc = subprocess.run([tool, "-b", str(path), user, password], capture_output=True, text=True)
        if proc.returncode != 0:
            raise BrokerError(f"mosquitto_passwd failed for {user!r}: {proc.stderr.strip() or proc.stdout.strip()}")
    return path


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (Mosquitto saves its database), then SIGKILL if it hangs."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class MosquittoBroker:
    """A Mosquitto process on a loopback port, configured from a shipped template.

    ``variables`` fill the template's extra placeholders (``password_file``, ``acl_file``).
    ``restart()`` keeps port and data dir, so persistent sessions and queued messages
    survive it exactly as they would a production restart.
    """

    def __init__(self, port: int = 0, data_dir: str | Path | None = None, config: str | Path = DEFAULT_CONFIG,
                 persistence: bool = True, host: str = "127.0.0.1", variables: dict[str, str] | None = None,
                 binary: str = "mosquitto") -> None:
        self.host = host
        self.port = port
        self.template = Path(config)
        self.persistence = persistence
        self.variables = dict(variables or {})
        self.binary = binary
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp(prefix="apiary-mosquitto-"))
        self.conf_path = self.data_dir / "mosquitto.conf"
        self.log_path = self.data_dir / "mosquitto.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def config(self) -> MqttConfig:
        return MqttConfig(host=self.host, port=self.port)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def render(self) -> str:
        """The config text with every placeholder filled; :class:`BrokerError` names a missing one."""
        try:
            text = self.template.read_text()
        except OSError as e:
            raise BrokerError(f"cannot read Mosquitto config template {self.template}: {e}") from None
        values = {"host": self.host, "port": str(self.port), "data_dir": str(self.data_dir),
                  "persistence": "true" if self.persistence else "false", "user": getpass.getuser(),
                  "acl_file": str(DEFAULT_ACL), **self.variables}
        try:
            return string.Template(text).substitute(values)
        except (KeyError, ValueError) as e:
            raise BrokerError(f"{self.template}: no value for placeholder {e}") from None

    def start(self, timeout: float = 10.0) -> MqttConfig:
        if shutil.which(self.binary) is None:
            raise BrokerError(f"{self.binary} not found: apt-get install mosquitto")
        if self.running:
            return self.config
        pick_port = self.port == 0
        if not pick_port:
            # Else a connect to whoever holds the port would pass for Mosquitto being up, until it exits.
            _check_port_free(self.host, self.port)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(5 if pick_port else 1):
            if pick_port:
                self.port = free_port(self.host)
            self.conf_path.write_text(self.render())
            with open(self.log_path, "ab") as logf:
                # Own session: a terminal's Ctrl-C reaches only us, and we stop Mosquitto cleanly (SIGTERM saves).
                self._proc = subprocess.Popen([self.binary, "-c", str(self.conf_path)], stdout=logf,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True)
            # Mosquitto runs in its own session, so make sure it never outlives this interpreter.
            weakref.finalize(self._proc, _stop_process, self._proc)
            if wait_for_port(self.host, self.port, timeout, alive=lambda: self._proc.poll() is None):
                log.info("mosquitto up on %s:%d (data %s)", self.host, self.port, self.data_dir)
                return self.config
            self._terminate()
        if pick_port:
            self.port = 0
        raise BrokerError(f"mosquitto did not start; log tail:\n{self.log_tail()}")

    def stop(self) -> None:
        """Clean stop (SIGTERM): Mosquitto writes its persistence database before exiting."""
        self._terminate()

    def kill(self) -> None:
        """Crash stop (SIGKILL): whatever was not autosaved is gone, like a power cut."""
        if self.running:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(10)
        self._proc = None

    def restart(self, timeout: float = 10.0) -> MqttConfig:
        self.stop()
        return self.start(timeout)

    def close(self) -> None:
        """Stop and, if this object created the data dir, remove it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _terminate(self) -> None:
        if self._proc is not None:
            _stop_process(self._proc)
        self._proc = None

    def __enter__(self) -> "MosquittoBroker":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SnapshotDict(dict):
    """A dict whose iteration (keys, values, items) walks a snapshot taken when the loop starts: a loop
    that awaits between items sees the table as it was, and a concurrent insert or delete cannot break it."""

    def __iter__(self) -> Iterator[Any]:
        return iter(list(dict.keys(self)))

    def keys(self) -> list[Any]:  # type: ignore[override]
        return list(dict.keys(self))

    def values(self) -> list[Any]:  # type: ignore[override]
        return list(dict.values(self))

    def items(self) -> list[tuple[Any, Any]]:  # type: ignore[override]
        return list(dict.items(self))


@functools.cache
def _amqtt_classes() -> tuple[type, type]:
    """The two amqtt extensions the embedded broker needs (built lazily: amqtt is only imported here).

    * ``OpenAuthPlugin`` admits every client *without* flagging it anonymous: amqtt's own
      AnonymousAuthPlugin does, and amqtt then queues nothing for an anonymous persistent
      session while it is offline; the mesh relies on that queue.
    * ``Mqtt311Broker`` answers an MQTT 5 CONNECT with "unsupported protocol version" right
      away. Stock amqtt misreads the v5 properties and waits for bytes that never come, which
      would stall every client's MQTT 5 attempt until its timeout. It also holds Mosquitto's
      limits, which stock amqtt lacks: a packet over ``MAX_PACKET_SIZE`` disconnects its client
      as soon as its fixed header says so (a 200 MB publish is never read, let alone relayed),
      and an offline session queues at most ``MAX_QUEUED_MESSAGES``. Its subscription table is a
      ``SnapshotDict``: amqtt loops over it across awaits (replaying retained messages to a
      connecting client, fanning out every broadcast), and a client subscribing meanwhile raised
      "dictionary changed size during iteration", which ended the connecting client's session
      (seen in `apiary demo`) or the broadcast for the subscribers not yet served.
    """
    from amqtt.adapters import StreamReaderAdapter, StreamWriterAdapter
    from amqtt.broker import Broker
    from amqtt.plugins.base import BaseAuthPlugin

    class OpenAuthPlugin(BaseAuthPlugin):
        async def authenticate(self, *, session: Any) -> bool:
            return True

    class PrefixedReader(StreamReaderAdapter):
        """Replays the bytes already read to inspect the CONNECT, then reads the socket."""

        def __init__(self, reader: asyncio.StreamReader, prefix: bytes) -> None:
            super().__init__(reader)
            self._prefix = prefix

        async def read(self, n: int = -1) -> bytes:
            if not self._prefix:
                return await super().read(n)
            if n == -1:
                data, self._prefix = self._prefix + await super().read(-1), b""
                return data
            head, self._prefix = self._prefix[:n], self._prefix[n:]
            return head + (await super().read(n - len(head)) if len(head) < n else b"")

    class LimitedReader(PrefixedReader):
        """Follows the MQTT framing of what amqtt reads and ends the stream at a packet over the limit."""

        def __init__(self, reader: asyncio.StreamReader, prefix: bytes, writer: asyncio.StreamWriter) -> None:
            super().__init__(reader, prefix)
            self._writer = writer
            self._head = bytearray()  # the fixed header being read: type byte and remaining-length bytes
            self._skip = 0  # bytes of the current packet's body still to come

        async def read(self, n: int = -1) -> bytes:
            data = await super().read(n)
            if self._too_large(data):
                self._writer.close()
                return b""  # amqtt sees the end of the stream and drops the connection
            return data

        def _too_large(self, data: bytes) -> bool:
            i = 0
            while i < len(data):
                if self._skip:
                    step = min(self._skip, len(data) - i)
                    self._skip -= step
                    i += step
                    continue
                self._head.append(data[i])
                i += 1
                if len(self._head) >= 2 and not self._head[-1] & 0x80:
                    length = sum((b & 0x7F) << (7 * k) for k, b in enumerate(self._head[1:]))
                    self._head.clear()
                    if length > MAX_PACKET_SIZE:
                        log.warning("embedded broker: a client sent a %d-byte packet (max_packet_size %d): "
                                    "disconnected", length, MAX_PACKET_SIZE)
                        return True
                    self._skip = length
                elif len(self._head) > 5:  # a remaining length longer than 4 bytes is malformed
                    return True
            return False

    class Mqtt311Broker(Broker):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._subscriptions = SnapshotDict(self._subscriptions)

        async def stream_connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                   listener_name: str) -> None:
            async def connect_head() -> bytes:  # fixed header, remaining length, protocol name and level
                head = await reader.readexactly(2)
                while head[-1] & 0x80 and len(head) < 5:
                    head += await reader.readexactly(1)
                head += await reader.readexactly(2)
                return head + await reader.readexactly(int.from_bytes(head[-2:], "big") + 1)

            try:
                prefix = await asyncio.wait_for(connect_head(), 10)
            except (asyncio.IncompleteReadError, asyncio.TimeoutError, OSError):
                writer.close()
                return
            if prefix[0] >> 4 == 1 and prefix[-1] == 5:  # CONNECT, MQTT 5
                writer.write(bytes([0x20, 0x02, 0x00, 0x01]))  # CONNACK: unacceptable protocol version
                with contextlib.suppress(OSError):
                    await writer.drain()
                writer.close()
                return
            await self.external_connected(LimitedReader(reader, prefix, writer), StreamWriterAdapter(writer),
                                          listener_name)

        async def _retain_broadcast_message(self, broadcast: dict[str, Any], qos: int, target_session: Any) -> None:
            if target_session.retained_messages.qsize() >= MAX_QUEUED_MESSAGES:
                log.warning("embedded broker: %d messages queued for offline client %s: one on %s dropped",
                            MAX_QUEUED_MESSAGES, target_session.client_id, broadcast["topic"])
                return
            await super()._retain_broadcast_message(broadcast, qos, target_session)

    return OpenAuthPlugin, Mqtt311Broker


async def _close_listeners(broker: Any) -> None:
    """Close amqtt's listening sockets (what its own shutdown does last, and skips when it fails earlier)."""
    for server in list(getattr(broker, "_servers", {}).values()):
        await server.close_instance()


def _close_loop(loop: asyncio.AbstractEventLoop, timeout: float = 5.0) -> None:
    """Cancel what amqtt left running, let it unwind while the loop is open, then close the loop (as
    ``asyncio.run`` does). Why: amqtt's shutdown leaves its broadcast loop and each session's handlers
    waiting on queues; closed with the loop, they were destroyed later by the garbage collector, their
    cleanup called the closed loop, and the "Exception ignored" report formatted a traceback whenever the
    collector happened to run. Python 3.11 parses source to draw a traceback's carets, and a parse inside
    another parse (pytest rewriting an import) breaks the interpreter's AST depth count: pytest's internal
    error "AST constructor recursion depth mismatch", which ended a whole test run (a broker-restart test)."""
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.wait(tasks, timeout=timeout))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


def __getattr__(name: str) -> Any:
    # amqtt loads plugins by dotted path ("apiary.shared.brokers.OpenAuthPlugin").
    if name == "OpenAuthPlugin":
        return _amqtt_classes()[0]
    raise AttributeError(name)


class EmbeddedBroker:
    """amqtt in a background thread with its own event loop, bound to loopback by default."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._broker: Any = None

    @property
    def config(self) -> MqttConfig:
        return MqttConfig(host=self.host, port=self.port)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout: float = 10.0) -> MqttConfig:
        import logging

        if self.running:
            return self.config
        # amqtt logs every packet at INFO and benign races at WARNING; transitions logs its state machine.
        logging.getLogger("transitions").setLevel(logging.WARNING)
        amqtt_log = logging.getLogger("amqtt")
        pick_port = self.port == 0
        last: BaseException | None = None
        for _ in range(5 if pick_port else 1):
            if pick_port:
                self.port = free_port(self.host)
            amqtt_log.setLevel(logging.CRITICAL)  # a failed bind is reported once, as BrokerError, not as a traceback
            try:
                self._launch(timeout)
                log.info("embedded broker (amqtt) up on %s:%d", self.host, self.port)
                return self.config
            except BrokerError as e:
                last = e
            finally:
                amqtt_log.setLevel(logging.ERROR)
        if pick_port:
            self.port = 0
        raise BrokerError(f"embedded broker did not start: {last}")

    def _launch(self, timeout: float) -> None:
        broker_cls = _amqtt_classes()[1]
        loop = asyncio.new_event_loop()
        ready: dict[str, Any] = {}
        started = threading.Event()
        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
            "plugins": {f"{__name__}.OpenAuthPlugin": {}},
        }

        async def boot() -> None:
            try:
                self._broker = broker_cls(config, loop=loop)
                await self._broker.start()
            except BaseException as e:  # surfaced to start()
                ready["error"] = e
            finally:
                started.set()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(boot())
            if "error" not in ready:
                loop.run_forever()
            _close_loop(loop)

        thread = threading.Thread(target=run, name=f"amqtt-{self.port}", daemon=True)
        thread.start()
        if not started.wait(timeout):
            raise BrokerError(f"amqtt did not start within {timeout}s")
        if "error" in ready:
            thread.join(5)
            raise BrokerError(f"amqtt failed on {self.host}:{self.port}: {ready['error']}")
        self._loop, self._thread = loop, thread

    def stop(self, timeout: float = 10.0) -> None:
        if not self.running or self._loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._broker.shutdown(), self._loop).result(timeout)
        except Exception as e:  # a failed shutdown must not leave the thread, or the port, behind
            # (seen: a shutdown cancelled from inside amqtt with a client mid-handshake left the listener open,
            # and the restart on the same port failed with "address already in use")
            log.warning("amqtt shutdown failed (%r); closing its listeners", e)
            try:
                asyncio.run_coroutine_threadsafe(_close_listeners(self._broker), self._loop).result(timeout)
            except Exception as e:
                log.warning("amqtt listeners: %r", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._loop = self._thread = self._broker = None

    def close(self) -> None:
        """Same as :meth:`stop` (nothing on disk to clean up)."""
        self.stop()

    def __enter__(self) -> "EmbeddedBroker":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
