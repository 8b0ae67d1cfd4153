"""How sure a model was of its JSON action: low quantiles of per-token logprob and entropy, not the mean.

One rule for both tiers, so their answers are comparable: the edge (llama.cpp) and the cloud
(own engine) each turn their decode into per-token numbers and call :func:`measure`.

A mean logprob is length-biased: a long fluent explanation drowns one unsure
decision token, and a short answer looks surer than it is. What matters for
escalation is the *weakest* step of the decision, so the score is a low quantile
(default p10, ~ the minimum for short spans) of the tokens that carry the decision:
the values of ``assessment`` and ``urgency``. The free-text fields are reported but
not scored by default (their tokens are uncertain by nature; that is not doubt about
the hive).

The logprob used is the *choice* logprob: the chosen token's probability among the
tokens the grammar allowed at that step, i.e. how sure the model was between the
answers it could legally give. Inputs are pure data: the answer's text, the byte offset
of each token in ``text.encode()``, the choice logprobs and (optionally) the entropies of
the allowed-token distributions.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

DECISION_FIELDS = ("assessment", "urgency")
MIN_LOGPROB = -100.0  # a token the model gave no probability at all; keeps every number finite on the wire


@dataclass(frozen=True, slots=True)
class Confidence:
    """The policy's inputs, plus a summary worth shipping across tiers and to the logs."""

    score: float | None  # quantile of choice logprobs over the span; None when the span is empty
    entropy: float | None  # (1 - quantile) quantile of entropies over the span, nats; None without entropies
    span: str  # "decision" or "all"
    n_tokens: int
    quantiles: dict[str, float] = field(default_factory=dict)


def field_value_spans(text: bytes, fields: tuple[str, ...] = DECISION_FIELDS) -> list[tuple[int, int]]:
    """Byte ranges of the string values of ``fields`` in a JSON object's text (quotes excluded)."""
    spans = []
    for name in fields:
        m = re.search(rb'"' + re.escape(name.encode()) + rb'"\s*:\s*"([^"]*)"', text)
        if m:
            spans.append((m.start(1), m.end(1)))
    return spans


def token_mask(text: str, offsets: Sequence[int], fields: tuple[str, ...] = DECISION_FIELDS) -> np.ndarray:
    """True for each token (starting at byte ``offsets[i]`` of ``text.encode()``) that overlaps a value of ``fields``."""
    data = text.encode("utf-8")
    n = len(offsets)
    starts = np.asarray(offsets, dtype=np.int64)
    ends = np.append(starts[1:], len(data)) if n else starts
    mask = np.zeros(n, dtype=bool)
    for lo, hi in field_value_spans(data, fields):
        mask |= (starts < hi) & (ends > lo)
    return mask


def topk_entropy(logprobs: Sequence[float]) -> float:
    """Entropy (nats) of the distribution renormalised over the given alternatives' logprobs
    (non-finite ones, i.e. tokens the grammar forbade, dropped): a top-k estimate of the full
    distribution's entropy, exact when the alternatives hold all of its mass."""
    lp = np.asarray([v for v in logprobs if math.isfinite(v)], dtype=np.float64)
    if lp.size == 0:
        return 0.0
    shifted = lp - lp.max()
    p = np.exp(shifted) / np.exp(shifted).sum()
    return float(-(p * np.log(np.maximum(p, 1e-300))).sum())


def measure(text: str, offsets: Sequence[int], choice_logprobs: Sequence[float],
            entropies: Sequence[float] | None = None, *, raw_logprobs: Sequence[float] | None = None,
            quantile: float = 0.1, span: str = "decision") -> Confidence:
    """Score an answer: quantile ``quantile`` of choice logprobs over the span, and entropy at ``1 - quantile``.

    ``span``: "decision" (the tokens of the assessment and urgency values) or "all" (every token).
    ``raw_logprobs`` (the model's logprobs under its full, unconstrained distribution) only add
    ``raw_*`` entries to the quantiles; ``entropies`` None leaves the entropy out.
    """
    lp = np.maximum(np.asarray(choice_logprobs, dtype=np.float64), MIN_LOGPROB)
    if len(offsets) != lp.size or (entropies is not None and len(entropies) != lp.size):
        raise ValueError(f"{len(offsets)} offsets, {lp.size} logprobs and "
                         f"{'no' if entropies is None else len(entropies)} entropies: one of each per token")
    ent = None if entropies is None else np.asarray(entropies, dtype=np.float64)
    mask = token_mask(text, offsets) if span == "decision" else np.ones(lp.size, dtype=bool)
    q = {"n_all": float(lp.size)}
    if lp.size:
        q.update(all_min=float(lp.min()), all_p10=float(np.quantile(lp, 0.1)), all_mean=float(lp.mean()))
    if raw_logprobs is not None and len(raw_logprobs):
        raw = np.maximum(np.asarray(raw_logprobs, dtype=np.float64), MIN_LOGPROB)
        q.update(raw_p10=float(np.quantile(raw, 0.1)), raw_mean=float(raw.mean()))
    if not mask.any():
        return Confidence(score=None, entropy=None, span=span, n_tokens=0, quantiles=_rounded(q))
    sel = lp[mask]
    score = float(np.quantile(sel, quantile))
    q.update(min=float(sel.min()), p10=float(np.quantile(sel, 0.1)), p50=float(np.quantile(sel, 0.5)),
             mean=float(sel.mean()))
    entropy = None
    if ent is not None:
        sel_ent = ent[mask]
        entropy = float(np.quantile(sel_ent, 1.0 - quantile))
        q.update(entropy_max=float(sel_ent.max()), entropy_p90=float(np.quantile(sel_ent, 0.9)))
    return Confidence(score=score, entropy=entropy, span=span, n_tokens=int(mask.sum()), quantiles=_rounded(q))


def _rounded(q: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in q.items() if math.isfinite(v)}
