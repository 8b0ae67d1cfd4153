"""This machine's name as a part of MQTT client ids and node names.

A broker lets one connection hold a client id: a second process connecting with the same id
takes the session over, the first reconnects and takes it back, without end. Default ids of
processes that may run side by side (two bridges on one host, cloud workers on several) carry
the host's name, so their defaults never collide.
"""
from __future__ import annotations

import re
import socket


def host_name(limit: int = 40) -> str:
    """The hostname with every character outside ``[A-Za-z0-9_.-]`` made ``-``, at most ``limit`` long."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:limit] or "host"
