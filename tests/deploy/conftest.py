"""Deploy fixtures: the teacher's tokenizer metadata (read once) and tiny random Llama models that use it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def teacher_tokenizer_meta(gguf_path: Path) -> dict:
    import gguf

    from apiary.cloud.engine.loader import read_gguf_metadata
    from apiary.deploy.student import tokenizer_metadata

    return tokenizer_metadata(read_gguf_metadata(gguf.GGUFReader(gguf_path)))


def tiny_config(**over):
    """A random Llama small enough for unit tests, with the real 49152-token vocabulary."""
    from apiary.cloud.engine.config import ModelConfig

    base = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, rms_norm_eps=1e-5, rope_theta=100000.0, max_position=512, tie_word_embeddings=True)
    return ModelConfig(**{**base, **over})


def tiny_model(seed: int = 0, **over):
    from apiary.deploy.student import LlamaForTraining

    torch.manual_seed(seed)
    model = LlamaForTraining(tiny_config(**over))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.2 if "embed" in name else 0.08)
    return model.eval()
