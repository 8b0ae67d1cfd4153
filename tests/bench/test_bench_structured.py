"""``apiary bench structured``: its validator, the grammar-backend replay, and a tiny end-to-end run.

Numbers are meaningless here (no timing thresholds); what is checked is that the benchmark runs,
that every replayed token is one the backend's mask allows, that it skips xgrammar plainly when
xgrammar is absent, and that the JSON it writes has the keys the docs read.
"""
from __future__ import annotations

import copy
import json
import sys

import pytest
import typer
from typer.testing import CliRunner

from apiary.bench import structured


def _tokenizer(gguf_path):
    tok, vocab = structured._tokenizer(str(gguf_path))
    return tok, vocab


def test_examples_are_valid_and_mini_validator_catches_mistakes():
    from apiary.shared.prompting import ACTION_JSON_SCHEMA

    data = structured.load_schemas()
    assert len(data["json_schemas"]) >= 8
    cases = [(ACTION_JSON_SCHEMA, e) for e in structured.action_examples()]
    cases += [(s["schema"], e) for s in data["json_schemas"].values() for e in s["examples"]]
    for schema, example in cases:
        assert structured.mini_validate(example, schema) == [], (schema, example)
        assert structured.schema_validator(schema)[1](example)
    s = data["json_schemas"]
    bad = [
        (ACTION_JSON_SCHEMA, {**structured.action_examples()[0], "assessment": "fine"}),  # enum
        (ACTION_JSON_SCHEMA, {k: v for k, v in structured.action_examples()[0].items() if k != "urgency"}),  # required
        (ACTION_JSON_SCHEMA, {**structured.action_examples()[0], "extra": "x"}),  # additionalProperties
        (ACTION_JSON_SCHEMA, {**structured.action_examples()[0], "action": "x" * 81}),  # maxLength
        (s["inspection"]["schema"], {**s["inspection"]["examples"][0], "hive_id": "H-42"}),  # pattern
        (s["weather"]["schema"], {**s["weather"]["examples"][0], "temperature_c": 80}),  # maximum
        (s["inspection"]["schema"], {**s["inspection"]["examples"][0], "queen_seen": 1}),  # type
        (s["reading"]["schema"], {"reading": {"kind": "weight", "volts": 3.0}, "sensor_ok": True}),  # anyOf
        (s["survey"]["schema"], {**s["survey"]["examples"][0], "coords": [1.0, 2.0, 3.0]}),  # items: false
        (s["survey"]["schema"], {**s["survey"]["examples"][0], "scores": [1, 2]}),  # minItems
    ]
    tree = copy.deepcopy(s["task_tree"]["examples"][0])
    tree["subtasks"][1]["subtasks"][0]["done"] = "no"  # deep in the recursive $ref
    bad.append((s["task_tree"]["schema"], tree))
    for schema, value in bad:
        assert structured.mini_validate(value, schema), value
        assert not structured.schema_validator(schema)[1](value), value
    assert structured.is_valid_json(' {"a": 1}\n', lambda v: v == {"a": 1})
    assert not structured.is_valid_json('{"a": 1', lambda v: True)


def test_backend_replay_accepts_every_token(gguf_path):
    tok, vocab = _tokenizer(gguf_path)
    result = structured.measure_backends(tok, vocab, list(structured.BACKENDS), rounds=1, batch=4, threads=1)
    assert "llguidance" in result["backends"]
    for b in result["backends"]:
        assert result["bad_tokens"][b] == 0, b
        assert set(result["per_grammar"][b]) == set(result["grammars"]) - set(result["compile_errors"][b])
        assert {"compile_ms", "first_mask_ms", "mask_us_per_token", "cached_to_first_mask_ms"} <= set(
            result["per_grammar"][b]["action"])
        assert result["batch"][b]["rows"] == 4
    assert result["compile_errors"]["llguidance"] == {}


def test_xgrammar_absent_is_skipped_with_a_message(gguf_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar -> ImportError
    tok, vocab = _tokenizer(gguf_path)
    backends, notes = structured.make_backends(["llguidance", "xgrammar", "xgrammar-dynamic"], tok, vocab, 1)
    assert [b.name for b in backends] == ["llguidance"]
    assert notes == [structured.XGRAMMAR_MISSING]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_command_writes_both_tables(gguf_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = typer.Typer()
    app.command()(structured.command)
    result = CliRunner().invoke(app, [
        "--model", str(gguf_path), "--backends", "llguidance,xgrammar", "--backend-rounds", "1",
        "--backend-batch", "2", "--grammar-threads", "1", "--prompts", "1", "--batch", "2", "--max-tokens", "8",
        "--generic-max-tokens", "8", "--rounds", "1", "--history", "1", "--dtype", "float32", "--threads", "1"])
    assert result.exit_code == 0, result.output
    engine = json.loads((tmp_path / "results" / "bench" / "structured.json").read_text())
    assert engine["columns"] == structured.ENGINE_COLUMNS
    assert {"cpu", "raw", "config", "validators", "targets", "rows"} <= set(engine)
    conditions = {(r[0], r[1], r[2]) for r in engine["rows"]}
    assert len(conditions) == 2 * 2 * 4  # workloads x batch sizes x (constrained?, speculation?)
    for row in engine["rows"]:
        valid, total = row[engine["columns"].index("schema-valid")].split("/")
        assert int(total) == row[engine["columns"].index("requests")] and 0 <= int(valid) <= int(total)
    backends = json.loads((tmp_path / "results" / "bench" / "structured-backends.json").read_text())
    assert {"per_grammar", "batch", "bad_tokens", "per_grammar_rows", "cpu", "notes"} <= set(backends)
    assert backends["bad_tokens"]["llguidance"] == 0
