"""Confidence from per-token statistics: decision tokens only, low quantiles rather than the mean."""
from __future__ import annotations

import numpy as np
import pytest

from apiary.edge.confidence import field_value_spans, measure, token_mask
from apiary.edge.model import Generation


def generation(pieces: list[tuple[str, float, float]]) -> Generation:
    """A fake generation from (token text, choice logprob, entropy) triples."""
    offsets, pos = [], 0
    for text, _, _ in pieces:
        offsets.append(pos)
        pos += len(text.encode())
    return Generation(text="".join(p[0] for p in pieces), token_ids=list(range(len(pieces))),
                      logprobs=[p[1] - 1.0 for p in pieces], choice_logprobs=[p[1] for p in pieces],
                      entropies=[p[2] for p in pieces], offsets=offsets, finished=True)


def answer(assessment_lp: float, explanation: list[float]) -> Generation:
    pieces = [('{"assessment": "', 0.0, 0.0), ("heat", assessment_lp, 1.0), ("_stress", 0.0, 0.0),
              ('", "action": "', 0.0, 0.0), ("Shade", -0.3, 0.8), ('", "urgency": "', 0.0, 0.0), ("high", -0.1, 0.3),
              ('", "explanation": "', 0.0, 0.0)]
    pieces += [(f" w{i}", lp, 2.0) for i, lp in enumerate(explanation)]
    pieces += [('"}', 0.0, 0.0)]
    return generation(pieces)


def test_spans_find_values() -> None:
    text = b'{"assessment": "robbing", "action": "x", "urgency": "low", "explanation": ""}'
    spans = field_value_spans(text)
    assert [text[a:b] for a, b in spans] == [b"robbing", b"low"]


def test_mask_selects_decision_tokens() -> None:
    gen = answer(-0.9, [-2.0, -2.5])
    assert np.flatnonzero(token_mask(gen)).tolist() == [1, 2, 6]  # "heat", "_stress", "high"


def test_score_is_a_low_quantile_over_decision_tokens() -> None:
    gen = answer(-0.9, [-2.0, -2.5])
    c = measure(gen, quantile=0.1, span="decision")
    assert c.n_tokens == 3
    assert c.score == pytest.approx(np.quantile([-0.9, 0.0, -0.1], 0.1))
    assert c.entropy == pytest.approx(np.quantile([1.0, 0.0, 0.3], 0.9))
    assert c.quantiles["min"] == pytest.approx(-0.9)


def test_mean_is_length_biased_quantile_is_not() -> None:
    """The same unsure decision (-1.2) looks surer in the mean as the fluent explanation grows."""
    short = answer(-1.2, [-0.05] * 2)
    long = answer(-1.2, [-0.05] * 60)
    assert measure(long, span="all").quantiles["all_mean"] > measure(short, span="all").quantiles["all_mean"] + 0.08
    assert measure(long).score == pytest.approx(measure(short).score)


def test_all_span_and_empty_span() -> None:
    gen = answer(-0.9, [-2.0, -2.5])
    assert measure(gen, span="all").n_tokens == len(gen.token_ids)
    broken = generation([("{", -0.1, 0.1), ('"assess', -0.2, 0.1)])  # cut off before any value
    c = measure(broken)
    assert c.score is None and c.n_tokens == 0
