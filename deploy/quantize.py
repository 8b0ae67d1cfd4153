"""INT4 export: a Hugging Face Llama folder to a llama.cpp GGUF (Q4_0 or Q4_1), and how much it changed.

Written with the ``gguf`` package (numpy quantisers). Layout follows llama.cpp's own
converter: llama architecture keys, the teacher's tokenizer metadata and chat template
(kept in the folder by ``apiary distill``), q/k projections permuted back to llama.cpp's
interleaved-RoPE order, norms in F32, block weights in Q4_0/Q4_1 and the (tied)
embedding in Q8_0, as in the SmolLM2 Q4_1 release, because it doubles as the output
head and is the most quantisation-sensitive matrix (Q5_0 on request: a smaller file, to be
checked with the agreement below). An untied output head stays Q8_0.

A folder tuned for a prompt style (``config.json``: ``apiary_distill.prompt_style`` or a
top-level ``apiary_prompt_style``) gets it as the GGUF string ``apiary.prompt_style``, which
the edge's ``LocalModel`` reads to ask the model in that style.

The quality check is teacher-forced top-1 agreement of the GGUF in llama.cpp with the
float32 folder in torch, over held-out sensor samples (or prompts + general text).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

QTYPES = ("q4_0", "q4_1")
EMBED_QTYPES = ("q8_0", "q5_0")  # token_embd.weight (the tied output head too)


class QuantizeError(ValueError):
    """The folder cannot be exported (not a distilled Llama folder, unsupported shape or type)."""


@dataclass(frozen=True, slots=True)
class QuantizeReport:
    path: Path
    qtype: str
    size_bytes: int
    fp32_bytes: int
    top1_agreement: float | None = None
    positions: int = 0
    embed_qtype: str = "q8_0"
    prompt_style: str | None = None  # the apiary.prompt_style written into the GGUF, if any


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rotate-half q/k rows to llama.cpp's interleaved order (inverse of the engine's ``unpermute_qk``)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    if parts[:2] == ["model", "layers"]:
        module, suffix = ".".join(parts[3:-1]), parts[-1]
        if module in HF_TO_GGUF:
            return f"blk.{parts[2]}.{HF_TO_GGUF[module]}.{suffix}"
    raise QuantizeError(f"no GGUF name for tensor {hf}")


def folder_prompt_style(folder: str | Path) -> str | None:
    """The prompt style ``folder``'s model was tuned for: ``config.json``'s ``apiary_distill.prompt_style``,
    else its ``apiary_prompt_style``, else None. Raises :class:`QuantizeError` for an unknown style."""
    from apiary.shared.prompting import PROMPT_STYLES

    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise QuantizeError(f"cannot read {path}: {e}") from None
    distill = config.get("apiary_distill")
    style = (distill.get("prompt_style") if isinstance(distill, dict) else None) or config.get("apiary_prompt_style")
    if style is not None and style not in PROMPT_STYLES:
        raise QuantizeError(f"{path} names prompt style {style!r}, not one of {', '.join(PROMPT_STYLES)}")
    return style


def export_gguf(folder: str | Path, out: str | Path, qtype: str = "q4_0", name: str | None = None,
                embed_qtype: str = "q8_0") -> Path:
    """Write ``folder`` (config.json + safetensors + tokenizer_gguf.json) as a quantised GGUF at ``out``:
    block weights in ``qtype``, the token embedding in ``embed_qtype``, the folder's prompt style (if it
    names one) as ``apiary.prompt_style``."""
    import gguf

    from apiary.cloud.engine.errors import EngineError
    from apiary.cloud.engine.loader import load_checkpoint
    from apiary.deploy.student import read_tokenizer_metadata

    folder, out = Path(folder), Path(out)
    if qtype not in QTYPES:
        raise QuantizeError(f"qtype must be one of {QTYPES}, got {qtype!r}")
    if embed_qtype not in EMBED_QTYPES:
        raise QuantizeError(f"embed_qtype must be one of {EMBED_QTYPES}, got {embed_qtype!r}")
    try:
        ckpt = load_checkpoint(folder)
        tok = read_tokenizer_metadata(folder)
    except (EngineError, FileNotFoundError, ValueError) as e:
        raise QuantizeError(f"cannot export {folder}: {e}") from None
    style = folder_prompt_style(folder)
    c = ckpt.config
    if c.architecture != "llama" or c.attention_bias or c.rope_scaling:
        raise QuantizeError(f"only plain Llama folders are exported (got {c.architecture}, bias={c.attention_bias}, "
                            f"rope_scaling={c.rope_scaling})")
    block_type = gguf.GGMLQuantizationType.Q4_0 if qtype == "q4_0" else gguf.GGMLQuantizationType.Q4_1
    file_type = gguf.LlamaFileType.MOSTLY_Q4_0 if qtype == "q4_0" else gguf.LlamaFileType.MOSTLY_Q4_1
    embed_type = gguf.GGMLQuantizationType.Q8_0 if embed_qtype == "q8_0" else gguf.GGMLQuantizationType.Q5_0

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    try:
        _write(tmp, folder, name, c, ckpt.weights, tok, block_type, file_type, embed_type, style)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)
    return out


def _write(tmp: Path, folder: Path, name: str | None, c: Any, weights: dict[str, Any], tok: dict[str, Any],
           block_type: Any, file_type: Any, embed_type: Any, prompt_style: str | None) -> None:
    import gguf

    from apiary.shared.prompting import PROMPT_STYLE_KEY

    w = gguf.GGUFWriter(tmp, arch="llama")
    w.add_type("model")
    w.add_name(name or folder.name)
    w.add_context_length(c.max_position)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_rope_dimension_count(c.head_dim)
    if c.head_dim != c.hidden_size // c.num_heads:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(w, tok)
    if prompt_style is not None:
        w.add_string(PROMPT_STYLE_KEY, prompt_style)

    names = sorted(weights, key=_tensor_order)
    for hf in names:
        if c.tie_word_embeddings and hf == "lm_head.weight":
            continue
        data = weights[hf].numpy().astype(np.float32)
        if hf.endswith("self_attn.q_proj.weight"):
            data = permute_qk(data, c.num_heads)
        elif hf.endswith("self_attn.k_proj.weight"):
            data = permute_qk(data, c.num_kv_heads)
        name_ = gguf_name(hf)
        if data.ndim == 1:
            w.add_tensor(name_, data)
            continue
        kind = {"token_embd.weight": embed_type, "output.weight": gguf.GGMLQuantizationType.Q8_0}.get(name_, block_type)
        if data.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:
            raise QuantizeError(f"{hf} has {data.shape[-1]} columns, not a multiple of the {kind.name} block size")
        w.add_tensor(name_, gguf.quants.quantize(data, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tensor_order(hf: str) -> tuple[int, int, str]:
    parts = hf.split(".")
    if parts[:2] == ["model", "layers"]:
        return (1, int(parts[2]), hf)
    return (0 if "embed" in hf else 2, 0, hf)


def _add_tokenizer(w: Any, meta: dict[str, Any]) -> None:
    """Copy the teacher's tokenizer metadata: same vocab, merges, special ids and chat template."""
    try:
        w.add_tokenizer_model(meta["tokenizer.ggml.model"])
        if "tokenizer.ggml.pre" in meta:
            w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
        w.add_token_list(meta["tokenizer.ggml.tokens"])
        w.add_token_types(meta["tokenizer.ggml.token_type"])
        if meta.get("tokenizer.ggml.merges"):
            w.add_token_merges(meta["tokenizer.ggml.merges"])
    except KeyError as e:
        raise QuantizeError(f"tokenizer metadata lacks {e}") from None
    ids = {"bos_token_id": w.add_bos_token_id, "eos_token_id": w.add_eos_token_id,
           "unknown_token_id": w.add_unk_token_id, "padding_token_id": w.add_pad_token_id,
           "eot_token_id": w.add_eot_token_id}
    for key, add in ids.items():
        if meta.get(f"tokenizer.ggml.{key}") is not None:
            add(int(meta[f"tokenizer.ggml.{key}"]))
    for key, add in {"add_bos_token": w.add_add_bos_token, "add_eos_token": w.add_add_eos_token,
                     "add_space_prefix": w.add_add_space_prefix}.items():
        if meta.get(f"tokenizer.ggml.{key}") is not None:
            add(bool(meta[f"tokenizer.ggml.{key}"]))
    if meta.get("tokenizer.chat_template"):
        w.add_chat_template(meta["tokenizer.chat_template"])


