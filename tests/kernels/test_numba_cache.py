"""numba's disk cache: a folder where the kernels' own takes no files (a read-only install, no writable home), and
failures to write or read an entry (a full disk, a truncated file) that cost a compilation, not the kernel's call."""
from __future__ import annotations

import errno
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from numba.core import caching

from apiary.kernels import numba_cache
from apiary.kernels.errors import KernelError


def _no_files_here(tmp_path: Path) -> Path:
    """A sources folder under which nothing can be made: its parent is a plain file."""
    blocker = tmp_path / "not-a-folder"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("")
    return blocker / "kernels"


def test_a_writable_source_folder_or_the_operators_choice_leaves_numba_alone(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    assert numba_cache.ensure(tmp_path / "kernels", env, tmp_path / "home", tmp_path / "tmp") is None
    assert env == {} and (tmp_path / "kernels" / "__pycache__").is_dir()
    env = {"NUMBA_CACHE_DIR": "/chosen"}
    assert numba_cache.ensure(_no_files_here(tmp_path), env, tmp_path / "home", tmp_path / "tmp") is None
    assert env == {"NUMBA_CACHE_DIR": "/chosen"}


def test_a_read_only_install_caches_under_home_then_in_a_private_temporary_folder(tmp_path: Path) -> None:
    sources, temp = _no_files_here(tmp_path), tmp_path / "tmp"
    temp.mkdir()
    env: dict[str, str] = {}
    chosen = numba_cache.ensure(sources, env, tmp_path / "home", temp)
    assert chosen == tmp_path / "home" / ".cache" / "apiary" / "numba" and env["NUMBA_CACHE_DIR"] == str(chosen)
    env = {}
    chosen = numba_cache.ensure(sources, env, _no_files_here(tmp_path / "h"), temp)  # no writable home either
    assert chosen == temp / f"apiary-numba-{os.getuid()}" and env["NUMBA_CACHE_DIR"] == str(chosen)
    assert chosen.stat().st_mode & 0o777 == 0o700


def test_a_temporary_folder_others_may_write_is_refused_with_what_to_set(tmp_path: Path) -> None:
    """numba's cache index is a pickle: a planted one would run someone else's code."""
    temp = tmp_path / "tmp"
    planted = temp / f"apiary-numba-{os.getuid()}"
    planted.mkdir(parents=True)
    planted.chmod(0o777)
    with pytest.raises(KernelError, match="set NUMBA_CACHE_DIR to a writable folder"):
        numba_cache.ensure(_no_files_here(tmp_path), {}, _no_files_here(tmp_path / "h"), temp)
    if os.getuid() == 0:  # root can hand the folder to another user: owned by someone else, refused too
        planted.chmod(0o700)
        os.chown(planted, 65534, 65534)
        with pytest.raises(KernelError):
            numba_cache.ensure(_no_files_here(tmp_path), {}, _no_files_here(tmp_path / "h"), temp)
        os.chown(planted, 0, 0)
        assert numba_cache.ensure(_no_files_here(tmp_path), {}, _no_files_here(tmp_path / "h"), temp) == planted


def test_kernels_compile_and_cache_from_a_read_only_install_with_no_home(tmp_path: Path) -> None:
    """The drill that found it: the kernels' folder mounted read-only (in a private mount namespace) and $HOME
    unwritable. numba raised at import before; now a CPU kernel compiles, runs, and caches under $TMPDIR."""
    if os.getuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("needs root and unshare(1) to mount the kernels' folder read-only in a private namespace")
    kernels = Path(numba_cache.__file__).resolve().parent
    code = ("import glob, os, torch; from apiary.kernels import ops, reference; "
            "x, w = torch.randn(20, 64), torch.rand(64); "
            "same = torch.allclose(ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), atol=1e-5); "
            "folder = os.environ['NUMBA_CACHE_DIR']; "
            "print(same, folder, len(glob.glob(folder + '/**/*.nbi', recursive=True)))")
    script = (f"mount --bind {kernels} {kernels} && mount -o remount,bind,ro {kernels} && "
              f"! touch {kernels}/probe 2>/dev/null && exec {sys.executable} -c \"$CODE\"")
    env = {**os.environ, "HOME": "/proc/no-home", "TMPDIR": str(tmp_path), "CODE": code}
    env.pop("NUMBA_CACHE_DIR", None)
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and "mount" in done.stderr and "permission denied" in done.stderr.lower():
        pytest.skip(f"this host does not allow a private read-only mount: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    same, folder, cached = done.stdout.split()
    assert same == "True" and folder == str(tmp_path / f"apiary-numba-{os.getuid()}") and int(cached) >= 1


KERNEL = "from numba import njit\n\n\n@njit(cache=True)\ndef triple(x):\n    return 3 * x\n"


def _fresh(source: Path, name: str) -> ModuleType:
    """``source`` imported under a new module name: a new dispatcher over the same disk cache entry."""
    spec = importlib.util.spec_from_file_location(name, source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_guard_is_installed_by_the_kernels_every_numba_module_imports() -> None:
    import apiary.kernels.cpu_attention  # noqa: F401 - every numba kernel module imports it first

    assert caching.Cache._apiary_guarded


def test_a_full_disk_leaves_a_kernel_compiled_in_memory_with_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    numba_cache.guard_disk_errors()
    source = tmp_path / "full_disk_kernel.py"
    source.write_text(KERNEL)

    def no_space(self, path):  # type: ignore[no-untyped-def]  # where numba writes its index and data files
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(caching.IndexDataCacheFile, "_open_for_write", no_space)
    with caplog.at_level(logging.WARNING, logger="apiary.kernels.numba_cache"):
        assert _fresh(source, "full_disk_a").triple(2) == 6  # before: ENOSPC out of the first call
    assert "could not write" in caplog.text and "No space left on device" in caplog.text
    monkeypatch.undo()
    again = _fresh(source, "full_disk_b")
    assert again.triple(2) == 6 and sum(again.triple.stats.cache_hits.values()) == 0  # nothing was kept on disk


def test_a_truncated_or_garbage_entry_is_compiled_afresh_and_rewritten(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    numba_cache.guard_disk_errors()
    source = tmp_path / "corrupt_kernel.py"
    source.write_text(KERNEL)
    first = _fresh(source, "corrupt_a")
    assert first.triple(2) == 6
    folder = Path(first.triple._cache._cache_path)
    (index,) = folder.glob("*.nbi")
    index.write_bytes(index.read_bytes()[:20])  # a truncated index
    with caplog.at_level(logging.WARNING, logger="apiary.kernels.numba_cache"):
        assert _fresh(source, "corrupt_b").triple(2) == 6  # before: UnpicklingError out of the call
    assert "could not read" in caplog.text and "truncated" in caplog.text
    rewritten = _fresh(source, "corrupt_c")
    assert rewritten.triple(2) == 6 and sum(rewritten.triple.stats.cache_hits.values()) == 1
    for data in folder.glob("*.nbc"):
        data.write_bytes(b"garbage\n")  # an unreadable data file
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="apiary.kernels.numba_cache"):
        assert _fresh(source, "corrupt_d").triple(2) == 6
    assert "could not read" in caplog.text
    assert sum(_fresh(source, "corrupt_e").triple.stats.cache_hits.values()) == 0  # not yet called: nothing read
    healed = _fresh(source, "corrupt_f")
    assert healed.triple(2) == 6 and sum(healed.triple.stats.cache_hits.values()) == 1


def test_kernels_run_with_their_cache_folder_on_a_full_disk(tmp_path: Path) -> None:
    """The drill: numba's cache folder on a full file system (a 48 KiB tmpfs filled up, in a private mount
    namespace); a CPU kernel compiled, then numba raised ENOSPC out of its first call. Now it runs."""
    if os.getuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("needs root and unshare(1) to mount a small file system in a private namespace")
    cache = tmp_path / "cache"
    cache.mkdir()
    code = ("import torch; from apiary.kernels import ops, reference; x, w = torch.randn(20, 64), torch.rand(64); "
            "print(torch.allclose(ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), atol=1e-5))")
    script = (f"mount -t tmpfs -o size=48k tmpfs {cache} && ! dd if=/dev/zero of={cache}/fill bs=4k count=100 "
              f"2>/dev/null; exec {sys.executable} -c \"$CODE\"")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "CODE": code}
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and "mount" in done.stderr and "permission denied" in done.stderr.lower():
        pytest.skip(f"this host does not allow a private tmpfs mount: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0 and done.stdout.split() == ["True"], done.stderr[-2000:]
    assert "could not write its compiled kernels" in done.stderr and "No space left on device" in done.stderr
