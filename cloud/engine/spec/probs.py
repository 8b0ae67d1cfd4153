"""The distribution a request samples from: temperature, top-k and top-p applied to logits, as probabilities.

Lossless speculation needs the target's and the draft's distributions under the *same*
transforms, and the verifier needs them as explicit probabilities (the engine's sampler
only draws from them). The masking matches ``cloud.engine.sampler``: top-k keeps the k
largest, top-p keeps a token while the mass before it is at most top_p.
"""
from __future__ import annotations

import torch

from cloud.engine.sampling_params import SamplingParams


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities ``[N, V]`` (float32, vocab order) for the sampled (non-greedy) rows ``logits[N, V]``."""
    logits = logits.float()
    vocab = logits.shape[-1]
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=logits.device)
    logits = logits / temps[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        ranked, index = logits.sort(dim=-1, descending=True)
        ks = torch.tensor([p.top_k or vocab for p in params], device=logits.device)
        ranks = torch.arange(vocab, device=logits.device)
        ranked = ranked.masked_fill(ranks[None, :] >= ks[:, None], float("-inf"))
        probs = ranked.softmax(dim=-1)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=logits.device)
        ranked = ranked.masked_fill(probs.cumsum(dim=-1) - probs > top_p[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(1, index, ranked)
    return logits.softmax(dim=-1)


def draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of ``probs`` ``[N, V]``, row i with its own generator (exponential race: exact)."""
    noise = torch.empty(probs.shape, dtype=torch.float32)
    for row, g in enumerate(generators):
        noise[row].exponential_(generator=g)
    return (probs.float().cpu() / noise.clamp_(min=1e-30)).argmax(dim=-1).to(probs.device)
