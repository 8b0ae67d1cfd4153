"""A TCP proxy between MQTT clients and a broker that breaks the link at a chosen packet.

Reconnect bugs hide in the few milliseconds between CONNACK and SUBACK; a real network drops
there only by luck. The proxy parses MQTT packet boundaries (fixed header and remaining length,
the same in 3.1.1 and 5) and applies armed faults to the first packet of the named type, so a
test can lose exactly the SUBSCRIBE, the SUBACK or the link right after CONNACK, every time.
"""
from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field
from typing import Literal

from apiary.shared.brokers import free_port
from apiary.shared.config import MqttConfig

PACKET_TYPES = {1: "CONNECT", 2: "CONNACK", 3: "PUBLISH", 4: "PUBACK", 5: "PUBREC", 6: "PUBREL", 7: "PUBCOMP",
                8: "SUBSCRIBE", 9: "SUBACK", 10: "UNSUBSCRIBE", 11: "UNSUBACK", 12: "PINGREQ", 13: "PINGRESP",
                14: "DISCONNECT", 15: "AUTH"}
Action = Literal["cut_before", "cut_after", "swallow", "refuse"]


@dataclass(slots=True)
class Fault:
    """What to do to the next ``packet`` (a name of :data:`PACKET_TYPES`) on any connection.

    ``cut_before``: close the link instead of passing it on; ``cut_after``: pass it on, then close
    the link (nothing else gets through, either way); ``swallow``: drop it and keep the link
    (the peer waits forever, as after a broker crash mid-packet); ``refuse``: a SUBACK with every
    return code turned into 0x80 (failure).
    """

    packet: str
    action: Action


@dataclass(slots=True)
class _Link:
    client: socket.socket
    broker: socket.socket
    lock: threading.Lock = field(default_factory=threading.Lock)  # one packet at a time, both ways
    mqtt5: bool = False
    dead: bool = False
    granted: int = 0  # SUBACKs passed to the client that granted every filter


class FaultyLink:
    """Listens on a free loopback port and relays every connection to ``upstream``.

    ``config`` is the proxied MqttConfig. ``arm`` queues faults (each used once, in order);
    ``drop`` closes every open link; ``session_present`` lists each CONNACK's flag as passed
    on; ``granted_on_latest`` counts granting SUBACKs on the newest connection.
    """

    def __init__(self, upstream: MqttConfig) -> None:
        self.upstream = upstream
        self.port = free_port()
        self.session_present: list[bool] = []
        self._faults: list[Fault] = []
        self._links: list[_Link] = []
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._closed = False
        threading.Thread(target=self._accept, name=f"faulty-link-{self.port}", daemon=True).start()

    @property
    def config(self) -> MqttConfig:
        return self.upstream.model_copy(update={"host": "127.0.0.1", "port": self.port})

    def arm(self, *faults: Fault) -> None:
        with self._lock:
            self._faults.extend(faults)

    @property
    def armed(self) -> int:
        """Faults not used yet."""
        with self._lock:
            return len(self._faults)

    def drop(self) -> None:
        with self._lock:
            links = list(self._links)
        for link in links:
            self._kill(link)

    def granted_on_latest(self) -> int:
        with self._lock:
            live = [link for link in self._links if not link.dead]
        return live[-1].granted if live else 0

    def close(self) -> None:
        self._closed = True
        self._server.close()
        self.drop()

    # ------------------------------------------------------------------ relaying

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                broker = socket.create_connection((self.upstream.host, self.upstream.port), timeout=5)
            except OSError:
                client.close()  # broker down: the client sees a refused/closed link and retries
                continue
            if broker.getsockname() == broker.getpeername():  # TCP self-connect to the down broker's port
                broker.close()  # (it would hold the port the broker is about to bind again)
                client.close()
                continue
            broker.settimeout(None)
            link = _Link(client, broker)
            with self._lock:
                self._links.append(link)
            for src, dst in ((client, broker), (broker, client)):
                threading.Thread(target=self._pump, args=(link, src, dst), daemon=True).start()

    def _pump(self, link: _Link, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                packet = _read_packet(src)
                if packet is None:
                    break
                if not self._relay(link, packet, dst):
                    break
        except OSError:
            pass
        self._kill(link)

    def _relay(self, link: _Link, packet: bytes, dst: socket.socket) -> bool:
        """Pass ``packet`` on (or not, as a fault says); False once the link is gone."""
        name = PACKET_TYPES.get(packet[0] >> 4, "?")
        with link.lock:
            if link.dead:
                return False
            with self._lock:
                fault = self._faults.pop(0) if self._faults and self._faults[0].packet == name else None
            if name == "CONNECT":
                link.mqtt5 = _connect_level(packet) == 5
            action = fault.action if fault else None
            if action == "cut_before":
                link.dead = True
            elif action == "swallow":
                return True
            else:
                if action == "refuse":
                    packet = _refused_suback(packet, link.mqtt5)
                if name == "CONNACK":  # noted before the client can act on it
                    with self._lock:
                        self.session_present.append(bool(packet[_body_start(packet)] & 1))
                if name == "SUBACK" and all(code < 0x80 for code in _suback_codes(packet, link.mqtt5)):
                    link.granted += 1
                dst.sendall(packet)
                if action == "cut_after":
                    link.dead = True
        if link.dead:
            self._kill(link)
            return False
        return True

    def _kill(self, link: _Link) -> None:
        link.dead = True
        for sock in (link.client, link.broker):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


# ---------------------------------------------------------------------- packet parsing


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _read_packet(sock: socket.socket) -> bytes | None:
    """One whole MQTT packet (fixed header included), or None at end of stream."""
    head = _recv_exactly(sock, 1)
    if head is None:
        return None
    length_bytes, length, shift = b"", 0, 0
    while True:
        b = _recv_exactly(sock, 1)
        if b is None:
            return None
        length_bytes += b
        length += (b[0] & 0x7F) << shift
        shift += 7
        if not b[0] & 0x80:
            break
    body = _recv_exactly(sock, length) if length else b""
    return None if body is None else head + length_bytes + body


def _body_start(packet: bytes) -> int:
    i = 1
    while packet[i] & 0x80:
        i += 1
    return i + 1


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        value += (data[i] & 0x7F) << shift
        shift += 7
        i += 1
        if not data[i - 1] & 0x80:
            return value, i


def _connect_level(packet: bytes) -> int:
    i = _body_start(packet)
    name_len = int.from_bytes(packet[i:i + 2], "big")
    return packet[i + 2 + name_len]


def _codes_start(packet: bytes, mqtt5: bool) -> int:
    i = _body_start(packet) + 2  # packet id
    if mqtt5:
        props, i = _varint(packet, i)
        i += props
    return i


def _suback_codes(packet: bytes, mqtt5: bool) -> bytes:
    return packet[_codes_start(packet, mqtt5):]


def _refused_suback(packet: bytes, mqtt5: bool) -> bytes:
    start = _codes_start(packet, mqtt5)
    return packet[:start] + bytes([0x80]) * (len(packet) - start)
