"""apiary finetune on a tiny random model: LoRA trains, resumes, and the engine serves exactly what was trained."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from apiary.cloud.engine import EngineConfig, EngineError, LLMEngine
from apiary.cloud.engine import adapter as adapter_format
from apiary.deploy.answers import reference_action
from apiary.deploy.finetune import FinetuneConfig, FinetuneError, add_lora, finetune, lora_tensors
from apiary.deploy.student import load_model
from apiary.firmware_bridge.simulator import labelled_situations
from apiary.shared.prompting import ACTION_FIELDS, ACTION_JSON_SCHEMA, parse_action
from tests.cloud.engine.tiny import make_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny_ft"), "llama", max_positions=2048)


def test_reference_answers_are_valid_actions_that_name_their_evidence() -> None:
    import jsonschema

    for s in labelled_situations(24, seed=7):
        doc = reference_action(s.label, s.event, s.context)
        jsonschema.validate(doc, ACTION_JSON_SCHEMA)
        assert list(doc) == list(ACTION_FIELDS) and parse_action(json.dumps(doc)).assessment == s.label


def test_short_prompts_stay_under_400_tokens(gguf_path: Path) -> None:
    import gguf

    from apiary.cloud.engine.loader import read_gguf_metadata
    from apiary.cloud.engine.tokenizer import load_tokenizer
    from apiary.deploy.finetune import build_examples

    tok = load_tokenizer(gguf_path, read_gguf_metadata(gguf.GGUFReader(gguf_path)))
    rows = [(s.label, s.event, s.context) for s in labelled_situations(60, seed=11)]
    lengths = [len(e.prompt) for e in build_examples(tok, rows)]
    assert max(lengths) <= 400, max(lengths)


def test_lora_trains_resumes_and_merges_into_what_the_engine_serves(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = FinetuneConfig(base=tiny, out=out, steps=4, batch_size=2, train_situations=6, val_situations=3,
                         eval_every=2, checkpoint_every=1, lora_layers=1, rank=4, alpha=8, dtype="float32")
    lines: list[str] = []
    report = finetune(cfg, progress=False, log=lines.append)
    assert len(report.losses) == 4 and all(l > 0 for l in report.losses)
    assert [v["step"] for v in report.validation] == [2, 4]  # validated while training and at the end
    assert any("validation accuracy" in line for line in lines)
    config = adapter_format.read_config(out / "adapter")
    assert config.prompt_style == "short" and config.rank == 4
    assert all(".layers.1." in t for t in config.targets)  # only the last layer was adapted

    # Resuming at the last step changes nothing; more steps continue from the checkpoint.
    cfg.steps = 5
    again = finetune(cfg, progress=False, log=lines.append)
    assert again.losses[:4] == report.losses and len(again.losses) == 5
    assert any("resuming at step 4" in line for line in lines)
    with pytest.raises(FinetuneError, match="other settings"):
        finetune(FinetuneConfig(base=tiny, out=out, steps=6, batch_size=2, train_situations=6, rank=8,
                                lora_layers=1, dtype="float32"), progress=False, log=lines.append)

    # The engine with the adapter merged computes what the training model with LoRA computes.
    model, _ = load_model(tiny)
    wrapped = add_lora(model, 4, 8, layers=1)
    from safetensors.torch import load_file

    trained = load_file(str(out / "adapter" / adapter_format.WEIGHTS_FILE))
    with torch.no_grad():
        for name, m in wrapped.items():
            m.lora_A.copy_(trained[f"{name}.lora_A"].float())
            m.lora_B.copy_(trained[f"{name}.lora_B"].float())
    assert any(float(t.abs().sum()) > 0 for k, t in lora_tensors(wrapped).items() if k.endswith("lora_B"))
    engine = LLMEngine(EngineConfig(model_path=tiny, adapter_path=out / "adapter", kv_cache_bytes=2 << 20,
                                    block_size=4, dtype="float32"))  # float32: the training model is the oracle
    plain = LLMEngine(EngineConfig(model_path=tiny, kv_cache_bytes=2 << 20, block_size=4, dtype="float32"))
    ids = engine.tokenizer.encode("the hive hums at 270 Hz")
    from tests.cloud.engine.conftest import prompt_logits

    _, served = prompt_logits(engine, ids, use_prefix_cache=False)
    _, base = prompt_logits(plain, ids, use_prefix_cache=False)
    with torch.no_grad():
        expected = model(torch.tensor([ids]))[0]
    assert torch.allclose(served, expected, atol=2e-4)
    assert not torch.allclose(base, expected, atol=1e-3)  # the adapter really changed the model


def test_a_foreign_or_broken_adapter_is_refused(tiny: Path, tmp_path: Path) -> None:
    folder = tmp_path / "bad"
    config = adapter_format.AdapterConfig(rank=2, alpha=4, targets=["model.layers.0.self_attn.q_proj"],
                                          base_sha256="0" * 64)
    adapter_format.write(folder, config, {"model.layers.0.self_attn.q_proj.lora_A": torch.zeros(2, 64),
                                          "model.layers.0.self_attn.q_proj.lora_B": torch.zeros(64, 2)})
    gguf_like = tmp_path / "base.gguf"
    gguf_like.write_bytes(b"not the base")
    from apiary.cloud.engine.loader import load_checkpoint

    with pytest.raises(EngineError, match="tuned on a base"):
        adapter_format.merge(load_checkpoint(tiny).weights, folder, gguf_like)
    adapter_format.write(folder, adapter_format.AdapterConfig(rank=2, alpha=4, targets=["model.layers.0.self_attn.q_proj"]),
                         {"model.layers.0.self_attn.q_proj.lora_A": torch.zeros(3, 64),
                          "model.layers.0.self_attn.q_proj.lora_B": torch.zeros(64, 2)})
    with pytest.raises(EngineError, match="do not fit"):
        LLMEngine(EngineConfig(model_path=tiny, adapter_path=folder, kv_cache_bytes=1 << 20))
    (folder / adapter_format.CONFIG_FILE).write_text("{}")
    with pytest.raises(EngineError, match="cannot read"):
        LLMEngine(EngineConfig(model_path=tiny, adapter_path=folder, kv_cache_bytes=1 << 20))


def test_cli_finetune_and_serve_flag(tiny: Path, tmp_path: Path) -> None:
    from apiary.cli import app

    result = CliRunner().invoke(app, ["finetune", "--base", str(tiny), "--out", str(tmp_path / "cli"), "--steps", "2",
                                      "--batch-size", "2", "--train-situations", "4", "--val-situations", "2",
                                      "--lora-layers", "1", "--rank", "2", "--dtype", "float32", "--no-progress"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output[result.output.index("{\n"):])
    assert doc["steps"] == 2 and Path(doc["adapter"]).is_dir() and doc["validation_accuracy"] is not None
    bad = CliRunner().invoke(app, ["finetune", "--base", str(tiny), "--out", str(tmp_path / "x"), "--steps", "0"])
    assert bad.exit_code == 2 and "steps must be >= 1" in bad.output
