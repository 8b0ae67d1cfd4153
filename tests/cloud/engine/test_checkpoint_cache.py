"""The disk cache of loaded GGUF checkpoints: what it gives back is what the GGUF gives, a changed file or loader is
never served stale, and no failure of the cache fails a load."""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from apiary.cloud.engine import checkpoint_cache
from apiary.cloud.engine.loader import Checkpoint, _read_gguf, load_checkpoint


def _tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A one-layer Llama GGUF of float32 tensors, with Llama 3's rope frequency factors (a tensor in the config)."""
    import gguf

    hidden, ffn, vocab = 8, 16, 12
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "rope_freqs.weight": (2,),
              "blk.0.attn_norm.weight": (hidden,), "blk.0.attn_q.weight": (hidden, hidden),
              "blk.0.attn_k.weight": (4, hidden), "blk.0.attn_v.weight": (4, hidden),
              "blk.0.attn_output.weight": (hidden, hidden), "blk.0.ffn_norm.weight": (hidden,),
              "blk.0.ffn_gate.weight": (ffn, hidden), "blk.0.ffn_up.weight": (ffn, hidden),
              "blk.0.ffn_down.weight": (hidden, ffn)}
    rng = np.random.default_rng(seed)
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _same(a: Checkpoint, b: Checkpoint) -> bool:
    extras = a.config.extra.keys() | b.config.extra.keys()
    return (a.metadata == b.metadata and a.weights.keys() == b.weights.keys()
            and all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
            and all(getattr(a.config, f.name) == getattr(b.config, f.name) for f in dataclasses.fields(a.config)
                    if f.name != "extra")
            and all(torch.equal(a.config.extra[k], b.config.extra[k]) if isinstance(a.config.extra[k], torch.Tensor)
                    else a.config.extra[k] == b.config.extra[k] for k in extras))


