"""API keys: random bearer tokens, stored only as hashes, each with scopes.

Scopes: ``inference`` (the OpenAI-compatible endpoints) and ``operator`` (fleet, events,
escalations, OTA). Keys live in a JSON-lines file (one record per key: id, sha256 of the
key, scopes, name, created), so every REST replica reading the same file accepts the same
keys and ``apiary cloud keys create`` works while servers run (the file is re-read when
it changes). The plaintext key is shown once, at creation.

A key is ``apk_<id>_<secret>`` with 256 bits of secret; a plain sha256 is the right
hash for such high-entropy tokens (slow password hashes exist for guessable secrets).
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

from apiary.cloud.errors import CloudError
from apiary.shared.logs import get_logger

Scope = Literal["inference", "operator"]
SCOPES: tuple[Scope, ...] = ("inference", "operator")
PREFIX = "apk_"
_log = get_logger("apiary.cloud.auth")


@dataclass(frozen=True, slots=True)
class ApiKey:
    key_id: str
    key_hash: str
    scopes: frozenset[str]
    name: str = ""
    created: float = 0.0


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def check_scopes(scopes: Iterable[str]) -> frozenset[str]:
    scopes = frozenset(scopes)
    unknown = scopes - set(SCOPES)
    if not scopes or unknown:
        raise CloudError(f"scopes must be a non-empty subset of {list(SCOPES)}, got {sorted(scopes)}")
    return scopes


class KeyRing:
    """The accepted keys: from a key file (re-read on change) plus keys added in memory for this process."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self._file_keys: dict[str, ApiKey] = {}
        self._memory_keys: dict[str, ApiKey] = {}
        self._mtime: float | None = None
        self._reload()

    def create(self, scopes: Iterable[str], *, name: str = "", persist: bool = True) -> str:
        """Make a new key with ``scopes`` and return its plaintext (the only time it exists)."""
        scopes = check_scopes(scopes)
        key_id = secrets.token_hex(4)
        key = f"{PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
        record = ApiKey(key_id, hash_key(key), scopes, name, time.time())
        if persist and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            line = json.dumps({"id": record.key_id, "sha256": record.key_hash, "scopes": sorted(scopes),
                               "name": name, "created": record.created})
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "a") as f:
                f.write(line + "\n")
            self._reload(force=True)
        else:
            with self._lock:
                self._memory_keys[record.key_hash] = record
        return key

    def verify(self, key: str | None) -> ApiKey | None:
        """The key's record, or None if it is unknown."""
        if not key or not key.startswith(PREFIX) or len(key) > 256:
            return None
        try:
            self._reload()
        except CloudError as e:  # a file broken while serving: keep the last good keys, say why
            _log.error("key file unreadable, keeping previously loaded keys: %s", e)
        digest = hash_key(key)
        with self._lock:
            return self._file_keys.get(digest) or self._memory_keys.get(digest)

    def __len__(self) -> int:
        self._reload()
        with self._lock:
            return len(self._file_keys) + len(self._memory_keys)

    def _reload(self, force: bool = False) -> None:
        if self.path is None:
            return
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            with self._lock:
                self._file_keys, self._mtime = {}, None
            return
        if not force and mtime == self._mtime:
            return
        keys: dict[str, ApiKey] = {}
        for n, line in enumerate(self.path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                record = ApiKey(str(doc["id"]), str(doc["sha256"]), check_scopes(doc["scopes"]),
                                str(doc.get("name", "")), float(doc.get("created", 0.0)))
            except (ValueError, KeyError, TypeError) as e:
                raise CloudError(f"{self.path}:{n}: not a valid key record ({e})") from None
            keys[record.key_hash] = record
        with self._lock:
            self._file_keys, self._mtime = keys, mtime
