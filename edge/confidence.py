"""How sure the local model was: low quantiles of per-token logprob and entropy, not the mean.

A mean logprob is length-biased: a long fluent explanation drowns one unsure
decision token, and a short answer looks surer than it is. What matters for
escalation is the *weakest* step of the decision, so the score is a low quantile
(default p10, ~ the minimum for short spans) of the tokens that carry the decision:
the values of ``assessment`` and ``urgency``. The free-text fields are reported but
not scored by default (their tokens are uncertain by nature; that is not doubt about
the hive).

The logprob used is the *choice* logprob: the chosen token's probability among the
tokens the grammar allowed at that step, i.e. how sure the model was between the
answers it could legally give.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from edge.model import Generation

DECISION_FIELDS = ("assessment", "urgency")


@dataclass(frozen=True, slots=True)
class Confidence:
    """The policy's inputs, plus a summary worth shipping to the cloud and the logs."""

    score: float | None  # quantile of choice logprobs over the span; None when the span is empty
    entropy: float | None  # (1 - quantile) quantile of entropies over the span, nats
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


def token_mask(gen: Generation, fields: tuple[str, ...] = DECISION_FIELDS) -> np.ndarray:
    """True for each generated token that overlaps a value of ``fields``."""
    data = gen.text.encode("utf-8")
    n = len(gen.token_ids)
    starts = np.asarray(gen.offsets, dtype=np.int64)
    ends = np.append(starts[1:], len(data)) if n else starts
    mask = np.zeros(n, dtype=bool)
    for lo, hi in field_value_spans(data, fields):
        mask |= (starts < hi) & (ends > lo)
    return mask


def measure(gen: Generation, *, quantile: float = 0.1, span: str = "decision") -> Confidence:
    """Score ``gen``: quantile ``quantile`` of choice logprobs over the span, and entropy at ``1 - quantile``."""
    lp = np.asarray(gen.choice_logprobs, dtype=np.float64)
    ent = np.asarray(gen.entropies, dtype=np.float64)
    raw = np.asarray(gen.logprobs, dtype=np.float64)
    mask = token_mask(gen) if span == "decision" else np.ones(lp.size, dtype=bool)
    q = {"n_all": float(lp.size)}
    if raw.size:
        q.update(raw_p10=float(np.quantile(raw, 0.1)), raw_mean=float(raw.mean()),
                 all_min=float(lp.min()), all_p10=float(np.quantile(lp, 0.1)), all_mean=float(lp.mean()))
    if not mask.any():
        return Confidence(score=None, entropy=None, span=span, n_tokens=0, quantiles=q)
    sel, sel_ent = lp[mask], ent[mask]
    score = float(np.quantile(sel, quantile))
    entropy = float(np.quantile(sel_ent, 1.0 - quantile))
    q.update(min=float(sel.min()), p10=float(np.quantile(sel, 0.1)), p50=float(np.quantile(sel, 0.5)),
             mean=float(sel.mean()), entropy_max=float(sel_ent.max()), entropy_p90=float(np.quantile(sel_ent, 0.9)))
    return Confidence(score=score, entropy=entropy, span=span, n_tokens=int(mask.sum()),
                      quantiles={k: round(v, 4) for k, v in q.items()})