def _entries(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.is_dir() else []


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache of its own, taking every file however small."""
    root = tmp_path / "cache"
    monkeypatch.setenv(checkpoint_cache.ENV, str(root))
    monkeypatch.setattr(checkpoint_cache, "MIN_BYTES", 0)
    return root


def test_a_cached_checkpoint_is_the_gguf_read_bit_for_bit(tmp_path: Path, cache: Path) -> None:
    path = _tiny_gguf(tmp_path / "m.gguf")
    assert checkpoint_cache.lookup(path) is None
    read = load_checkpoint(path)  # read, and kept
    assert len(_entries(cache)) == 1
    hit = checkpoint_cache.lookup(path)
    assert hit is not None and hit.source == path
    assert isinstance(hit.config.extra["rope_freq_factors"], torch.Tensor)
    assert _same(hit, read) and _same(load_checkpoint(path), _read_gguf(path))


def test_a_changed_file_is_read_again_and_its_old_entry_removed(tmp_path: Path, cache: Path) -> None:
    path = _tiny_gguf(tmp_path / "m.gguf", seed=0)
    first = load_checkpoint(path)
    old = _entries(cache)
    _tiny_gguf(path, seed=1)  # the same name and size, new weights
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 1_000_000))
    second = load_checkpoint(path)
    assert not torch.equal(first.weights["model.norm.weight"], second.weights["model.norm.weight"])
    assert _same(second, _read_gguf(path))
    assert len(_entries(cache)) == 1 and _entries(cache) != old


def test_an_entry_an_older_loader_made_is_not_read_and_is_removed(tmp_path: Path, cache: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = _tiny_gguf(tmp_path / "m.gguf")
    load_checkpoint(path)
    old = _entries(cache)
    monkeypatch.setattr(checkpoint_cache, "_loader_digest", lambda: "a changed loader")
    assert checkpoint_cache.lookup(path) is None
    load_checkpoint(path)
    assert len(_entries(cache)) == 1 and _entries(cache) != old


def test_a_damaged_entry_is_removed_and_the_gguf_read_again(tmp_path: Path, cache: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    path = _tiny_gguf(tmp_path / "m.gguf")
    load_checkpoint(path)
    (entry,) = _entries(cache)
    (entry / "weights.safetensors").write_bytes(b"\x00" * 40)
    with caplog.at_level(logging.WARNING, logger=checkpoint_cache.__name__):
        again = load_checkpoint(path)
    assert "unreadable" in caplog.text
    assert _same(again, _read_gguf(path))
    assert checkpoint_cache.lookup(path) is not None  # kept anew


@pytest.mark.parametrize("blocker", ["a file where the folder goes", "a full disk"])
def test_a_cache_that_cannot_be_written_never_fails_a_load(tmp_path: Path, cache: Path, blocker: str,
                                                           caplog: pytest.LogCaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors.torch

    path = _tiny_gguf(tmp_path / "m.gguf")
    if blocker == "a full disk":
        def full(*args: object, **kwargs: object) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(safetensors.torch, "save_file", full)
    else:
        cache.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger=checkpoint_cache.__name__):
        loaded = load_checkpoint(path)
    assert _same(loaded, _read_gguf(path))
    assert "could not keep" in caplog.text
    assert checkpoint_cache.lookup(path) is None
    if cache.is_dir():  # nothing half-written is left behind
        assert list(cache.iterdir()) == []


def test_off_keeps_nothing_and_small_files_are_not_kept(tmp_path: Path, cache: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = _tiny_gguf(tmp_path / "m.gguf")
    monkeypatch.setenv(checkpoint_cache.ENV, "off")
    load_checkpoint(path)
    assert not cache.exists()
    monkeypatch.setenv(checkpoint_cache.ENV, str(cache))
    monkeypatch.setattr(checkpoint_cache, "MIN_BYTES", path.stat().st_size + 1)
    load_checkpoint(path)
    assert _entries(cache) == []


def test_the_least_recently_used_entry_goes_first_past_max_entries(tmp_path: Path, cache: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint_cache, "MAX_ENTRIES", 2)
    first, second, third = (_tiny_gguf(tmp_path / f"{i}.gguf", seed=i) for i in range(3))
    load_checkpoint(first)
    time.sleep(0.01)
    load_checkpoint(second)
    time.sleep(0.01)
    assert checkpoint_cache.lookup(first) is not None  # used again: now the second is the least recently used
    time.sleep(0.01)
    load_checkpoint(third)
    assert len(_entries(cache)) == 2
    assert checkpoint_cache.lookup(first) is not None and checkpoint_cache.lookup(third) is not None
    assert checkpoint_cache.lookup(second) is None


def test_a_write_left_by_a_killed_process_is_ignored_then_removed_once_old(tmp_path: Path, cache: Path) -> None:
    cache.mkdir()
    old, fresh = cache / ".writing-old", cache / ".writing-fresh"
    for leftover in (old, fresh):
        leftover.mkdir()
        (leftover / "weights.safetensors").write_bytes(b"half a file")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    path = _tiny_gguf(tmp_path / "m.gguf")
    load_checkpoint(path)
    assert not old.exists() and fresh.exists()  # the fresh one may be another process's write under way
    assert _same(checkpoint_cache.lookup(path), _read_gguf(path))


def test_the_real_model_through_the_cache_is_the_gguf_and_an_engine_built_from_it_answers_the_same(
        gguf_path: Path, real_engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """SmolLM2's Q4_1 GGUF (~3.5 s to read): kept, read back equal (tokenizer metadata included), and an engine
    built from the entry decodes what the session's engine decodes."""
    from apiary.cloud.engine import EngineConfig, LLMEngine, SamplingParams

    monkeypatch.setenv(checkpoint_cache.ENV, str(tmp_path / "cache"))
    read = load_checkpoint(gguf_path)
    hit = checkpoint_cache.lookup(gguf_path)
    assert hit is not None and _same(hit, read)
    assert len(hit.metadata["tokenizer.ggml.tokens"]) == hit.config.vocab_size
    with caplog.at_level(logging.INFO, logger=checkpoint_cache.__name__):
        engine = LLMEngine(EngineConfig(model_path=gguf_path, **{
            k: getattr(real_engine.config, k) for k in ("dtype", "weights", "head", "kv_cache_bytes", "max_num_batched_tokens")}))
    assert "read from the cache" in caplog.text
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompt = "Hive 7 is buzzing loudly at night. What should the beekeeper check?"
    assert engine.generate([prompt], params)[0].output_token_ids == (
        real_engine.generate([prompt], params)[0].output_token_ids)
