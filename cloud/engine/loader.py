"""Checkpoint loading: a GGUF file (dequantized with `gguf`) or a Hugging Face folder (config.json + safetensors).

Both become one ``ModelConfig`` plus float32 tensors under Hugging Face Llama names, so the model
code sees a single layout. GGUF stores Llama q/k projections permuted for llama.cpp's interleaved
RoPE; they are un-permuted here so the engine uses rotate-half RoPE for every checkpoint.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from apiary.cloud.engine import checkpoint_cache
from apiary.cloud.engine.config import ModelConfig
from apiary.cloud.engine.errors import EngineError

HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
GGUF_ARCHITECTURES = ("llama", "qwen2")  # q/k are permuted in GGUF for "llama" only

GGUF_TO_HF = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


@dataclass(slots=True)
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face Llama names, float32 on CPU
    source: Path
    metadata: dict[str, Any] = field(default_factory=dict)  # GGUF key/values (tokenizer, chat template)


def load_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path).expanduser()
    if path.is_dir():
        return load_hf_folder(path)
    if path.is_file():
        return load_gguf(path)
    raise EngineError(f"model path {path} is neither a GGUF file nor a Hugging Face folder")


# ---------------------------------------------------------------- GGUF


def read_gguf_metadata(reader: Any) -> dict[str, Any]:
    """All GGUF key/values as plain Python values (strings, numbers, lists)."""
    meta: dict[str, Any] = {}
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            meta[name] = f.contents()
        except Exception:  # unknown field layouts are simply not needed
            continue
    return meta


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation (interleaved RoPE pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: Path) -> Checkpoint:
    """The checkpoint of a GGUF file: from ``checkpoint_cache`` where an earlier process kept it, else read here
    (and kept there)."""
    cached = checkpoint_cache.lookup(path)
    if cached is not None:
        return cached
    checkpoint = _read_gguf(path)
    checkpoint_cache.store(path, checkpoint)
    return checkpoint


def _read_gguf(path: Path) -> Checkpoint:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:
        raise EngineError(f"{path} is not a readable GGUF file: {e}") from e
    meta = read_gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise EngineError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {GGUF_ARCHITECTURES})")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise EngineError(f"{path}: GGUF metadata lacks {arch}.{name}")
        return value

    num_heads, hidden = int(key("attention.head_count")), int(key("embedding_length"))
    num_kv_heads = int(key("attention.head_count_kv", num_heads))
    tensors = {t.name: t for t in reader.tensors}
    vocab_size = int(meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
                     or tensors["token_embd.weight"].shape[-1])
    config = ModelConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")), num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=int(meta.get(f"{arch}.attention.key_length") or hidden // num_heads),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)), max_position=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors, attention_bias="blk.0.attn_q.bias" in tensors,
        sliding_window=meta.get(f"{arch}.attention.sliding_window"), architecture=arch,
    )
    weights: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        data = data.reshape([int(d) for d in reversed(t.shape)]) if data.size == int(t.n_elements) else data
        parts = name.split(".")
        if parts[0] == "blk":
            layer, kind, suffix = parts[1], parts[2], parts[3]
            if arch == "llama" and kind in ("attn_q", "attn_k"):
                data = unpermute_qk(data, num_heads if kind == "attn_q" else num_kv_heads)
            if kind not in GGUF_TO_HF:
                raise EngineError(f"{path}: unexpected tensor {name}")
            hf = f"model.layers.{layer}.{GGUF_TO_HF[kind]}.{suffix}"
        elif name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name == "rope_freqs.weight":  # Llama 3.x frequency factors
            config.extra["rope_freq_factors"] = torch.from_numpy(np.array(data, dtype=np.float32))
            continue
        else:
            raise EngineError(f"{path}: unexpected tensor {name}")
        if not data.flags.writeable:  # float32 tensors come straight from the read-only memmap
            data = data.copy()
        weights[hf] = torch.from_numpy(np.ascontiguousarray(data))
    return Checkpoint(config=config, weights=weights, source=path, metadata=meta)


# ---------------------------------------------------------------- Hugging Face folder


def load_hf_folder(path: Path) -> Checkpoint:
    from safetensors.torch import load_file

    config_file = path / "config.json"
    if not config_file.is_file():
        raise EngineError(f"{path} has no config.json")
    try:
        cfg = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise EngineError(f"{config_file} is not valid JSON: {e}") from e
    archs = cfg.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        raise EngineError(f"{path}: architectures {archs} not supported (supported: {sorted(HF_ARCHITECTURES)})")
    num_heads = int(cfg["num_attention_heads"])
    # transformers >= 5 writes rope settings as "rope_parameters"; older configs use rope_theta + rope_scaling.
    rope = dict(cfg.get("rope_parameters") or {})
    rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_scaling = rope if rope.get("rope_type", "default") != "default" else cfg.get("rope_scaling")
    sliding = cfg.get("sliding_window")
    if arch == "qwen2" and not cfg.get("use_sliding_window", False):
        sliding = None
    config = ModelConfig(
        vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads, num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
        rope_scaling=rope_scaling, max_position=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)) or arch == "qwen2",
        sliding_window=int(sliding) if sliding else None, architecture=arch,
    )
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise EngineError(f"{path} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update({k: v.float() for k, v in load_file(f).items()})
        except Exception as e:
            raise EngineError(f"cannot read {f}: {e}") from e
    return Checkpoint(config=config, weights=weights, source=path)
