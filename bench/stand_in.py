"""Write a same-shape stand-in of a model (config + tokenizer; random weights where it runs) for hosts that cannot have it.

The GPU machine lent to this project reaches no registry, and what travels to it is capped (64 MiB with
the repository), so the 98 MB SmolLM2 file cannot go along. Decode throughput with ``ignore_eos`` depends
on the shapes alone (layers, widths, heads, vocabulary), not on the weights' values, so the engine benchmark
there runs a checkpoint of the same config with seeded random weights, made on the spot, and says so in
its record. Accuracy is never measured on a stand-in.
"""
from __future__ import annotations

import json
from pathlib import Path

import typer

STAND_IN_NOTE = "stand-in: the model's config and tokenizer, seeded random weights (speed only)"


def write_config(source: Path, out: Path) -> dict:
    """``out``/config.json, tokenizer.json and tokenizer_config.json of the model at ``source`` (GGUF or HF)."""
    from apiary.cloud.engine.loader import load_checkpoint
    from apiary.cloud.engine.tokenizer import load_tokenizer

    checkpoint = load_checkpoint(source)
    c = checkpoint.config
    if c.architecture != "llama" or c.attention_bias or c.sliding_window:
        raise typer.BadParameter(f"{source}: a stand-in is written for plain Llama configs, not {c.architecture}")
    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
              "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
              "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
              "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
              "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position,
              "tie_word_embeddings": c.tie_word_embeddings, "stand_in_of": source.name, "note": STAND_IN_NOTE}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer = load_tokenizer(source, checkpoint.metadata or None)
    tokenizer._tok.save(str(out / "tokenizer.json"))
    name = tokenizer._tok.id_to_token
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": name(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else None,
        "eos_token": name(tokenizer.eos_token_id) if tokenizer.eos_token_id is not None else None,
        "add_bos_token": tokenizer.add_bos, "chat_template": tokenizer.chat_template}))
    return config


def fill_weights(folder: Path, seed: int = 0) -> Path:
    """Seeded random bf16 weights of ``folder``/config.json's shapes, unless the folder already has weights."""
    import torch
    from safetensors.torch import save_file

    target = folder / "model.safetensors"
    if any(folder.glob("*.safetensors")):
        return target
    cfg = json.loads((folder / "config.json").read_text())
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    weights = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": torch.ones(hidden,
                                                                                                 dtype=torch.bfloat16)}
    if not cfg.get("tie_word_embeddings"):
        weights["lm_head.weight"] = rand(vocab, hidden)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                    p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                    p + "self_attn.q_proj.weight": rand(q, hidden), p + "self_attn.k_proj.weight": rand(kv, hidden),
                    p + "self_attn.v_proj.weight": rand(kv, hidden), p + "self_attn.o_proj.weight": rand(hidden, q),
                    p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
                    p + "mlp.down_proj.weight": rand(hidden, inter)}
    save_file(weights, str(target))
    return target


def command(
    out: Path = typer.Argument(..., help="folder to write config.json and the tokenizer files into"),
    model: str = typer.Option("", help="the model it stands in for (GGUF/HF path); default: the cached "
                                       "smollm2-135m-q4 asset"),
    weights: bool = typer.Option(False, help="also write the random weights (else the host it runs on does: "
                                             "apiary bench gpu --stand-in)"),
) -> None:
    if not model:
        from apiary.shared import assets

        model = str(assets.ensure("smollm2-135m-q4"))
    from apiary.cloud.engine.errors import EngineError

    try:
        config = write_config(Path(model), out)
    except EngineError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if weights:
        fill_weights(out)
    size = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    typer.echo(f"stand-in of {Path(model).name} in {out} ({size:.1f} MB): {config['num_hidden_layers']} layers, "
               f"hidden {config['hidden_size']}, vocab {config['vocab_size']}; {STAND_IN_NOTE}")
