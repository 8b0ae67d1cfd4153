"""Where numba keeps the CPU kernels' compiled code: beside their sources, or a private writable folder.

Why: every CPU kernel is compiled with ``cache=True``, and numba chooses the cache's place when a kernel is
defined, at its module's import: the ``__pycache__`` beside the source, else a per-user folder under ``$HOME``.
With the package's folder read-only (an install owned by another user, a read-only root file system) and no
writable home, numba raised at import ("cannot cache function '_exp': no locator available"), so
``apiary cloud serve`` could not start (found by a drill: docs/benchmarks.md). ``ensure`` runs before any kernel
module loads (``apiary.kernels``' ``__init__``): where the sources' folder takes no files and the operator set no
``NUMBA_CACHE_DIR``, it points numba at ``~/.cache/apiary/numba`` or, failing that, a folder of this user's own
under the temporary directory; where none can be written it raises a ``KernelError`` saying what to set.

A folder under the shared temporary directory is used only if this user owns it and no one else may write to it:
numba's cache index is a pickle, and loading one that another user planted would run their code.

``guard_disk_errors`` (installed by ``cpu_attention``, which every numba kernel module imports first) makes the
disk cache a cache: with the folder's disk full, numba compiled a kernel and then raised ``ENOSPC`` out of its first
call, and a truncated or unreadable entry raised out of its load (drills: docs/kernels.md). Now an entry it cannot
write stays in memory (compiled again by the next process) and one it cannot read is compiled afresh and
rewritten, each with a warning.
"""
from __future__ import annotations

import contextlib
import logging
import os
import stat
import sys
import tempfile
from collections.abc import MutableMapping
from pathlib import Path

from apiary.kernels.errors import KernelError

log = logging.getLogger(__name__)

SOURCES = Path(__file__).resolve().parent


def _takes_files(folder: Path) -> bool:
    """Whether a file can be created in ``folder`` (made if missing), as numba's own check does."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def _private(folder: Path) -> bool:
    """Whether ``folder`` (made with mode 0700 if missing) is a directory this user owns that no one else may write."""
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = folder.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def ensure(sources: Path = SOURCES, env: MutableMapping[str, str] | None = None,
           home: Path | None = None, temp: Path | None = None) -> Path | None:
    """Give numba a writable cache folder where it would find none. Returns the folder chosen, or None where numba's
    default (``__pycache__`` beside ``sources``) works or the operator chose ``NUMBA_CACHE_DIR``."""
    env = os.environ if env is None else env
    if env.get("NUMBA_CACHE_DIR") or _takes_files(sources / "__pycache__"):
        return None
    try:
        home = Path.home() if home is None else home
    except (KeyError, RuntimeError):  # no home directory known for this user
        home = None
    temp = Path(tempfile.gettempdir()) if temp is None else temp
    candidates = [] if home is None else [home / ".cache" / "apiary" / "numba"]
    candidates.append(temp / f"apiary-numba-{os.getuid()}")
    for folder in candidates:
        shared = folder.parent == temp
        if (not shared or _private(folder)) and _takes_files(folder):
            env["NUMBA_CACHE_DIR"] = str(folder)
            numba = sys.modules.get("numba")
            if numba is not None:  # numba read its configuration at import: tell it too
                numba.config.CACHE_DIR = str(folder)
            log.info("%s takes no files: numba's compiled kernels go to %s", sources / "__pycache__", folder)
            return folder
    raise KernelError(f"numba cannot cache the CPU kernels: {sources / '__pycache__'} takes no files and neither does "
                      f"any of {', '.join(map(str, candidates))}; set NUMBA_CACHE_DIR to a writable folder")


_WARNED: set[tuple[str, str, str]] = set()


def _warn(action: str, where: str, error: Exception) -> None:
    """One warning per kind of failure and cache folder, not one per kernel (an error's text names its file)."""
    key = (action, where, type(error).__name__)
    if key in _WARNED:
        return
    _WARNED.add(key)
    log.warning("numba could not %s its compiled kernels in %s (%s: %s): %s", action, where, type(error).__name__,
                error, "they stay in memory and compile again in the next process" if action == "write"
                else "the kernel is compiled afresh and its entry rewritten")


def guard_disk_errors() -> None:
    """Make failures of numba's disk cache cost a compilation instead of the kernel's call (idempotent)."""
    from numba.core import caching

    if getattr(caching.Cache, "_apiary_guarded", False):
        return
    load, save = caching.Cache.load_overload, caching.Cache.save_overload

    def load_overload(self, sig, target_context):  # type: ignore[no-untyped-def]
        try:
            return load(self, sig, target_context)
        except Exception as e:  # noqa: BLE001 - a truncated, foreign or unreadable entry: pickle, EOF, OS errors
            index = getattr(getattr(self, "_cache_file", None), "_index_path", None)
            if index is not None:  # a corrupt index would fail the save too: the save writes a new one
                with contextlib.suppress(OSError):
                    os.remove(index)
            _warn("read", str(getattr(self, "_cache_path", "?")), e)
            return None

    def save_overload(self, sig, data):  # type: ignore[no-untyped-def]
        try:
            save(self, sig, data)
        except Exception as e:  # noqa: BLE001 - a full disk, a read-only folder, a vanished one
            _warn("write", str(getattr(self, "_cache_path", "?")), e)

    caching.Cache.load_overload = load_overload
    caching.Cache.save_overload = save_overload
    caching.Cache._apiary_guarded = True
