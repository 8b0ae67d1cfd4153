"""Flat model inputs for a list of (new tokens, start position, block table) entries over a paged cache.

The draft model steps through batches whose tokens are not (yet) part of any sequence, so it
builds its inputs from explicit token lists. Single-token entries go first (served by the
decode kernel), longer ones after (the varlen prefill kernel), as ``AttentionMetadata`` expects.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from apiary.cloud.engine.model import AttentionMetadata, paged_layout


@dataclass(slots=True)
class Entry:
    token_ids: list[int]  # the new tokens to run
    start: int  # position of the first one (= tokens already in the cache)
    block_table: list[int]  # must cover positions < start + len(token_ids)


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    last_rows: list[int]  # per entry, in the caller's order: the row of its last token


def build_inputs(entries: list[Entry], block_size: int, device: torch.device) -> StepInputs:
    order = sorted(range(len(entries)), key=lambda i: len(entries[i].token_ids) > 1)  # stable: decodes first
    seqs = [entries[i] for i in order]
    counts = np.asarray([len(e.token_ids) for e in seqs], dtype=np.int64)
    starts = np.asarray([e.start for e in seqs], dtype=np.int64)
    positions, meta, cu = paged_layout(starts, counts, [e.block_table for e in seqs], block_size,
                                       int((counts == 1).sum()), device)
    last_rows = [0] * len(entries)
    for pos, i in enumerate(order):
        last_rows[i] = int(cu[pos + 1]) - 1
    input_ids = np.fromiter((tok for e in seqs for tok in e.token_ids), dtype=np.int64, count=int(cu[-1]))
    return StepInputs(torch.from_numpy(input_ids).to(device), positions, meta, last_rows)
