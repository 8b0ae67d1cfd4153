"""LocalModel's prompt style: the argument, else the GGUF's apiary.prompt_style, else examples
(on the tiny styled GGUFs of the ``ggufs`` fixture)."""
from __future__ import annotations

from pathlib import Path

import pytest

from apiary.edge.errors import EdgeError
from apiary.edge.model import LocalModel
from apiary.shared.prompting import PROMPT_STYLE_KEY

pytestmark = pytest.mark.timeout(300)


def load(path: Path, prompt_style: str | None = None) -> LocalModel:
    return LocalModel(path, n_ctx=256, threads=1, prompt_style=prompt_style)


def test_style_comes_from_the_gguf_metadata(ggufs: dict[str, Path]) -> None:
    model = load(ggufs["short"])
    assert model.llm.metadata[PROMPT_STYLE_KEY] == "short"
    assert (model.prompt_style, model.prompt_style_source) == ("short", f"GGUF metadata {PROMPT_STYLE_KEY}")
    model.close()


def test_without_the_key_the_style_is_examples(ggufs: dict[str, Path]) -> None:
    model = load(ggufs["plain"])
    assert PROMPT_STYLE_KEY not in model.llm.metadata
    assert model.prompt_style == "examples" and model.prompt_style_source.startswith("default")
    model.close()


def test_the_argument_overrides_the_metadata(ggufs: dict[str, Path]) -> None:
    for name, style in (("short", "examples"), ("plain", "short"), ("verbose", "short")):
        model = load(ggufs[name], style)
        assert (model.prompt_style, model.prompt_style_source) == (style, "argument"), name
        model.close()


def test_unknown_styles_are_refused(ggufs: dict[str, Path]) -> None:
    with pytest.raises(EdgeError, match=r"apiary.prompt_style='verbose'.*examples, short"):
        load(ggufs["verbose"])
    with pytest.raises(EdgeError, match="prompt style must be one of examples, short, got 'long'"):
        load(ggufs["plain"], "long")


def test_the_registry_model_reads_the_examples_prompt(local_model) -> None:
    assert local_model.prompt_style == "examples" and local_model.prompt_style_source.startswith("default")


def test_edge_settings_pass_the_style_on(ggufs: dict[str, Path]) -> None:
    from apiary.edge.settings import EdgeSettings

    for setting, expected in (("auto", "short"), ("examples", "examples")):
        settings = EdgeSettings(model_path=str(ggufs["short"]), prompt_style=setting, n_ctx=256, threads=1)
        model = LocalModel.from_settings(settings)
        assert model.prompt_style == expected and model.n_ctx == 256
        model.close()
    with pytest.raises(ValueError, match="prompt_style must be auto, examples or short, got 'long'"):
        EdgeSettings(prompt_style="long")


def test_edge_answer_reports_the_style_it_asked_in(ggufs: dict[str, Path], tmp_path: Path) -> None:
    import json

    import typer
    from typer.testing import CliRunner

    from apiary.edge.cli import register

    app = typer.Typer()
    register(app)
    config = tmp_path / "apiary.toml"  # the tiny model's own context; a random model's answer is cut short
    config.write_text("[edge]\nn_ctx = 512\nthreads = 1\nmax_tokens = 16\n")
    for extra, expected in (([], ("short", f"GGUF metadata {PROMPT_STYLE_KEY}")),
                            (["--prompt-style", "examples"], ("examples", "argument"))):
        r = CliRunner().invoke(app, ["edge", "answer", '{"hive_temp_c": 40.5}', "--flags", "hive_temp_c_high",
                                     "--model", str(ggufs["short"]), "--config", str(config), *extra])
        assert r.exit_code == 0, r.output
        doc = json.loads(r.output)
        assert (doc["prompt_style"], doc["prompt_style_source"]) == expected
