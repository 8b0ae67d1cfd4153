"""Building sequences by hand for block-manager and scheduler unit tests (no model involved)."""
from __future__ import annotations

import itertools

from apiary.cloud.engine.outputs import RequestMetrics
from apiary.cloud.engine.sampling_params import SamplingParams
from apiary.cloud.engine.sequence import Sequence

_arrivals = itertools.count()


def make_seq(tokens: list[int] | int, *, priority: int = 0, max_tokens: int = 16, name: str | None = None) -> Sequence:
    ids = list(range(1000, 1000 + tokens)) if isinstance(tokens, int) else list(tokens)
    n = next(_arrivals)
    return Sequence(request_id=name or f"r{n}", seq_no=n, token_ids=ids, num_prompt_tokens=len(ids),
                    params=SamplingParams(max_tokens=max_tokens), priority=priority,
                    metrics=RequestMetrics(arrival_time=float(n)))
