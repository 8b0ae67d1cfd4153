"""A disk cache of what the loader makes of a GGUF file: float32 tensors, the config and the metadata.

Why: reading SmolLM2-135M's Q4_1 GGUF took ~3.5 s in every process that builds an engine (``apiary cloud
serve``, the demo, each test's engine): ``gguf``'s reader makes a numpy view for each of the tokenizer's ~100k
strings (2.0 s) and dequantizes the blocks in numpy (1.6 s). Read back from here it takes well under 0.1 s.

An entry is a folder named by a digest of the file's resolved path, size, mtime and inode and of the loader's
own source (a changed file or a changed loader is a new entry, never a stale one): ``weights.safetensors``
(the tensors and the config's tensor extras) and ``checkpoint.json`` (the config, the metadata, the source's
stat). Where: ``$APIARY_CHECKPOINT_CACHE``, default ``~/.cache/apiary/checkpoints``; ``off`` turns it off.
Files under ``MIN_BYTES`` load fast as they are and are not cached; at most ``MAX_ENTRIES`` are kept, the
least recently used removed first.

The cache never fails a load: an entry it cannot read is removed and the GGUF read again; an entry it cannot
write (a full disk, a read-only home) is skipped with a warning. Entries are written to a temporary folder
and renamed into place, so a process killed mid-write leaves no half entry under an entry's name. Writing
one removes the entries whose source file is gone or changed.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from apiary.cloud.engine.config import ModelConfig

if TYPE_CHECKING:
    from apiary.cloud.engine.loader import Checkpoint

log = logging.getLogger(__name__)

ENV = "APIARY_CHECKPOINT_CACHE"
MIN_BYTES = 16 << 20
MAX_ENTRIES = 4  # the least recently used go first (SmolLM2-135M takes ~540 MB as float32)
FORMAT = 1  # the layout of an entry
_WEIGHTS, _META = "weights.safetensors", "checkpoint.json"
_EXTRA = "__config_extra__."  # the tensor prefix of the config's tensor extras (Llama 3's rope_freq_factors)


def cache_root() -> Path | None:
    """The cache's folder, or None where ``$APIARY_CHECKPOINT_CACHE`` is ``off``."""
    value = os.environ.get(ENV, "")
    if value.strip().lower() == "off":
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "apiary" / "checkpoints"


def _stat_of(path: Path) -> dict[str, int | str]:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


@functools.cache
def _loader_digest() -> str:
    """The loader's and this module's source: what the cached tensors were made by."""
    digest = hashlib.sha256(str(FORMAT).encode())
    for module in ("loader.py", "checkpoint_cache.py"):
        digest.update((Path(__file__).parent / module).read_bytes())
    return digest.hexdigest()


def _entry(root: Path, stat: dict[str, int | str]) -> Path:
    key = json.dumps({"source": stat, "loader": _loader_digest()}, sort_keys=True)
    return root / hashlib.sha256(key.encode()).hexdigest()[:32]


def lookup(path: Path) -> Checkpoint | None:
    """The cached checkpoint of the GGUF file at ``path``, or None (not cached, too small, cache off)."""
    root = cache_root()
    if root is None or path.stat().st_size < MIN_BYTES:
        return None
    entry = _entry(root, _stat_of(path))
    if not entry.is_dir():
        return None
    try:
        checkpoint = _read(entry, path)
    except Exception as e:  # a damaged entry: remove it, read the GGUF again
        log.warning("checkpoint cache: entry %s unreadable (%s); reading %s again", entry, e, path)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    log.info("checkpoint %s read from the cache (%s)", path, entry)
    try:
        os.utime(entry)  # recently used: kept longest
    except OSError:
        pass
    return checkpoint


def _read(entry: Path, path: Path) -> Checkpoint:
    from safetensors.torch import load_file

    from apiary.cloud.engine.loader import Checkpoint

    meta = json.loads((entry / _META).read_text())
    tensors = load_file(entry / _WEIGHTS)
    extra = {k.removeprefix(_EXTRA): tensors.pop(k) for k in [k for k in tensors if k.startswith(_EXTRA)]}
    config = ModelConfig(**meta["config"], extra={**meta["extra"], **extra})
    return Checkpoint(config=config, weights=tensors, source=path, metadata=meta["metadata"])


def store(path: Path, checkpoint: Checkpoint) -> None:
    """Keep ``checkpoint`` (just loaded from the GGUF file at ``path``) for the next process; never raises."""
    root = cache_root()
    if root is None or path.stat().st_size < MIN_BYTES:
        return
    config = dataclasses.asdict(checkpoint.config)
    extra = config.pop("extra")
    tensor_extras = {f"{_EXTRA}{k}": v for k, v in extra.items() if isinstance(v, torch.Tensor)}
    plain_extras = {k: v for k, v in extra.items() if not isinstance(v, torch.Tensor)}
    stat = _stat_of(path)
    tmp: Path | None = None
    try:
        text = json.dumps({"config": config, "extra": plain_extras, "metadata": checkpoint.metadata, "source": stat,
                           "loader": _loader_digest()})
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale(root)
        _make_room(root)
        tmp = Path(tempfile.mkdtemp(prefix=".writing-", dir=root))
        from safetensors.torch import save_file

        save_file({**checkpoint.weights, **{k: v.contiguous() for k, v in tensor_extras.items()}}, tmp / _WEIGHTS)
        (tmp / _META).write_text(text)
        os.rename(tmp, _entry(root, stat))
        tmp = None
    except Exception as e:  # a full disk, a read-only home, metadata JSON cannot hold, tensors safetensors refuses
        if not (isinstance(e, OSError) and _entry(root, stat).is_dir()):  # not merely another process first
            log.warning("checkpoint cache: could not keep %s in %s (%s); the next start reads the GGUF again",
                        path, root, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale(root: Path) -> None:
    """Remove entries whose source file is gone or changed or that an older loader made, and writes left by a
    killed process."""
    loader = _loader_digest()
    for entry in root.iterdir():
        if entry.name.startswith(".writing-"):
            if _older_than_an_hour(entry):
                shutil.rmtree(entry, ignore_errors=True)
            continue
        try:
            meta = json.loads((entry / _META).read_text())
            source, current = meta["source"], _stat_of(Path(meta["source"]["path"]))
        except (OSError, ValueError, KeyError, TypeError):
            meta = source = current = None
        if current is None or current != source or meta["loader"] != loader:
            shutil.rmtree(entry, ignore_errors=True)


def _make_room(root: Path) -> None:
    """Remove the least recently used entries until one more fits under ``MAX_ENTRIES``."""
    entries = []
    for entry in root.iterdir():
        if not entry.name.startswith("."):
            try:
                entries.append((entry.stat().st_mtime, entry))
            except OSError:
                continue
    for _, entry in sorted(entries)[:max(0, len(entries) - MAX_ENTRIES + 1)]:
        shutil.rmtree(entry, ignore_errors=True)


def _older_than_an_hour(entry: Path) -> bool:
    import time

    try:
        return time.time() - entry.stat().st_mtime > 3600
    except OSError:
        return False
