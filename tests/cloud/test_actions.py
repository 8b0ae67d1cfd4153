"""The cloud's JSON action: one schema-constrained request, confidence by the edge's rule."""
from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from apiary.cloud.actions import ActionOutcome, generate_action, score_tokens, token_offsets
from apiary.cloud.engine.sampling import TokenLogprob
from apiary.edge.confidence import measure as edge_measure
from apiary.edge.model import Generation
from apiary.shared.prompting import ACTION_FIELDS, build_messages, parse_action
from apiary.shared.protocol import ASSESSMENTS

EOS = 99


class ByteTokenizer:
    """A stand-in engine tokenizer: token i is ``pieces[i]`` (bytes); EOS decodes to nothing."""

    stop_token_ids = {EOS}

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.pieces[i] for i in ids if i != EOS).decode("utf-8", errors="replace")


# (token bytes, the allowed-token distribution at that step as logprobs, chosen token first)
STEPS: list[tuple[bytes, list[float]]] = [
    (b'{"explanation": "', [0.0]),
    (b"Hive at 41 ", [-0.4, -1.2]),
    (b"\xc2", [-0.9, -0.6, -3.0]),  # "°" split across two tokens
    (b"\xb0C", [-0.05, -3.0]),
    (b'", "assessment": "', [0.0]),
    (b"heat", [-0.7, -0.8, -3.5]),
    (b"_stress", [-0.01, -4.6]),
    (b'", "urgency": "', [0.0]),
    (b"high", [-0.2, -1.7]),
    (b'", "action": "', [0.0]),
    (b"Shade it", [-1.5, -0.3]),
    (b'"}', [0.0]),
]


def _normalised(lps: list[float]) -> list[float]:
    z = math.log(sum(math.exp(v) for v in lps))
    return [v - z for v in lps]


def test_both_tiers_score_the_same_tokens_alike() -> None:
    """Identical per-token data through the edge's path (Generation) and the cloud's (token ids and the
    engine's TokenLogprobs, with the closing end token) gives the same confidence."""
    dists = [_normalised(d) for _, d in STEPS]
    entropies = [float(-sum(math.exp(v) * v for v in d)) for d in dists]
    pieces = [p for p, _ in STEPS]
    offsets = np.cumsum([0] + [len(p) for p in pieces[:-1]]).tolist()
    gen = Generation(text=b"".join(pieces).decode(), token_ids=list(range(len(pieces))),
                     logprobs=[d[0] - 0.5 for d in dists], choice_logprobs=[d[0] for d in dists],
                     entropies=entropies, offsets=offsets, finished=True)
    engine_logprobs = [TokenLogprob(i, d[0], [(i + 100 * j, v) for j, v in enumerate(d)] + [(7, -math.inf)])
                       for i, d in enumerate(dists)] + [TokenLogprob(EOS, -0.01, [(EOS, -0.01)])]
    for quantile, span in ((0.1, "decision"), (0.3, "decision"), (0.1, "all")):
        edge = edge_measure(gen, quantile=quantile, span=span)
        cloud = score_tokens(ByteTokenizer(pieces), [*range(len(pieces)), EOS], engine_logprobs,
                             quantile=quantile, span=span)
        assert cloud.score == pytest.approx(edge.score, abs=1e-12) and cloud.n_tokens == edge.n_tokens
        assert cloud.entropy == pytest.approx(edge.entropy, abs=1e-9)
        assert {k: v for k, v in edge.quantiles.items() if not k.startswith("raw_")} == cloud.quantiles
    decision = score_tokens(ByteTokenizer(pieces), [*range(len(pieces)), EOS], engine_logprobs)
    assert decision.n_tokens == 3  # "heat", "_stress", "high"
    assert decision.score == pytest.approx(np.quantile([dists[5][0], dists[6][0], dists[8][0]], 0.1))


def test_offsets_hold_back_split_characters() -> None:
    pieces = [b'{"a": "', b"\xc2", b"\xb0", b"C", b'"}']
    text, offsets = token_offsets(ByteTokenizer(pieces), list(range(len(pieces))))
    assert text == '{"a": "°C"}'
    assert offsets == [0, 7, 7, 9, 10]  # the second half of "°" starts where the character does


def _situations(n: int, seed: int):
    from apiary.firmware_bridge.simulator import labelled_situations

    return labelled_situations(n, seed)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cloud_answers_real_situations_with_valid_actions(idle_engine):
    """6 simulator situations (every label once), one batched run: every answer is a valid Action in the
    schema's field order, with a finite confidence <= 0 scored on its decision tokens."""
    situations = _situations(6, 7)
    assert {s.label for s in situations} == set(ASSESSMENTS)

    async def run() -> list[ActionOutcome]:
        admitted = asyncio.Semaphore(6)  # the test engine queues at most 6: keep the rest out of its queue

        async def one(s) -> ActionOutcome:
            async with admitted:
                return await generate_action(idle_engine, messages=[m.model_dump() for m in build_messages(
                    s.event, s.context)], max_tokens=128, priority=3)

        return await asyncio.gather(*(one(s) for s in situations))

    outcomes = asyncio.run(run())
    for s, out in zip(situations, outcomes):
        assert out.error is None and out.action is not None, (s.label, out.error, out.text)
        assert parse_action(out.text) is not None
        assert tuple(json.loads(out.text)) == ACTION_FIELDS
        assert out.confidence is not None and out.confidence.n_tokens >= 2
        assert math.isfinite(out.score) and out.score <= 0.0
        assert out.quantiles["min"] <= out.score <= out.quantiles["p50"] <= 0.0
        assert out.confidence.entropy is not None and out.confidence.entropy >= 0.0
        assert out.prompt_tokens > 500 and 10 < out.completion_tokens <= 128 and out.first_token_time is not None
    right = sum(o.action["assessment"] == s.label for s, o in zip(situations, outcomes))
    print(f"cloud: {right}/{len(situations)} assessments right;",
          [(s.label, o.action["assessment"], round(o.score, 3)) for s, o in zip(situations, outcomes)])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_truncated_answer_is_a_clear_error(idle_engine):
    """A max_tokens too small for the JSON: an outcome with the reason, no action, no exception."""
    s = _situations(1, 3)[0]
    out = asyncio.run(generate_action(idle_engine, messages=[m.model_dump() for m in build_messages(s.event, s.context)],
                                      max_tokens=6))
    assert out.action is None and "cut off at max_tokens=6" in out.error
    assert out.completion_tokens == 6 and out.text.startswith('{"explanation"')
    assert out.confidence is not None and out.score is None  # no decision token was reached


@pytest.mark.slow
def test_offsets_of_the_real_tokenizer(cloud_engine):
    tok = cloud_engine.tokenizer
    text = '{"explanation": "Hive at 41 °C — too hot", "assessment": "heat_stress"}'
    ids = tok.encode(text)
    decoded, offsets = token_offsets(tok, ids)
    assert decoded == text and offsets[0] == 0 and offsets == sorted(offsets)
    data = text.encode()
    assert all(data.startswith(tok.decode([t]).encode(), o) for t, o in zip(ids, offsets)
               if "\ufffd" not in tok.decode([t]))
