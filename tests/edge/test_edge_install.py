"""A device installs the edge like edge software: `pip install 'apiary-mesh[edge]'` brings no torch, no web stack.

The fresh virtualenv gets the project as a built wheel (not editable, so package data such as the shipped
student image must really be in it) and llama-cpp-python from the wheel `.ci/install` built for this CPU
(`.venv/wheelhouse`), so the test does not compile llama.cpp a second time.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from apiary.shared.protocol import ASSESSMENTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE = ROOT / ".venv" / "wheelhouse"
CLOUD_ONLY = ("torch", "triton", "numba", "fastapi", "uvicorn", "amqtt", "matplotlib", "llguidance", "tokenizers")
SIZE_LIMIT_MB = 400  # the target for an edge install, llama-cpp-python included


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)


def test_importing_the_edge_and_the_bridge_never_imports_the_cloud_stack() -> None:
    code = ("import sys, apiary.edge.agent, apiary.edge.cli, apiary.firmware_bridge.bridge, apiary.firmware_bridge.cli, apiary.cli; "
            f"print([m for m in {CLOUD_ONLY!r} if m in sys.modules])")
    out = run([sys.executable, "-c", code], cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_an_edge_only_install_answers_with_the_shipped_student(tmp_path: Path) -> None:
    wheels = sorted(WHEELHOUSE.glob("llama_cpp_python-*.whl"))
    assert wheels, f"no llama-cpp-python wheel in {WHEELHOUSE}: run .ci/install (it builds one for this CPU)"
    venv = tmp_path / "edge-venv"
    made = run([sys.executable, "-m", "venv", str(venv)])
    assert made.returncode == 0, made.stderr
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    installed = run([*pip, "install", "-q", "--prefer-binary", "--find-links", str(WHEELHOUSE), f"{ROOT}[edge]"],
                    cwd=tmp_path)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    listed = {p["name"].lower() for p in json.loads(run([*pip, "list", "--format", "json"]).stdout)}
    assert "llama_cpp_python" in listed or "llama-cpp-python" in listed
    assert not listed & set(CLOUD_ONLY), listed & set(CLOUD_ONLY)
    site = next((venv / "lib").glob("python3*/site-packages"))
    ours = sorted(p.name for p in site.iterdir() if p.name in ("apiary", "shared", "edge", "cloud", "kernels",
                                                                "firmware_bridge", "deploy", "bench"))
    assert ours == ["apiary"], f"one top-level name, apiary; installed: {ours}"
    assert (site / "apiary" / "edge" / "agent.py").is_file() and (site / "apiary" / "shared" / "models").is_dir()

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "APIARY_CONFIG", "VIRTUAL_ENV")}
    env["APIARY_MODEL_DIR"] = str(tmp_path / "models")  # the shipped image unpacks from the installed package
    apiary = str(venv / "bin" / "apiary")
    helped = run([apiary, "edge", "run", "--help"], cwd=tmp_path, env=env)
    assert helped.returncode == 0 and "--device" in helped.stdout, helped.stderr
    answered = run([apiary, "edge", "answer", '{"hive_temp_c": 40.6, "ambient_temp_c": 39.5, "battery_v": 3.9}',
                    "--flags", "hive_temp_c_high", "--severity", "critical"], cwd=tmp_path, env=env)
    assert answered.returncode == 0, answered.stderr[-3000:]
    doc = json.loads(answered.stdout[answered.stdout.index("{"):])
    assert doc["answer"]["tier"] == "edge" and doc["answer"]["action"]["assessment"] in ASSESSMENTS
    assert doc["escalate"] is True  # critical: the edge answers and asks the cloud

    size_mb = sum(f.stat().st_size for f in venv.rglob("*") if f.is_file() and not f.is_symlink()) / 2**20
    print(f"edge-only virtualenv: {size_mb:.0f} MiB")
    assert size_mb < SIZE_LIMIT_MB, f"an edge install takes {size_mb:.0f} MiB"
