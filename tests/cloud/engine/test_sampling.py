"""The one sampling path on synthetic logits: each processor's arithmetic, bitmasks, logprobs, draws."""
from __future__ import annotations

import math

import pytest
import torch

from apiary.cloud.engine.errors import RequestRejected
from apiary.cloud.engine.outputs import RequestMetrics
from apiary.cloud.engine.sampling import (Row, apply_bitmask, argmax_rows, logprobs_of, probs, process, sample,
                                          temper)
from apiary.cloud.engine.sampling_params import SamplingParams, StructuredOutput
from apiary.cloud.engine.sequence import Sequence
from tests.cloud.engine.test_speculative_units import chi_square_pvalue

V = 40
EOS = 2


def seq(params: SamplingParams, prompt: list[int] = (5, 6), output: list[int] = (), seed: int | None = None) -> Sequence:
    tokens = list(prompt) + list(output)
    return Sequence("r", 0, tokens, len(prompt), params, 0, RequestMetrics(0.0),
                    generator=None if seed is None else torch.Generator().manual_seed(seed))


def logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_logit_bias_adds_to_the_named_tokens() -> None:
    raw = logits()
    out = process(raw.clone(), [Row(seq(SamplingParams(logit_bias={7: 100.0, 3: -5.5})))])
    expected = raw.clone()
    expected[0, 7] += 100.0
    expected[0, 3] -= 5.5
    assert torch.equal(out, expected)
    assert sample(raw, [Row(seq(SamplingParams(logit_bias={7: 100.0})))], [torch.Generator()])[0] == [7]


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    raw = logits()
    s = seq(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[9, 9], output=[4, 4, 4, 11])
    out = process(raw.clone(), [Row(s, drafted=(11,))])  # drafted tokens count as output
    expected = raw.clone()
    expected[0, 4] -= 0.5 + 0.25 * 3
    expected[0, 11] -= 0.5 + 0.25 * 2
    assert torch.allclose(out, expected)  # token 9 (prompt only) untouched


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    raw = torch.zeros(1, V)
    raw[0, 5], raw[0, 8], raw[0, 9] = 2.0, -2.0, 3.0
    s = seq(SamplingParams(repetition_penalty=2.0), prompt=[5], output=[8])
    out = process(raw.clone(), [Row(s)])
    assert out[0, 5] == 1.0 and out[0, 8] == -4.0 and out[0, 9] == 3.0


def test_min_tokens_masks_end_tokens_until_reached() -> None:
    raw = torch.zeros(1, V)
    raw[0, EOS] = 50.0
    params = SamplingParams(min_tokens=3, stop_token_ids=[6])
    early = process(raw.clone(), [Row(seq(params, output=[1]), drafted=(1,))], stop_token_ids=[EOS])
    assert math.isinf(early[0, EOS]) and math.isinf(early[0, 6])
    done = process(raw.clone(), [Row(seq(params, output=[1, 1, 1]))], stop_token_ids=[EOS])
    assert done[0, EOS] == 50.0


def test_min_tokens_never_leaves_a_grammar_row_without_a_token() -> None:
    """A grammar that allows only the end token wins over min_tokens (else nothing could be sampled)."""
    raw = logits()
    mask = torch.zeros(1, 2, dtype=torch.int32)
    mask[0, 0] = 1 << EOS
    out = process(raw.clone(), [Row(seq(SamplingParams(min_tokens=5)))], stop_token_ids=[EOS], bitmask=mask)
    assert torch.isfinite(out[0]).sum() == 1 and torch.isfinite(out[0, EOS])


def test_bitmask_bits_map_to_token_ids_including_the_sign_bit() -> None:
    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[0, 0] = 1 << 3
    mask[0, 1] = -(1 << 31)  # bit 31 of word 1: token 63 (past V=40: no token)
    mask[1, 0] = -(1 << 31)  # token 31
    mask[1, 1] = 1 << 4  # token 36
    out = apply_bitmask(torch.zeros(2, V), mask)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [3]
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [31, 36]


def test_logits_processors_are_called_once_per_step_for_all_their_rows() -> None:
    calls = []

    def ban_odd(x: torch.Tensor, outputs: list[list[int]]) -> torch.Tensor:
        calls.append((x.shape[0], [list(o) for o in outputs]))
        x[:, 1::2] = float("-inf")
        return x

    p = SamplingParams(logits_processors=[ban_odd])
    rows = [Row(seq(p, output=[1])), Row(seq(SamplingParams())), Row(seq(p), drafted=(3, 4))]
    out = process(logits(3), rows)
    assert calls == [(2, [[1], [3, 4]])]
    assert torch.isinf(out[0, 1::2]).all() and torch.isinf(out[2, 1::2]).all() and torch.isfinite(out[1]).all()


