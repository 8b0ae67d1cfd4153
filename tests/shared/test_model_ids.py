"""One model id everywhere: the registry name, whether the model is given by name or by its file."""
from __future__ import annotations

from typer.testing import CliRunner

from apiary.cli import app
from apiary.cloud.settings import CloudSettings, load_settings
from apiary.shared import assets
from apiary.shared.model_ids import aliases, model_id

NAME = "smollm2-135m-q4"
FILE = assets.REGISTRY[NAME].filename  # SmolLM2-135M-Instruct.Q4_1.gguf


def test_a_registry_model_has_its_name_as_id_by_name_or_by_file() -> None:
    assert model_id(NAME) == NAME
    assert model_id(f"/cache/apiary/{FILE}") == NAME  # the demo passes the cached file's path
    assert aliases(NAME) == aliases(f"/cache/{FILE}") == {FILE, FILE.removesuffix(".gguf")}


def test_any_other_model_is_named_by_its_file() -> None:
    assert model_id("/models/student.q4_0.gguf") == "student.q4_0"
    assert aliases("/models/student.q4_0.gguf") == {"student.q4_0.gguf"}
    assert model_id("results/distill/student/model") == "model" and aliases("results/distill/student/model") == set()


def test_cloud_serve_and_the_demo_serve_the_same_id(tmp_path) -> None:
    """`apiary cloud serve` (default model) and the demo (the cached file's path) agree on the id."""
    cached = tmp_path / FILE
    cached.write_bytes(b"GGUF")
    assert CloudSettings().model_name == NAME
    demo = load_settings(None, model=str(cached))
    assert demo.model_name == NAME and demo.model_aliases == {FILE, FILE.removesuffix(".gguf")}
    named = load_settings(None, model=str(cached), served_model_name="bees")
    assert named.model_name == "bees" and named.model_aliases == {NAME, FILE, FILE.removesuffix(".gguf")}


def test_models_list_shows_the_id_and_its_aliases(tmp_path) -> None:
    result = CliRunner(env={"APIARY_MODEL_DIR": str(tmp_path), "COLUMNS": "200"}).invoke(
        app, ["models", "list", "--no-verify"])
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if "aliases" in line)
    assert header.split()[1] == "id"  # first column, after the table's border
    row = next(line for line in result.output.splitlines() if NAME in line)
    assert FILE in row and FILE.removesuffix(".gguf") in row
