"""apiary.shared.confidence: the one quantile rule both tiers score their answers with (pure functions)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from apiary.shared.confidence import MIN_LOGPROB, measure, token_mask, topk_entropy

TEXT = '{"explanation": "Hot.", "assessment": "heat_stress", "urgency": "high", "action": "Shade"}'
PIECES = ['{"explanation": "', "Hot.", '", "assessment": "', "heat", "_stress", '", "urgency": "', "high",
          '", "action": "', "Shade", '"}']
OFFSETS = np.cumsum([0] + [len(p.encode()) for p in PIECES[:-1]]).tolist()


def test_mask_covers_the_decision_values() -> None:
    assert "".join(PIECES) == TEXT
    assert np.flatnonzero(token_mask(TEXT, OFFSETS)).tolist() == [3, 4, 6]


def test_entropy_is_optional_and_numbers_stay_finite() -> None:
    lps = [0.0, -2.0, 0.0, -0.5, -math.inf, 0.0, -0.2, 0.0, -1.0, 0.0]
    c = measure(TEXT, OFFSETS, lps)
    assert c.entropy is None and "entropy_p90" not in c.quantiles and "raw_p10" not in c.quantiles
    assert c.n_tokens == 3 and c.score == pytest.approx(np.quantile([-0.5, MIN_LOGPROB, -0.2], 0.1))
    assert all(math.isfinite(v) for v in c.quantiles.values())
    with pytest.raises(ValueError, match="one of each per token"):
        measure(TEXT, OFFSETS[:-1], lps)


def test_topk_entropy_renormalises_and_drops_forbidden_tokens() -> None:
    assert topk_entropy([math.log(0.5), math.log(0.5), -math.inf]) == pytest.approx(math.log(2))
    assert topk_entropy([math.log(0.3), math.log(0.3)]) == pytest.approx(math.log(2))  # renormalised top-k
    assert topk_entropy([0.0]) == 0.0 and topk_entropy([]) == 0.0
