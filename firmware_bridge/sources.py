"""Where the bytes come from: a serial port, UDP datagrams, or a capture file.

Each source is a blocking loop meant for its own thread (the bridge's reader). It
stamps arrival time, hands bytes to the bridge and returns when ``stop`` is set (or
the file ends). None of them ever waits on the broker.
"""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from apiary.shared.logs import get_logger

from apiary.firmware_bridge.bridge import Bridge
from apiary.firmware_bridge.errors import BridgeError

if TYPE_CHECKING:
    import serial

log = get_logger(__name__)

UDP_RCVBUF = 8 * 1024 * 1024  # the kernel caps it at net.core.rmem_max; bursts must not overflow it
MAX_DATAGRAM = 65535


def open_serial(port: str, baudrate: int = 115200) -> serial.Serial:
    """Open a serial device (or a pty slave) raw, 8N1, with a short read timeout."""
    import serial

    try:
        return serial.Serial(port, baudrate=baudrate, timeout=0.02)
    except (serial.SerialException, ValueError, OSError) as e:
        raise BridgeError(f"cannot open serial port {port}: {e}") from None


def run_serial(bridge: Bridge, ser: serial.Serial, stop: threading.Event) -> None:
    """Read an open serial port until ``stop``; closes it. A line quiet for ``idle_timeout_s``
    ends any partial frame, so a truncated frame never delays the next one for long."""
    import serial

    idle = bridge.settings.idle_timeout_s
    last = time.monotonic()
    try:
        while not stop.is_set():
            try:
                data = ser.read(max(1, ser.in_waiting))
            except (serial.SerialException, OSError) as e:
                raise BridgeError(f"serial port {ser.port} failed: {e}") from None
            now = time.monotonic()
            if data:
                bridge.feed(data, received=now)
                last = now
            elif bridge.reader.pending and now - last >= idle:
                bridge.end_of_stream(received=now)
    finally:
        ser.close()


def open_udp(host: str = "0.0.0.0", port: int = 0) -> socket.socket:
    """A bound UDP socket with a large receive buffer; ``sock.getsockname()[1]`` is the port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UDP_RCVBUF)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise BridgeError(f"cannot bind UDP {host}:{port}: {e}") from None
    sock.settimeout(0.1)
    return sock


def run_udp(bridge: Bridge, sock: socket.socket, stop: threading.Event) -> None:
    """Receive datagrams (each one or more whole frames) until ``stop``; closes ``sock``."""
    buf = bytearray(MAX_DATAGRAM)
    view = memoryview(buf)
    try:
        while not stop.is_set():
            try:
                n = sock.recv_into(buf)
            except TimeoutError:
                continue
            except OSError as e:
                if stop.is_set():
                    break
                raise BridgeError(f"UDP receive failed: {e}") from None
            bridge.feed_datagram(view[:n], received=time.monotonic())
    finally:
        sock.close()


def run_replay(bridge: Bridge, path: str | Path, *, bytes_per_s: float = 0.0, chunk: int = 4096,
               stop: threading.Event | None = None) -> int:
    """Feed a capture file (a raw byte stream, as recorded from a serial line) to the bridge,
    as fast as possible or paced at ``bytes_per_s``. Returns bytes read."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise BridgeError(f"cannot read capture file {path}: {e}") from None
    total = 0
    t0 = time.monotonic()
    with f:
        while stop is None or not stop.is_set():
            data = f.read(chunk)
            if not data:
                break
            bridge.feed(data)
            total += len(data)
            if bytes_per_s > 0:
                ahead = total / bytes_per_s - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
    bridge.end_of_stream()
    return total
