"""numba's cache folder where the kernels' own folder takes no files (a read-only install, no writable home)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
