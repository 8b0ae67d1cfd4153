"""Cloud-service fixtures: one real engine for the session, services around it on free ports."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import pytest

if TYPE_CHECKING:  # imported in the fixtures: the engine and kernel tests under tests/cloud/ need none of the
    # service stack (web, database, crypto), and the GPU machine's image has none of it (bench/gpu.py)
    from apiary.cloud.auth import KeyRing
    from apiary.cloud.service import CloudService

# One small real engine for every cloud test: loading SmolLM2 costs seconds, serving it costs less.
# max_num_seqs=4 / max_waiting=6 keep the queue small enough to fill deterministically (429 test).
ENGINE_LIMITS = dict(max_num_seqs=4, max_waiting=6, max_model_len=2048, max_num_batched_tokens=1024,
                     kv_cache_bytes=96 << 20)
MODEL_NAME = "smollm2-test"


@pytest.fixture(scope="session")
def cloud_engine(gguf_path: Path):
    from apiary.cloud.engine import AsyncEngine, EngineConfig, LLMEngine

    engine = AsyncEngine(LLMEngine(EngineConfig(model_path=gguf_path, dtype="float32", **ENGINE_LIMITS)))
    yield engine
    engine.shutdown()


@pytest.fixture
def keys(tmp_path: Path) -> KeyRing:
    from apiary.cloud.auth import KeyRing

    return KeyRing(tmp_path / "keys.jsonl")


@pytest.fixture
def make_service(tmp_path: Path, cloud_engine, keys: KeyRing, gguf_path: Path) -> Iterator[Callable[..., CloudService]]:
    """Start CloudServices on the shared engine (each on a free port); all are stopped afterwards."""
    from apiary.cloud.service import CloudService
    from apiary.cloud.settings import CloudSettings

    services: list[CloudService] = []

    def make(**overrides) -> CloudService:
        fields = dict(port=0, db=str(tmp_path / "cloud.db"), api_key_file=str(keys.path), generate_key="never",
                      images=str(tmp_path / "images"), model=str(gguf_path), served_model_name=MODEL_NAME,
                      worker_concurrency=2)
        fields.update(overrides)
        service = CloudService(CloudSettings(**fields), engine=cloud_engine)
        services.append(service)
        service.start()
        return service

    yield make
    for service in reversed(services):
        service.stop()


@pytest.fixture
def idle_engine(cloud_engine):
    """The shared engine, checked idle before and after the test (no leaked requests or KV blocks)."""
    yield cloud_engine
    m = cloud_engine.metrics()
    assert m["requests_running"] == 0 and m["requests_waiting"] == 0, m


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL cluster for the session (bench/pgserver.py); skipped only without its binaries."""
    from apiary.bench.pgserver import PostgresServer, find_bin_dir

    bin_dir = find_bin_dir()
    if bin_dir is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not found on PATH or under "
                    "/usr/lib/postgresql/*/bin: run .ci/install (it installs Debian's postgresql)")
    server = PostgresServer(bin_dir)
    server.start()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path: Path) -> str:
    """The same test on both backends: a fresh SQLite file, or a fresh PostgreSQL database migrated to head."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'db' / 'cloud.db'}"
    from apiary.cloud.db import migrate

    url = request.getfixturevalue("postgres").create_database()
    migrate.upgrade(url)
    return url


@pytest.fixture
def any_store(store_url: str):
    """A store on each backend (see ``store_url``), closed afterwards."""
    from apiary.cloud.store import open_store

    store = open_store(store_url)
    yield store
    store.close()
