"""`apiary edge …` commands: bad input is a clear one-line error and exit code 2, never a traceback."""
from __future__ import annotations

from pathlib import Path

import typer
from typer.testing import CliRunner

from apiary.edge.cli import register

app = typer.Typer()
register(app)
runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, ["edge", *args])


def test_run_rejects_a_bad_site_name(tmp_path: Path) -> None:
    r = run("run", "--site", "north/x", "--device", "d1", "--broker", "mqtt://127.0.0.1:1",
            "--state-dir", str(tmp_path), "--model", str(tmp_path / "none.gguf"))
    assert r.exit_code == 2 and "error:" in r.output and "invalid site" in r.output


def test_run_rejects_a_missing_model(tmp_path: Path) -> None:
    r = run("run", "--site", "north", "--device", "d1", "--broker", "mqtt://127.0.0.1:1",
            "--state-dir", str(tmp_path), "--model", str(tmp_path / "none.gguf"))
    assert r.exit_code == 2 and "model file not found" in r.output


def test_run_rejects_bad_config(tmp_path: Path) -> None:
    cfg = tmp_path / "apiary.toml"
    cfg.write_text("[edge]\nthreads = 0\n")
    r = run("run", "--site", "north", "--device", "d1", "--config", str(cfg), "--state-dir", str(tmp_path))
    assert r.exit_code == 2 and "invalid [edge] configuration" in r.output
    r = run("run", "--site", "north", "--device", "d1", "--broker", "http://x", "--state-dir", str(tmp_path))
    assert r.exit_code == 2 and "broker URL must start with mqtt://" in r.output


def test_run_rejects_an_ota_key_it_cannot_use(tmp_path: Path) -> None:
    cfg = tmp_path / "apiary.toml"
    cfg.write_text(f'[edge.ota]\npublic_key = "{tmp_path / "missing.pub"}"\n')  # neither a key nor a file
    r = run("run", "--site", "north", "--device", "d1", "--broker", "mqtt://127.0.0.1:1", "--config", str(cfg),
            "--state-dir", str(tmp_path), "--model", str(tmp_path / "none.gguf"))
    assert r.exit_code == 2 and "error: [edge.ota] public_key: cannot read key file" in r.output, r.output
    cfg.write_text("[edge.ota]\nmax_image_bytes = 0\n")
    r = run("run", "--site", "north", "--device", "d1", "--config", str(cfg), "--state-dir", str(tmp_path))
    assert r.exit_code == 2 and "invalid [edge] configuration" in r.output


def test_answer_rejects_bad_readings() -> None:
    r = run("answer", "{not json")
    assert r.exit_code == 2 and "error:" in r.output
    r = run("answer", '{"hive_temp_c": "hot"}')
    assert r.exit_code == 2 and "error:" in r.output


def test_answer_rejects_an_unknown_prompt_style(tmp_path: Path) -> None:
    r = run("answer", '{"hive_temp_c": 39.5}', "--prompt-style", "long", "--model", str(tmp_path / "none.gguf"))
    assert r.exit_code == 2 and "invalid [edge] configuration" in r.output and "prompt_style must be" in r.output


def test_help_shows_config_sections_literally() -> None:
    """`[mqtt]`, not `\\[mqtt]`, through `apiary edge` and `python -m apiary.edge` alike."""
    import subprocess
    import sys

    from apiary.cli import app as apiary

    texts = [runner.invoke(apiary, ["edge", "run", "--help"]).output,
             subprocess.run([sys.executable, "-m", "edge", "run", "--help"], capture_output=True, text=True,
                            env={"COLUMNS": "100", "PATH": ""}, timeout=60).stdout]
    for text in texts:
        assert "[mqtt]" in text and "[edge]" in text and "\\[" not in text, text
