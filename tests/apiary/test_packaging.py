"""One import namespace and the rooms' dependency rules, checked on the source itself.

The layout's folders (shared/, edge/, cloud/, …) install as ``apiary.shared``, ``apiary.edge``, … so
that generic top-level names (a popular ``kernels`` distribution exists) never clash with other
packages. The rules the brief sets for the rooms are checked on every module's imports.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("shared", "edge", "cloud", "kernels", "firmware_bridge", "deploy", "bench")
FOLDERS = ("apiary", *ROOMS)


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", *FOLDERS], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / line for line in out.stdout.splitlines() if (ROOT / line).is_file()]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts if parts[0] == "apiary" else ["apiary", *parts])


def imports_of(path: Path) -> list[str]:
    """Absolute module names a file imports (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(), str(path))
    own = module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                found.append(f"{base}.{node.module}" if node.module else base)
            else:
                found.append(node.module or "")
    return found


SOURCES = [p for p in tracked_files() if p.suffix == ".py"]


def test_pyproject_lists_every_folder_as_a_package_of_the_namespace() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {"apiary": "apiary", **{f"apiary.{r}": r for r in ROOMS}}
    folders = {module_name(parent / "__init__.py") for p in tracked_files()
               for parent in [p.parent, *p.parent.parents] if parent != ROOT and ROOT in parent.parents}
    assert set(config["packages"]) == folders


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_a_room_by_its_bare_top_level_name(path: Path) -> None:
    bare = [m for m in imports_of(path) if m.split(".")[0] in ROOMS]
    assert not bare, f"import apiary.<room>…, not {bare}"


def _ours(path: Path) -> set[str]:
    return {m for m in imports_of(path) if m == "apiary" or m.startswith("apiary.")}


def _in(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


RULES = [
    # (room, what it may import of ours, why)
    ("apiary.shared", ("apiary.shared",), "shared/ imports nothing of ours"),
    ("apiary.kernels", ("apiary.kernels",), "kernels/ are leaves"),
    ("apiary.edge", ("apiary.edge", "apiary.shared"), "the edge meets the cloud on the wire only"),
    ("apiary.firmware_bridge", ("apiary.firmware_bridge", "apiary.shared"), "the bridge only publishes events"),
    ("apiary.cloud.engine", ("apiary.cloud.engine", "apiary.kernels", "apiary.shared"),
     "the engine knows no MQTT, no HTTP and no registry"),
    ("apiary.cloud", ("apiary.cloud", "apiary.kernels", "apiary.shared"), "the cloud meets the edge on the wire only"),
]


@pytest.mark.parametrize("room,allowed,why", RULES, ids=[r[0] for r in RULES])
def test_rooms_import_only_what_the_layout_allows(room: str, allowed: tuple[str, ...], why: str) -> None:
    broken = {}
    for path in SOURCES:
        if _in(module_name(path), room):
            bad = sorted(m for m in _ours(path) if not _in(m, *allowed))
            if bad:
                broken[str(path.relative_to(ROOT))] = bad
    assert not broken, f"{why}: {broken}"


def test_the_engine_imports_no_mqtt_or_http_library() -> None:
    web = ("paho", "fastapi", "httpx", "uvicorn", "starlette", "amqtt")
    broken = {str(p.relative_to(ROOT)): sorted(m for m in imports_of(p) if m.split(".")[0] in web)
              for p in SOURCES if _in(module_name(p), "apiary.cloud.engine")}
    assert not {k: v for k, v in broken.items() if v}


def test_importing_the_namespace_leaves_no_bare_room_in_sys_modules() -> None:
    code = ("import sys, apiary.cli, apiary.shared.protocol, apiary.edge.agent, apiary.firmware_bridge.bridge; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {ROOMS!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_checkout_does_not_shadow_installed_distributions_in_the_test_process() -> None:
    """pytest runs from the checkout, whose kernels/ once shadowed Hugging Face's ``kernels`` (which
    transformers >= 5.25 imports): the checkout must come after site-packages on sys.path."""
    import importlib.metadata
    import importlib.util

    positions = [i for i, p in enumerate(sys.path) if Path(p or ".").resolve() == ROOT]
    site = [i for i, p in enumerate(sys.path) if p.endswith("site-packages")]
    assert site and all(i > max(site) for i in positions), sys.path
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("no distribution named kernels is installed here")
    spec = importlib.util.find_spec("kernels")
    assert spec is not None and spec.origin is not None
    assert not Path(spec.origin).resolve().is_relative_to(ROOT / "kernels")


def test_python_dash_m_apiary_from_the_checkout_does_not_shadow_installed_distributions() -> None:
    """``python -m apiary`` in a checkout puts it first on sys.path; ``apiary/__main__.py`` moves it last."""
    import importlib.metadata

    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("no distribution named kernels is installed here")
    code = ("import importlib.util, runpy, sys\nsys.argv = ['apiary', '--help']\n"
            "try:\n    runpy.run_module('apiary', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('KERNELS', importlib.util.find_spec('kernels').origin)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    origin = out.stdout.rsplit("KERNELS ", 1)[1].strip()
    assert not Path(origin).resolve().is_relative_to(ROOT / "kernels"), origin