def test_logprobs_come_after_temperature_and_processing_before_top_p() -> None:
    raw = logits(2)
    params = [SamplingParams(temperature=0.5, top_p=0.3, logprobs=3), SamplingParams(logprobs=0)]
    lps = logprobs_of(raw, params, [4, 9])
    ref = (raw[0].double() / 0.5).log_softmax(-1)
    assert lps[0].token_id == 4 and abs(lps[0].logprob - ref[4].item()) < 1e-5
    assert [t for t, _ in lps[0].top] == ref.topk(3).indices.tolist()
    assert lps[1].top == [] and abs(lps[1].logprob - raw[1].double().log_softmax(-1)[9].item()) < 1e-5
    assert logprobs_of(raw, [SamplingParams(), SamplingParams()], [0, 0]) == [None, None]


def test_min_p_keeps_tokens_at_least_min_p_times_the_best() -> None:
    raw = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    p = probs(temper(raw, [SamplingParams(temperature=1.0, min_p=0.15)]), [SamplingParams(temperature=1.0, min_p=0.15)])
    assert (p[0] > 0).tolist() == [True, True, True, False, False]
    assert abs(float(p[0].sum()) - 1.0) < 1e-6


def test_draws_follow_the_processed_distribution() -> None:
    """Chi-square through the single path: bias + penalty + min-p + temperature, seeded draws."""
    raw = logits(seed=3) / 3
    params = SamplingParams(temperature=0.8, min_p=0.02, logit_bias={0: 1.5}, presence_penalty=0.7, seed=1)
    s = seq(params, output=[1, 2], seed=1)
    processed = process(raw.clone(), [Row(s)])
    expected = probs(temper(processed, [params]), [params])[0]
    draws = [sample(raw.clone(), [Row(s)], [s.generator])[0][0] for _ in range(6000)]
    counts = torch.bincount(torch.tensor(draws), minlength=V)
    assert set(counts.nonzero().flatten().tolist()) <= set(expected.nonzero().flatten().tolist())
    assert chi_square_pvalue(counts, expected) > 1e-3


@pytest.mark.parametrize("kwargs", [dict(min_p=1.5), dict(presence_penalty=3), dict(frequency_penalty=float("nan")),
                                    dict(repetition_penalty=0), dict(logit_bias={1: 101}), dict(logit_bias={"x": 1}),
                                    dict(logprobs=21), dict(min_tokens=99, max_tokens=8), dict(structured="json"),
                                    dict(logits_processors=[3])])
def test_bad_sampling_params_are_refused_with_a_reason(kwargs: dict) -> None:
    with pytest.raises(RequestRejected):
        SamplingParams(**kwargs)


def test_structured_output_needs_a_known_kind_and_a_spec() -> None:
    with pytest.raises(RequestRejected, match="kind"):
        StructuredOutput("yaml", "x")
    with pytest.raises(RequestRejected, match="spec"):
        StructuredOutput("regex", "")
    assert StructuredOutput("json_object").spec == ""


@pytest.mark.parametrize("case", ["random", "ties", "masked", "nan", "strided", "1-d", "3-d", "no rows", "bf16"])
def test_argmax_rows_is_torchs_argmax(case: str) -> None:
    """The greedy token of every row as torch's ``argmax`` gives it: the first of tied maxima, rows masked to
    ``-inf`` but one token, a NaN counting as the largest, strided inputs, one row alone (a 0-d answer) and 3-D
    ones (speculation's ``[G, K+1, V]``),
    no rows, and dtypes numpy does not take (bf16: torch's own)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(14, 1000, generator=g)
    if case == "ties":
        x = torch.randint(0, 3, (14, 1000), generator=g).float()
    elif case == "masked":
        x = torch.full((14, 1000), float("-inf"))
        x[torch.arange(14), torch.arange(14) * 7] = -5.0
    elif case == "nan":
        x[3, 17] = x[3, 500] = float("nan")
    elif case == "strided":
        x = torch.randn(14, 2000, generator=g)[:, ::2]
    elif case == "1-d":
        x = x[5]
    elif case == "3-d":
        x = torch.randn(3, 5, 1000, generator=g)
    elif case == "no rows":
        x = x[:0]
    elif case == "bf16":
        x = x.bfloat16()
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == x.shape[:-1] and torch.equal(got, x.argmax(dim=-1))
