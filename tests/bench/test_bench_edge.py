"""``apiary bench edge``: the eval data is what the bridge publishes, and tiny end-to-end runs write
the JSON keys and PNGs the docs describe. No accuracy or timing thresholds: 3 situations per split
say nothing about a model, only that every tier, split and output is wired up."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from apiary.bench import edge
from apiary.bench.make_edge_eval import SPLITS, load

SPLIT_KEYS = {"n", "answered", "accuracy", "triage", "strategies", "escalated", "escalated_policy",
              "agree_cascade_cloud", "prompt_tokens", "completion_tokens", "edge_joules_per_answered_event",
              "invalid", "per_label", "confusion", "curve"}
PNGS = ["edge-confusion-triage.png", "edge-confusion-edge_only.png", "edge-confusion-cloud_only.png",
        "edge-confusion-cascade.png", "edge-cascade-curve.png"]


def test_eval_data_carries_the_bridges_flags():
    """Every split is on disk at its size, and each event's severity and flags are what the bridge's
    thresholds give its readings today (so watch-level ``_elevated`` flags are there)."""
    from apiary.firmware_bridge.thresholds import assess
    from apiary.shared.protocol import SensorEvent

    elevated = 0
    for name, split in SPLITS.items():
        rows = load(name)
        assert len(rows) == split.n and all(r["id"].startswith(f"s{split.seed}-") for r in rows)
        for r in rows:
            events = [SensorEvent.model_validate(e) for e in [*r["context"], r["event"]]]
            assert r["label"] == events[-1].truth
            for prev, ev in zip(events, events[1:]):  # the first context event lacks its predecessor
                missing = [f.removesuffix("_missing") for f in ev.flags if f.endswith("_missing")]
                severity, flags = assess(ev.readings, missing=missing, previous=(prev.timestamp, prev.readings),
                                         timestamp=ev.timestamp)
                assert (severity, sorted(flags)) == (ev.severity, sorted(ev.flags)), (name, r["id"])
            elevated += any(f.endswith("_elevated") for f in events[-1].flags)
    assert elevated > 0
    assert SPLITS["shift"].conditions and not SPLITS["test"].conditions


@pytest.fixture(scope="module")
def tuned_ggufs(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> dict[str, Path]:
    """Tiny random-weight edge GGUFs (apiary quantize): "short" tuned for the short prompt, "verbose" naming an
    unknown style."""
    from tests.edge.helpers import export_styled_ggufs

    return export_styled_ggufs(tmp_path_factory.mktemp("tuned"), gguf_path)


@pytest.mark.timeout(600)
def test_auto_edge_prompt_style_is_the_models_own(tuned_ggufs, tmp_path, monkeypatch):
    """``--edge-prompt-style auto``: the edge model's LocalModel resolves the style (here its GGUF metadata),
    the Responder asks in it, and the JSON says where it came from."""
    from apiary.cli import app
    from apiary.shared.prompting import PROMPT_STYLE_KEY

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["bench", "edge", "--limit", "1", "--thread-prompts", "0", "--grammar-prompts",
                                      "0", "--skip-cloud", "--edge-model", str(tuned_ggufs["short"])])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "results" / "bench" / "edge.json").read_text())
    assert record["edge"] == {"model": str(tuned_ggufs["short"]), "prompt_style": "short",
                              "prompt_style_source": f"GGUF metadata {PROMPT_STYLE_KEY}"}
    answered = [s for s in record["splits"].values() if s["answered"]]
    assert answered  # the short prompt (~280 tokens), not the examples one (~1,400)
    assert all(0 < split["prompt_tokens"]["edge_mean"] < 600 for split in answered)


def test_an_unknown_style_in_the_gguf_is_a_clear_error(tuned_ggufs, tmp_path, monkeypatch):
    from apiary.cli import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["bench", "edge", "--limit", "1", "--skip-cloud",
                                      "--edge-model", str(tuned_ggufs["verbose"])])
    assert result.exit_code == 2 and "apiary.prompt_style='verbose'" in result.output, result.output


def _check_record(record: dict, results: Path) -> None:
    for key in ("runtime", "threshold", "edge", "cloud", "calibration", "splits", "plots", "cases", "rows"):
        assert key in record, key
    assert set(record["splits"]) == {"test", "shift"}
    for name, split in record["splits"].items():
        assert SPLIT_KEYS <= set(split), (name, SPLIT_KEYS - set(split))
        assert set(split["accuracy"]) == set(edge.TIERS)
        assert set(split["strategies"]) == {"edge_only", "cloud_only", "cascade", "cascade_policy"}
        assert set(split["invalid"]) == {"edge", "cloud", "cascade"}
        for label, row in split["per_label"].items():
            assert set(row) == {"n", *edge.TIERS}, label
        assert split["curve"][0]["threshold"] == "-inf" and split["curve"][-1]["threshold"] == "inf"
        assert split["curve"][-1]["escalated"] == (1.0 if split["answered"] else 0.0)
        if split["answered"]:
            assert split["prompt_tokens"]["edge_mean"] > 0 and split["prompt_tokens"]["cloud_mean"] > 0
            assert math.isfinite(split["edge_joules_per_answered_event"])
    assert {c["split"] for c in record["cases"]} == {"calibration", "test", "shift"}
    for png in PNGS:
        path = results / png
        assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert sorted(Path(p).name for p in record["plots"].values()) == sorted(PNGS)


@pytest.mark.timeout(1200)
def test_command_defaults_write_json_and_pngs(gguf_path, tmp_path, monkeypatch):
    from apiary.cli import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["bench", "edge", "--limit", "3", "--thread-prompts", "0",
                                      "--grammar-prompts", "0"])
    assert result.exit_code == 0, result.output
    results = tmp_path / "results" / "bench"
    record = json.loads((results / "edge.json").read_text())
    _check_record(record, results)
    assert record["calibration"]["n"] == 3 and len(record["cases"]) == 9
    # The defaults are what the demo runs: the shipped INT4 student on the edge, the tuned teacher in the cloud.
    from apiary.shared import assets

    assert Path(record["edge"]["model"]) == assets.model_file("edge-student")
    assert record["edge"]["prompt_style"] == "short" and record["cloud"]["prompt_style"] == "short"
    assert record["edge"]["prompt_style_source"] == "GGUF metadata apiary.prompt_style"
    assert record["cloud"]["adapter"] == str(assets.shipped("sensor-teacher-lora"))
    assert record["cloud"]["skipped"] is None


@pytest.mark.timeout(1200)
def test_command_with_adapter_and_short_edge_prompt(gguf_path, tmp_path, monkeypatch):
    """A (zero) LoRA adapter tuned for the short prompt: the cloud asks in its style, the edge in the
    one asked for; both send ~300-token prompts instead of ~1,400. The cloud engine keeps int8 KV rows
    (--cloud-kv-cache-dtype), which the record says."""
    import torch

    from apiary.cli import app
    from apiary.cloud.engine import adapter as adapter_format

    folder = tmp_path / "adapter"
    target = "model.layers.0.self_attn.q_proj"
    adapter_format.write(folder, adapter_format.AdapterConfig(rank=2, alpha=4, targets=[target], prompt_style="short"),
                         {f"{target}.lora_A": torch.zeros(2, 576), f"{target}.lora_B": torch.zeros(576, 2)})
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["bench", "edge", "--limit", "2", "--thread-prompts", "0",
                                      "--grammar-prompts", "0", "--edge-prompt-style", "short",
                                      "--cloud-adapter", str(folder), "--cloud-kv-cache-dtype", "int8"])
    assert result.exit_code == 0, result.output
    results = tmp_path / "results" / "bench"
    record = json.loads((results / "edge.json").read_text())
    _check_record(record, results)
    assert record["edge"]["prompt_style"] == "short" and record["cloud"]["prompt_style"] == "short"
    assert record["edge"]["prompt_style_source"] == "argument"
    assert record["cloud"]["adapter"] == str(folder)
    assert record["cloud"]["kv_cache_dtype"] == "int8" and record["cloud"]["weights"] == "dtype"
    answered = [s for s in record["splits"].values() if s["answered"]]
    assert answered
    for split in answered:
        assert split["prompt_tokens"]["edge_mean"] < 600 and split["prompt_tokens"]["cloud_mean"] < 600
