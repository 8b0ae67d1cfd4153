"""Batched token selection: greedy, temperature, top-k, top-p, with a per-request seeded generator.

Sampling uses the exponential-race trick (argmax of p / E with E ~ Exp(1)), which draws from p
exactly; each request's noise comes from its own generator, so a seeded request samples the
same tokens whatever else shares its batch.
"""
from __future__ import annotations

import torch

from cloud.engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence], default_generator: torch.Generator) -> list[int]:
    """One token id per row of ``logits`` ``[B, V]`` (float32) for the matching ``seqs``."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if rows:
        tokens[rows] = _sample_rows(logits[rows], [seqs[i] for i in rows], default_generator)
    return tokens.tolist()


def _sample_rows(logits: torch.Tensor, seqs: list[Sequence], default_generator: torch.Generator) -> torch.Tensor:
    vocab = logits.shape[-1]
    temps = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32, device=logits.device)
    logits = logits / temps[:, None]
    index = None
    if any(s.params.top_k > 0 or s.params.top_p < 1.0 for s in seqs):
        logits, index = logits.sort(dim=-1, descending=True)
        ks = torch.tensor([s.params.top_k or vocab for s in seqs], device=logits.device)
        ranks = torch.arange(vocab, device=logits.device)
        logits = logits.masked_fill(ranks[None, :] >= ks[:, None], float("-inf"))
        probs = logits.softmax(dim=-1)
        top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32, device=logits.device)
        outside = probs.cumsum(dim=-1) - probs > top_p[:, None]  # mass before this token already exceeds top_p
        logits = logits.masked_fill(outside, float("-inf"))
    probs = logits.softmax(dim=-1).cpu()
    noise = torch.empty_like(probs)
    for row, seq in enumerate(seqs):
        noise[row].exponential_(generator=seq.generator or default_generator)
    choice = (probs / noise.clamp_(min=1e-30)).argmax(dim=-1).to(logits.device)
    return choice if index is None else index.gather(1, choice[:, None])[:, 0]
