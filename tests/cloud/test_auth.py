"""API keys: hashed at rest, scoped, shared through the key file."""
from __future__ import annotations

import pytest

from apiary.cloud.auth import KeyRing, hash_key
from apiary.cloud.errors import CloudError


def test_create_verify_scopes(tmp_path):
    ring = KeyRing(tmp_path / "keys.jsonl")
    key = ring.create(["inference"], name="bench")
    assert key.startswith("apk_") and len(key) > 40
    record = ring.verify(key)
    assert record is not None and record.scopes == frozenset({"inference"}) and record.name == "bench"
    text = (tmp_path / "keys.jsonl").read_text()
    assert key not in text and hash_key(key) in text  # only the hash is stored
    assert (tmp_path / "keys.jsonl").stat().st_mode & 0o077 == 0
    assert ring.verify(key + "x") is None and ring.verify("") is None and ring.verify(None) is None
    assert ring.verify("Bearer " + key) is None


def test_another_replica_sees_new_keys(tmp_path):
    path = tmp_path / "keys.jsonl"
    server = KeyRing(path)
    assert len(server) == 0
    key = KeyRing(path).create(["operator", "inference"])  # e.g. `apiary cloud keys create` while serving
    assert server.verify(key).scopes == frozenset({"operator", "inference"})


def test_memory_keys_and_bad_input(tmp_path):
    ring = KeyRing(None)
    key = ring.create(["operator"], persist=False)
    assert ring.verify(key) is not None and len(ring) == 1
    with pytest.raises(CloudError, match="scopes"):
        ring.create(["admin"])
    with pytest.raises(CloudError, match="scopes"):
        ring.create([])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    with pytest.raises(CloudError, match="bad.jsonl:1"):
        KeyRing(bad)


def test_file_broken_while_serving_keeps_last_good_keys(tmp_path):
    path = tmp_path / "keys.jsonl"
    ring = KeyRing(path)
    key = ring.create(["inference"])
    with open(path, "a") as f:
        f.write("{broken\n")
    assert ring.verify(key) is not None
