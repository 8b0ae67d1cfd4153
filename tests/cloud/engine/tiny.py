"""Tiny random-weight checkpoints in Hugging Face layout (config.json + safetensors + tokenizer.json).

They load through the same path as real checkpoints and run in milliseconds, so scheduler,
preemption and API tests exercise the whole engine. Weights are drawn with a large scale so
logits are far from ties and greedy outputs are stable across batch compositions.
"""
from __future__ import annotations

import json
from pathlib import Path

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = [
    "The hive temperature rose to 35 degrees while the bees fanned their wings.",
    "Queen present, brood pattern solid, honey stores adequate for winter.",
    "Sensor 7 reports humidity 62% and a weight gain of 1.2 kg since Monday.",
    "Varroa count low; no swarming signs; entrance reducer installed.",
    "def read_sensor(port):\n    return port.read(64)\n",
    "Bienen sammeln Nektar. Les abeilles dansent. ミツバチ 🐝 are busy!",
] * 4
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(folder: Path, vocab_size: int = 384) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML}))


def make_checkpoint(folder: Path, arch: str = "llama", *, layers: int = 2, hidden: int = 64, heads: int = 4,
                    kv_heads: int = 2, intermediate: int = 128, max_positions: int = 1024, tie: bool = False,
                    rope_scaling: dict | None = None, seed: int = 0, scale: float = 0.15) -> Path:
    """Write a random checkpoint of ``arch`` ("llama" or "qwen2") to ``folder`` and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    make_tokenizer(folder)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                  rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=None, eos_token_id=2, pad_token_id=None)
    if arch == "llama":
        cfg = LlamaConfig(**common, rope_theta=10000.0, rope_scaling=rope_scaling)
        model_cls = LlamaForCausalLM
    elif arch == "qwen2":
        cfg = Qwen2Config(**common, rope_theta=1000000.0, use_sliding_window=False)
        model_cls = Qwen2ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = model_cls(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, scale if p.dim() > 1 else 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder
