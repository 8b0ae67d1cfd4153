"""Runs the mesh's processes for the demo and benchmarks, and makes sure none outlives it.

Each component runs as its own process (as it would on its own machine), in its own
process group with its output in a log file, so stopping the demo can terminate the
whole group and escalate to SIGKILL for anything that does not exit in time.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable


@dataclass(slots=True)
class Managed:
    name: str
    proc: subprocess.Popen
    log_path: Path
    log_file: IO[bytes]


@dataclass
class Supervisor:
    log_dir: Path
    procs: list[Managed] = field(default_factory=list)

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Managed:
        """Start ``apiary <args>`` (this interpreter's own CLI) as a managed process."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        log_file = open(log_path, "ab")
        cmd = [sys.executable, "-m", "apiary", *args]
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        m = Managed(name, proc, log_path, log_file)
        self.procs.append(m)
        return m

    def failed(self) -> list[Managed]:
        """Processes that exited on their own (a crash, from the demo's point of view)."""
        return [m for m in self.procs if m.proc.poll() is not None]

    def stop(self, name: str, timeout: float = 10.0) -> None:
        for m in [m for m in self.procs if m.name == name]:
            self._terminate([m], timeout)
            self.procs.remove(m)

    def stop_all(self, timeout: float = 15.0, order: Callable[[Managed], bool] | None = None) -> None:
        """Stop every process, newest first; with ``order``, those it picks first (all of them, in parallel, each
        given ``timeout``), then the rest."""
        procs = list(reversed(self.procs))
        first = [m for m in procs if order(m)] if order else []
        for group in (first, [m for m in procs if m not in first]):
            if group:
                self._terminate(group, timeout)
        self.procs.clear()

    def pids(self) -> list[int]:
        return [m.proc.pid for m in self.procs]

    @staticmethod
    def _terminate(procs: list[Managed], timeout: float) -> None:
        for m in procs:
            if m.proc.poll() is None:
                _signal_group(m.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for m in procs:
            try:
                m.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(m.proc.pid, signal.SIGKILL)  # the group: children a component may have started
            try:
                m.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            m.log_file.close()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
