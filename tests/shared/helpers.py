"""Test helpers for anything that talks MQTT: wait for a condition, record what a handler receives."""
from __future__ import annotations

import threading
import time
from typing import Callable

from shared.protocol import Envelope


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
