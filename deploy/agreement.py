"""Teacher-forced top-1 agreement: how often two models pick the same next token along the same text.

The fair way to compare runtimes and model sizes: exact strings diverge after the first
near-tie, while per-position agreement on a fixed token sequence does not. Positions
can be restricted to a tail (e.g. only the answer after the prompt).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class Agreement:
    matches: int
    positions: int

    @property
    def rate(self) -> float:
        return self.matches / self.positions if self.positions else float("nan")


@torch.no_grad()
def torch_top1(model: torch.nn.Module, sequences: Sequence[Sequence[int]], batch_size: int = 8) -> list[np.ndarray]:
    """Argmax next token at every position of every sequence (right-padded batches, causal so pads never leak)."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    results: dict[int, np.ndarray] = {}
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        width = max(len(sequences[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, :len(sequences[i])] = torch.tensor(sequences[i])
        top = model(ids).argmax(-1).numpy()
        for row, i in enumerate(idx):
            results[i] = top[row, :len(sequences[i])]
    return [results[i] for i in range(len(sequences))]


def llama_top1(gguf_path: str | Path, sequences: Sequence[Sequence[int]], threads: int = 2) -> list[np.ndarray]:
    """The same, from llama.cpp on a GGUF file (all-position logits of one evaluation per sequence)."""
    from llama_cpp import Llama

    n_ctx = max(len(s) for s in sequences) + 8
    llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=min(n_ctx, 512), logits_all=True,
                n_threads=threads, n_threads_batch=threads, verbose=False)
    try:
        out = []
        for seq in sequences:
            llm.reset()
            llm.eval(list(seq))
            out.append(np.asarray(llm.scores[:len(seq)]).argmax(-1))
        return out
    finally:
        llm.close()


def agreement(a: Sequence[np.ndarray], b: Sequence[np.ndarray], starts: Sequence[int] | None = None) -> Agreement:
    """Positions where ``a`` and ``b`` agree, counting from ``starts[i]`` in sequence ``i`` (0 by default)."""
    matches = positions = 0
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        s = starts[i] if starts is not None else 0
        matches += int((x[s:] == y[s:]).sum())
        positions += max(0, len(x) - s)
    return Agreement(matches, positions)