def eval_sequences(folder: str | Path, corpus_path: str | Path | None = None, n: int = 16) -> list[list[int]]:
    """Token sequences to compare on: a corpus (e.g. distill's eval.jsonl), else sensor prompts + general text."""
    from apiary.cloud.engine.tokenizer import Tokenizer
    from apiary.deploy import corpus
    from apiary.deploy.student import read_tokenizer_metadata

    meta = read_tokenizer_metadata(folder)
    tok = Tokenizer.from_gguf_metadata(meta)
    if corpus_path is not None:
        texts = [s.text for s in corpus.load_corpus(corpus_path)[:n]]
    else:
        texts = [tok.apply_chat_template(m) for m, _ in corpus.sensor_situations(max(1, n // 2), seed=4242)]
        texts += [s.text for s in corpus.general_samples()[: max(1, n - len(texts))]]
    return [tok.encode(t)[:2048] for t in texts]


def quantize(folder: str | Path, out: str | Path, qtype: str = "q4_0", *, corpus_path: str | Path | None = None,
             n_eval: int = 16, threads: int = 2, embed_qtype: str = "q8_0") -> QuantizeReport:
    """Export, then measure the GGUF (llama.cpp) against the folder's float32 model (torch)."""
    from apiary.deploy.agreement import agreement, llama_top1, torch_top1
    from apiary.deploy.student import load_model

    path = export_gguf(folder, out, qtype, embed_qtype=embed_qtype)
    fp32 = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
    report = QuantizeReport(path=path, qtype=qtype, size_bytes=path.stat().st_size, fp32_bytes=fp32,
                            embed_qtype=embed_qtype, prompt_style=folder_prompt_style(folder))
    if n_eval <= 0:
        return report
    seqs = eval_sequences(folder, corpus_path, n_eval)
    model, _ = load_model(folder)
    result = agreement(torch_top1(model, seqs), llama_top1(path, seqs, threads=threads))
    return replace(report, top1_agreement=result.rate, positions=result.positions)
