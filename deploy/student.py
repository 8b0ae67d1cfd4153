"""A trainable Llama decoder for distillation, with the engine's config, loader and RoPE, and Hugging Face names.

The cloud engine's ``LlamaModel`` is inference-only (fused weights, paged KV cache, no
autograd parameters), so training uses this plain ``nn.Module`` over whole sequences. It
shares everything that must match exactly: ``ModelConfig``, checkpoint loading (GGUF or
HF folder, q/k un-permuted for rotate-half RoPE) and ``rope_inv_freq``. Parameter names
are the Hugging Face Llama names, so ``state_dict()`` saves straight into a folder that
``LLMEngine(EngineConfig(model_path=folder))`` (and ``transformers``) can load.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from apiary.cloud.engine.config import ModelConfig
from apiary.cloud.engine.loader import Checkpoint, load_checkpoint
from apiary.cloud.engine.model import rope_inv_freq
from apiary.deploy.qat import fake_quant

KV = tuple[torch.Tensor, torch.Tensor]  # one layer's keys and values, [batch, kv_heads, tokens, head_dim]
TOKENIZER_META_FILE = "tokenizer_gguf.json"  # the teacher GGUF's tokenizer.* metadata, for the GGUF export


class Linear(nn.Linear):
    """``nn.Linear`` whose weight can be seen through the export's INT4 rounding (``apiary.deploy.qat``)."""

    fake_quant: str | None = None  # a deploy.qat qtype while quantization-aware training runs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fake_quant is None:
            return super().forward(x)
        return F.linear(x, fake_quant(self.weight, self.fake_quant), self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: KV | None = None) -> tuple[torch.Tensor, KV]:
        """Attend over ``past`` (a shared prefix's K/V, batch 1 or b) and the new tokens, causally."""
        b, t, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask = None
        if past is not None:
            p = past[0].shape[2]
            k = torch.cat((past[0].expand(b, -1, -1, -1).to(k.dtype), k), dim=2)
            v = torch.cat((past[1].expand(b, -1, -1, -1).to(v.dtype), v), dim=2)
            mask = torch.ones(t, p + t, dtype=torch.bool, device=x.device).tril(diagonal=p)
        kv = (k, v)
        rep = c.num_heads // c.num_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), kv


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: KV | None = None) -> tuple[torch.Tensor, KV]:
        h, kv = self.self_attn(self.input_layernorm(x), cos, sin, past)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class Backbone(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the engine's convention after GGUF q/k are un-permuted)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class LlamaForTraining(nn.Module):
    """``forward(input_ids [B, T], past=None) -> logits [B, T, vocab]`` (float32), causal over each row."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config).to(torch.float32), persistent=False)

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def hidden(self, input_ids: torch.Tensor, past: list[KV] | None = None) -> tuple[torch.Tensor, list[KV]]:
        """Final-normed hidden states of ``input_ids`` (placed after ``past``), and every layer's K/V so far."""
        start = past[0][0].shape[2] if past else 0
        pos = torch.arange(start, start + input_ids.shape[1], device=input_ids.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        x = self.model.embed_tokens(input_ids)
        kvs: list[KV] = []
        for i, layer in enumerate(self.model.layers):
            x, kv = layer(x, cos, sin, past[i] if past else None)
            kvs.append(kv)
        return self.model.norm(x), kvs

    def forward(self, input_ids: torch.Tensor, past: list[KV] | None = None) -> torch.Tensor:
        return self.forward_with_cache(input_ids, past)[0]

    def forward_with_cache(self, input_ids: torch.Tensor,
                           past: list[KV] | None = None) -> tuple[torch.Tensor, list[KV]]:
        """Logits (float32) and K/V. A prefix shared by a batch runs once at batch 1; its K/V is ``past``
        for the batch of continuations (and gradients flow back through it)."""
        h, kvs = self.hidden(input_ids, past)
        return F.linear(h, self.head_weight()).float(), kvs

    def set_fake_quant(self, qtype: str | None) -> None:
        """See every block projection as the GGUF export's ``qtype`` would store it (None: float again).

        Embeddings (the tied head) and norms stay float: the export keeps them at 8 bits or more."""
        for m in self.model.layers.modules():
            if isinstance(m, Linear):
                m.fake_quant = qtype

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> "LlamaForTraining":
        model = cls(ckpt.config)
        weights = {k: v for k, v in ckpt.weights.items() if not (ckpt.config.tie_word_embeddings and k == "lm_head.weight")}
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise ValueError(f"checkpoint {ckpt.source} does not fit: missing {missing[:4]}, unexpected {unexpected[:4]}")
        return model


def spread_layers(num_teacher_layers: int, num_student_layers: int) -> list[int]:
    """Teacher layers to copy: evenly spread, always keeping the first and the last."""
    if not 1 <= num_student_layers <= num_teacher_layers:
        raise ValueError(f"student layers must be in 1..{num_teacher_layers}, got {num_student_layers}")
    if num_student_layers == 1:
        return [0]
    step = (num_teacher_layers - 1) / (num_student_layers - 1)
    return sorted({round(i * step) for i in range(num_student_layers)})


def student_from_teacher(teacher: Checkpoint, layers: list[int]) -> LlamaForTraining:
    """A student with the teacher's embeddings, final norm and head, and copies of teacher ``layers``."""
    if not layers or len(set(layers)) != len(layers) or not all(0 <= i < teacher.config.num_layers for i in layers):
        raise ValueError(f"layers must be distinct indices in 0..{teacher.config.num_layers - 1}, got {layers}")
    config = dataclasses.replace(teacher.config, num_layers=len(layers), extra=dict(teacher.config.extra))
    weights: dict[str, torch.Tensor] = {}
    for name, w in teacher.weights.items():
        if name.startswith("model.layers."):
            _, _, idx, rest = name.split(".", 3)
            if int(idx) in layers:
                weights[f"model.layers.{layers.index(int(idx))}.{rest}"] = w.clone()
        else:
            weights[name] = w.clone()
    return LlamaForTraining.from_checkpoint(Checkpoint(config=config, weights=weights, source=teacher.source,
                                                       metadata=teacher.metadata))


def load_model(path: str | Path) -> tuple[LlamaForTraining, Checkpoint]:
    """A GGUF file or HF folder as a (float32, eval-mode) training module, plus its checkpoint metadata."""
    ckpt = load_checkpoint(path)
    model = LlamaForTraining.from_checkpoint(ckpt).eval()
    ckpt.weights = {}  # the module holds its own copy
    return model, ckpt


# ---------------------------------------------------------------- Hugging Face folder


def hf_config(config: ModelConfig, tokenizer_meta: dict[str, Any]) -> dict[str, Any]:
    """config.json in the Hugging Face Llama schema (the keys ``apiary.cloud.engine.loader.load_hf_folder`` reads)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling, "max_position_embeddings": config.max_position,
        "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": config.attention_bias,
        "mlp_bias": False, "hidden_act": "silu", "torch_dtype": "float32",
        "bos_token_id": tokenizer_meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": tokenizer_meta.get("tokenizer.ggml.eos_token_id"),
    }


def tokenizer_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    """The ``tokenizer.*`` keys of a GGUF's metadata (vocab, merges, types, special ids, chat template)."""
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


def save_hf_folder(model: LlamaForTraining, tokenizer_meta: dict[str, Any], out: str | Path,
                   extra_config: dict[str, Any] | None = None) -> Path:
    """Write config.json, model.safetensors and the tokenizer files; each file replaced atomically."""
    from safetensors.torch import save_file

    from apiary.cloud.engine.tokenizer import Tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    _atomic(out / "model.safetensors", lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    tok = Tokenizer.from_gguf_metadata(tokenizer_meta)
    _atomic(out / "tokenizer.json", lambda p: tok._tok.save(str(p)))
    tokens = tokenizer_meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        i = tokenizer_meta.get(key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    tok_cfg = {"tokenizer_class": "GPT2Tokenizer", "bos_token": token("tokenizer.ggml.bos_token_id"),
               "eos_token": token("tokenizer.ggml.eos_token_id"), "unk_token": token("tokenizer.ggml.unknown_token_id"),
               "pad_token": token("tokenizer.ggml.padding_token_id"),
               "add_bos_token": bool(tokenizer_meta.get("tokenizer.ggml.add_bos_token", False)),
               "chat_template": tokenizer_meta.get("tokenizer.chat_template"), "model_max_length": model.config.max_position}
    gen_cfg = {"bos_token_id": tokenizer_meta.get("tokenizer.ggml.bos_token_id"),
               "eos_token_id": tokenizer_meta.get("tokenizer.ggml.eos_token_id")}
    files = {"tokenizer_config.json": tok_cfg, "generation_config.json": gen_cfg, TOKENIZER_META_FILE: tokenizer_meta,
             "config.json": {**hf_config(model.config, tokenizer_meta), **(extra_config or {})}}
    for name, doc in files.items():  # config.json last: its presence marks a complete folder
        _atomic(out / name, lambda p, d=doc: p.write_text(json.dumps(d, indent=1, default=_jsonable)))
    return out


def read_tokenizer_metadata(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / TOKENIZER_META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no {TOKENIZER_META_FILE}; it was not written by apiary distill")
    return json.loads(path.read_text())


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.tolist()
    raise TypeError(f"not JSON serialisable: {type(v).__name__}")


def _atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)
