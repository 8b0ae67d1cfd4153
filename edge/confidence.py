"""How sure the local model was: the shared rule (``apiary.shared.confidence``) applied to a llama.cpp generation.

The rule itself (a low quantile, default p10, of the *choice* logprobs over the tokens
of the decision fields' values, plus the entropy at the opposite quantile) lives in
:mod:`apiary.shared.confidence`, so the cloud scores its answers the same way. Here a
:class:`~edge.model.Generation` supplies its inputs: text, per-token byte offsets, choice
logprobs, entropies of the allowed candidates (over the top-k the decoder checks) and the
raw full-distribution logprobs.
"""
from __future__ import annotations

import numpy as np

from apiary.edge.model import Generation
from apiary.shared import confidence as shared_confidence
from apiary.shared.confidence import DECISION_FIELDS, Confidence, field_value_spans

__all__ = ["DECISION_FIELDS", "Confidence", "field_value_spans", "measure", "token_mask"]


def token_mask(gen: Generation, fields: tuple[str, ...] = DECISION_FIELDS) -> np.ndarray:
    """True for each generated token that overlaps a value of ``fields``."""
    return shared_confidence.token_mask(gen.text, gen.offsets, fields)


def measure(gen: Generation, *, quantile: float = 0.1, span: str = "decision") -> Confidence:
    """Score ``gen``: quantile ``quantile`` of choice logprobs over the span, and entropy at ``1 - quantile``."""
    return shared_confidence.measure(gen.text, gen.offsets, gen.choice_logprobs, gen.entropies,
                                     raw_logprobs=gen.logprobs, quantile=quantile, span=span)
