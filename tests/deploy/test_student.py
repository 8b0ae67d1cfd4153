"""The trainable decoder: same numbers as transformers' Llama and the cloud engine, saved in a folder both load."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from apiary.cloud.engine.loader import Checkpoint, load_checkpoint
from apiary.deploy.student import (LlamaForTraining, save_hf_folder, spread_layers, student_from_teacher)
from tests.deploy.conftest import tiny_config, tiny_model


def test_logits_match_transformers_llama() -> None:
    transformers = pytest.importorskip("transformers")
    model = tiny_model(vocab_size=512, tie_word_embeddings=False)
    c = model.config
    hf_cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position, tie_word_embeddings=False, attention_bias=False)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    ids = torch.randint(0, c.vocab_size, (2, 37))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)


def test_rows_are_causal_and_independent() -> None:
    model = tiny_model()
    ids = torch.randint(0, 49152, (1, 20))
    with torch.no_grad():
        full = model(ids)
        prefix = model(ids[:, :12])
        padded = model(torch.cat([ids[:, :12], torch.zeros(1, 8, dtype=torch.long)], dim=1))
    torch.testing.assert_close(full[:, :12], prefix, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded[:, :12], prefix, atol=1e-5, rtol=1e-5)  # right padding never leaks back


def test_spread_layers_keeps_first_and_last() -> None:
    assert spread_layers(30, 8) == [0, 4, 8, 12, 17, 21, 25, 29]
    assert spread_layers(30, 2) == [0, 29] and spread_layers(30, 1) == [0] and spread_layers(4, 4) == [0, 1, 2, 3]
    for bad in (0, 31):
        with pytest.raises(ValueError):
            spread_layers(30, bad)


def test_student_copies_the_chosen_teacher_layers() -> None:
    teacher = tiny_model(num_layers=4)
    ckpt = Checkpoint(config=teacher.config, weights=dict(teacher.state_dict()), source=Path("teacher"))
    student = student_from_teacher(ckpt, [0, 3])
    assert student.config.num_layers == 2 and student.num_parameters() < teacher.num_parameters()
    sd, td = student.state_dict(), teacher.state_dict()
    assert torch.equal(sd["model.layers.1.mlp.up_proj.weight"], td["model.layers.3.mlp.up_proj.weight"])
    assert torch.equal(sd["model.embed_tokens.weight"], td["model.embed_tokens.weight"])
    sd["model.layers.1.mlp.up_proj.weight"].add_(1.0)  # a copy, not a view: training never touches the teacher
    assert not torch.equal(sd["model.layers.1.mlp.up_proj.weight"], td["model.layers.3.mlp.up_proj.weight"])
    for bad in ([], [0, 0], [4], [-1]):
        with pytest.raises(ValueError):
            student_from_teacher(ckpt, bad)


def test_hf_folder_loads_in_the_engine_loader_and_tokenizer(tmp_path: Path, teacher_tokenizer_meta: dict) -> None:
    from apiary.cloud.engine.tokenizer import Tokenizer

    model = tiny_model()
    folder = save_hf_folder(model, teacher_tokenizer_meta, tmp_path / "student")
    assert {p.name for p in folder.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                                  "tokenizer_config.json", "generation_config.json",
                                                  "tokenizer_gguf.json"}
    ckpt = load_checkpoint(folder)
    assert ckpt.config.num_layers == 2 and ckpt.config.tie_word_embeddings and "lm_head.weight" not in ckpt.weights
    again = LlamaForTraining.from_checkpoint(ckpt).eval()
    ids = torch.randint(0, 49152, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(again(ids), model(ids))
    from_folder, from_gguf = Tokenizer.from_folder(folder), Tokenizer.from_gguf_metadata(teacher_tokenizer_meta)
    text = from_gguf.apply_chat_template([{"role": "user", "content": "Hive 3: 41.2 C, weight -2.1 kg?"}])
    assert from_folder.encode(text) == from_gguf.encode(text)
    assert from_folder.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        from_gguf.apply_chat_template([{"role": "user", "content": "hi"}])
    assert from_folder.eos_token_id == from_gguf.eos_token_id == 2


def test_engine_serves_a_saved_student_with_the_same_greedy_tokens(tmp_path: Path, teacher_tokenizer_meta: dict) -> None:
    from apiary.cloud.engine import EngineConfig, LLMEngine, SamplingParams

    model = tiny_model(seed=3)
    folder = save_hf_folder(model, teacher_tokenizer_meta, tmp_path / "student")
    engine = LLMEngine(EngineConfig(model_path=folder, kv_cache_bytes=4 << 20, max_num_seqs=2, dtype="float32"))
    prompt = engine.tokenizer.encode("The hive scale dropped by three kilograms")
    [out] = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert out.output_token_ids == ids[len(prompt):]


def test_config_json_has_the_hugging_face_keys(tmp_path: Path, teacher_tokenizer_meta: dict) -> None:
    import json

    folder = save_hf_folder(tiny_model(), teacher_tokenizer_meta, tmp_path / "s", extra_config={"note": 1})
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 2
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["note"] == 1 and cfg["eos_token_id"] == 2 and cfg["tie_word_embeddings"] is True
    assert tiny_config().hidden_size == cfg["hidden_size"]


def test_a_shared_prefix_run_once_gives_the_same_logits_and_gradients() -> None:
    model = tiny_model(seed=5)
    prefix = torch.randint(0, 49152, (1, 9))
    tails = torch.randint(0, 49152, (3, 6))
    full = model(torch.cat([prefix.expand(3, -1), tails], dim=1))
    p_logits, kv = model.forward_with_cache(prefix)
    t_logits = model(tails, past=kv)
    torch.testing.assert_close(p_logits.expand(3, -1, -1), full[:, :9], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(t_logits, full[:, 9:], atol=1e-5, rtol=1e-5)
    # Gradients through the prefix's K/V reach the same weights as the full batch would.
    w = model.model.layers[0].self_attn.k_proj.weight
    g_full = torch.autograd.grad(full[:, 9:].square().mean(), w)[0]
    g_split = torch.autograd.grad(model(tails, past=model.forward_with_cache(prefix)[1]).square().mean(), w)[0]
    torch.testing.assert_close(g_split, g_full, atol=1e-6, rtol=1e-4)
