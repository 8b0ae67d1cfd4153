"""Exact logits where they can win: an approximate LM head ranks the vocabulary, and each row's top
candidates are computed again from the head's own weight.

Why: the LM head of a small model is a large matmul (SmolLM2: 49,152 x 576, 56.6 MB in bf16) that every
decode step runs for every row. oneDNN's bf16 GEMM took 3.2-3.8 ms for 14 rows; the grouped int8 kernel
(``apiary.kernels.cpu_int8_gemm``) 1.2-1.5 ms. But int8 logits are off by up to ~0.05, and taken as they
are they moved the engine's teacher-forced agreement with float32 from 98.6% to 97.2% (docs/engine.md).
A token can only be chosen, or reported among the top logprobs, if its logit is near the row's top: so
``refine`` takes each row's ``k`` largest approximate logits, and, for a row under a grammar, the ``k``
largest among the tokens the grammar allows (its allowed tokens can all lie far below the row's top), and
replaces them by the dot product with the head's weight in float32 (the plain bf16 head rounds its
output to bf16, a step of 0.016 at logits of 2-4; these are not rounded). The other logits keep the
approximation: they move a softmax's normaliser far less than that rounding does.

The selection is one pass per row that keeps the ``k`` best seen so far and their minimum, skipping
chunks of 16 whose maximum does not beat it (most of the vocabulary); rows are split over threads.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from apiary.kernels.cpu_attention import _as_f32
from apiary.kernels.cpu_layers import _np

CANDIDATES = 32  # per row and selection; the int8 head's error (~0.05) is far below the gap to the 32nd
CHUNK = 16  # logits per maximum that ``_select`` tests before it looks at them one by one
# numba inlines a function with its caller's flags, so every function here with float math has these: fast
# math that lets LLVM vectorise the chunks' maxima and the dot products, but not "ninf" (the selection compares
# with -inf)
FAST = {"nnan", "nsz", "arcp", "contract", "reassoc", "afn"}


@njit(fastmath=False, cache=True, boundscheck=False, inline="always")
def _allows(bitmask, i, t):  # type: ignore[no-untyped-def]
    """Whether row ``i``'s packed bitmask (bit j of word w: token 32w + j) allows token ``t``."""
    word = t >> 5
    return word < bitmask.shape[1] and (bitmask[i, word] >> (t & 31)) & 1 == 1


@njit(fastmath=FAST, cache=True, boundscheck=False, inline="always")
def _chunk_max(logits, i, start, stop):  # type: ignore[no-untyped-def]
    """The largest of ``logits[i, start:stop]`` (a vector reduction)."""
    top = logits[i, start]
    for t in range(start + 1, stop):
        top = max(top, logits[i, t])
    return top


@njit(fastmath=FAST, cache=True, boundscheck=False, inline="always")
def _select(logits, i, bitmask, masked, k, chosen, at):  # type: ignore[no-untyped-def]
    """The ``k`` largest logits of row ``i`` (only among the tokens ``bitmask`` allows, when ``masked``): their
    tokens into ``chosen[i, at : at + k]``, -1 where fewer than ``k`` are finite and allowed. A chunk of
    ``CHUNK`` logits none of which beats the ``k``-th best so far is passed over on its maximum alone."""
    best = np.full(k, -np.inf, np.float32)
    for j in range(k):
        chosen[i, at + j] = -1
    low, low_at = -np.inf, 0
    vocab = logits.shape[1]
    for start in range(0, vocab, CHUNK):
        stop = min(start + CHUNK, vocab)
        if not _chunk_max(logits, i, start, stop) > low:
            continue
        for t in range(start, stop):
            v = logits[i, t]
            if v > low and (not masked or _allows(bitmask, i, t)):
                best[low_at] = v
                chosen[i, at + low_at] = t
                low, low_at = best[0], 0
                for j in range(1, k):
                    if best[j] < low:
                        low, low_at = best[j], j


@njit(fastmath=FAST, cache=True, boundscheck=False, inline="always")
def _dot(x, i, weight, t):  # type: ignore[no-untyped-def]
    """``x[i] . weight[t]``, widened to float32 and summed in float32 (vectorised: the order is LLVM's)."""
    total = np.float32(0.0)
    for d in range(x.shape[1]):
        total += _as_f32(x[i, d]) * _as_f32(weight[t, d])
    return total


@njit(parallel=True, fastmath=FAST, cache=True, boundscheck=False, nogil=True)
def _refine(x, weight, logits, bitmask, masked, k, chosen):  # type: ignore[no-untyped-def]
    """``logits[i, t] = x[i] . weight[t]`` (in float32) for row ``i``'s candidates, chosen by ``_select``:
    ``chosen [rows, 2k]`` holds them afterwards."""
    for i in prange(logits.shape[0]):
        _select(logits, i, bitmask, False, k, chosen, 0)
        if masked[i]:
            _select(logits, i, bitmask, True, k, chosen, k)
        else:
            for j in range(k, 2 * k):
                chosen[i, j] = -1
        for j in range(2 * k):
            t = chosen[i, j]
            if t < 0:
                continue
            logits[i, t] = _dot(x, i, weight, t)


def refine(x: torch.Tensor, weight: torch.Tensor, logits: torch.Tensor, bitmask: torch.Tensor | None,
           k: int = CANDIDATES) -> None:
    """Refine ``logits [rows, V]`` (float32, in place) from ``x [rows, H]`` and ``weight [V, H]`` (contiguous
    float32 or bf16), over each row's ``k`` best (and, where ``bitmask [rows, W]`` (int32) is not all ones, its
    ``k`` best allowed). Callers check shapes and dtypes (``apiary.kernels.ops.refine_logits``)."""
    rows = logits.shape[0]
    k = min(k, logits.shape[1])
    if bitmask is None:
        words, masked = np.full((rows, 1), -1, np.int32), np.zeros(rows, np.bool_)
    else:
        words = bitmask.contiguous().numpy()
        masked = (words != -1).any(axis=1) | (words.shape[1] * 32 < logits.shape[1])
    chosen = np.empty((rows, 2 * k), np.int64)
    _refine(_np(x), _np(weight), logits.numpy(), words, masked, k, chosen)
