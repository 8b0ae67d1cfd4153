"""``apiary bench stand_in``: a model's shapes and tokenizer, random weights made where it runs, loadable by the engine."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from apiary.bench import stand_in
from apiary.cloud.engine import EngineConfig, LLMEngine, SamplingParams
from apiary.cloud.engine.loader import load_checkpoint
from tests.cloud.engine.tiny import make_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", layers=3)


def test_the_cli_writes_config_and_tokenizer_and_the_engine_runs_the_filled_stand_in(tiny: Path, tmp_path: Path):
    out = tmp_path / "stand-in"
    done = subprocess.run([sys.executable, "-m", "apiary", "bench", "stand_in", str(out), "--model", str(tiny)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((out / "config.json").read_text())["stand_in_of"] == tiny.name
    stand_in.fill_weights(out)
    real, twin = load_checkpoint(tiny), load_checkpoint(out)
    shapes = {k: tuple(v.shape) for k, v in real.weights.items()}
    assert {k: tuple(v.shape) for k, v in twin.weights.items()} == shapes
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "rope_theta", "max_position", "tie_word_embeddings"):
        assert getattr(twin.config, field) == getattr(real.config, field), field
    engine = LLMEngine(EngineConfig(model_path=out, dtype="float32", kv_cache_bytes=2 << 20, block_size=4))
    [result] = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(result.output_token_ids) == 6
    assert engine.tokenizer.eos_token_id == LLMEngine(EngineConfig(model_path=tiny, kv_cache_bytes=2 << 20)
                                                      ).tokenizer.eos_token_id


def test_weights_are_seeded_and_never_overwritten(tiny: Path, tmp_path: Path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        stand_in.write_config(tiny, folder)
        stand_in.fill_weights(folder)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    before = (a / "model.safetensors").stat().st_mtime_ns
    stand_in.fill_weights(a, seed=1)
    assert (a / "model.safetensors").stat().st_mtime_ns == before


def test_a_missing_model_or_stand_in_is_a_clear_error_not_a_traceback(tmp_path: Path):
    bad = subprocess.run([sys.executable, "-m", "apiary", "bench", "stand_in", str(tmp_path / "out"), "--model",
                          str(tmp_path / "missing.gguf")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "neither a GGUF file" in bad.stderr and "Traceback" not in bad.stderr
    empty = subprocess.run([sys.executable, "-m", "apiary", "bench", "gpu", "--rehearse", "--stand-in",
                            str(tmp_path / "nothing")], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert empty.returncode == 2 and "has no config.json" in empty.stderr
    assert not (tmp_path / "results").exists()  # refused before any step ran
