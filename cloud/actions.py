"""The cloud's JSON action: one grammar-constrained engine request, scored as the edge scores its own.

The engine decodes under :data:`apiary.shared.prompting.ACTION_JSON_SCHEMA`, the schema derived
from :class:`apiary.shared.protocol.Action` that the edge's llama.cpp grammar is built from, so a
finished answer is a JSON object with only allowed enum values, in the edge's field order
(explanation first). It goes through ``apiary.shared.prompting.parse_action``, the edge's parser,
so both tiers accept exactly the same actions; an answer that is cut off by ``max_tokens``
or does not validate is reported with a reason, never repaired or invented.

Confidence follows the edge's rule exactly (:func:`apiary.shared.confidence.measure`: a low
quantile, default p10, of the *choice* logprobs over the tokens of the assessment and
urgency values). With a grammar the engine reports each token's logprob among the
grammar-allowed tokens (after temperature), which is the edge's choice logprob. Per-token
byte offsets come from decoding the output token ids incrementally with the engine's
tokenizer (exact for byte-level BPE such as SmolLM2's). The entropy per token is a top-k
estimate: the entropy of the engine's top :data:`TOP_LOGPROBS` allowed alternatives,
renormalised (:func:`apiary.shared.confidence.topk_entropy`), as the edge's is over the allowed
tokens among its top-k candidates. The end-of-generation token that closes a finished
answer is not scored (the edge never records it either).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from apiary.shared.confidence import MIN_LOGPROB, Confidence, measure, topk_entropy
from apiary.shared.prompting import ACTION_JSON_SCHEMA, parse_action

TOP_LOGPROBS = 20  # alternatives per token for the entropy estimate (the engine's maximum)
ACTION_SCHEMA_SPEC = json.dumps(ACTION_JSON_SCHEMA)


@dataclass(slots=True)
class ActionOutcome:
    text: str  # the model's answer, as generated
    action: dict[str, Any] | None  # the parsed Action, None when the answer is cut off or does not validate
    error: str | None
    prompt_tokens: int
    completion_tokens: int
    first_token_time: float | None = None
    confidence: Confidence | None = None  # score (p10 choice logprob of the decision tokens) and quantiles

    @property
    def score(self) -> float | None:
        return self.confidence.score if self.confidence else None

    @property
    def quantiles(self) -> dict[str, float]:
        return dict(self.confidence.quantiles) if self.confidence else {}


def token_offsets(tokenizer: Any, token_ids: Sequence[int]) -> tuple[str, list[int]]:
    """The text of ``token_ids`` and each token's byte offset in it (``text.encode()``), decoding incrementally.

    A token that ends inside a multi-byte character is decoded together with the tokens that
    complete it; tokens after it start at that character's first byte.
    """
    offsets: list[int] = []
    done = 0  # bytes of complete characters so far
    pending = 0  # first token whose text is not complete yet
    for i in range(len(token_ids)):
        offsets.append(done)
        piece = tokenizer.decode(list(token_ids[pending:i + 1]))
        if not piece.endswith("\ufffd"):
            done += len(piece.encode("utf-8"))
            pending = i + 1
    return tokenizer.decode(list(token_ids)), offsets


def score_tokens(tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[Any], *, quantile: float = 0.1,
                 span: str = "decision") -> Confidence:
    """The edge's confidence rule over an engine output: ``logprobs`` are its ``TokenLogprob``s, one per token."""
    ids, lps = list(token_ids), list(logprobs)
    while ids and ids[-1] in tokenizer.stop_token_ids:  # the end token that closed the answer
        ids.pop()
    lps = lps[:len(ids)]
    text, offsets = token_offsets(tokenizer, ids)
    return measure(text, offsets, [t.logprob for t in lps],
                   [topk_entropy([v for _, v in t.top]) if t.top else 0.0 for t in lps],
                   quantile=quantile, span=span)


async def generate_action(engine, prompt: str | list[int] | None = None, *,
                          messages: list[dict[str, Any]] | None = None, max_tokens: int, temperature: float = 0.0,
                          priority: int = 0, seed: int | None = None, quantile: float = 0.1,
                          span: str = "decision") -> ActionOutcome:
    """The Action for chat ``messages`` (or a rendered ``prompt``, text or token ids), in one engine request.

    ``max_tokens`` is capped to what fits the model's context after the prompt. Engine errors
    (RequestRejected, EngineOverloaded, ...) propagate; a bad answer is an outcome with ``error``.
    """
    from apiary.cloud.engine import SamplingParams
    from apiary.cloud.engine.sampling_params import StructuredOutput

    ids = engine.prompt_token_ids(prompt, messages)
    budget = max(1, min(max_tokens, engine.max_model_len - len(ids)))
    params = SamplingParams(max_tokens=budget, temperature=temperature, seed=seed, logprobs=TOP_LOGPROBS,
                            structured=StructuredOutput("json_schema", ACTION_SCHEMA_SPEC))
    out = await engine.generate(ids, params=params, priority=priority)
    conf = score_tokens(engine.tokenizer, out.output_token_ids, out.logprobs, quantile=quantile, span=span)
    parsed, error = action_outcome(out.text, out.finish_reason, budget)
    return ActionOutcome(out.text, parsed, error, len(out.prompt_token_ids), len(out.output_token_ids),
                         out.metrics.first_token_time, conf)


def action_outcome(text: str, finish_reason: str | None, max_tokens: int) -> tuple[dict[str, Any] | None, str | None]:
    """The Action in an answer (the edge's parser) or why there is none: whichever backend answered."""
    parsed = parse_action(text)
    if parsed is not None:
        return parsed.model_dump(mode="json"), None
    if finish_reason == "length":
        return None, f"answer cut off at max_tokens={max_tokens} before the JSON was complete: {text[-80:]!r}"
    return None, f"the answer is not a valid action: {text[:200]!r}"


def score_openai_logprobs(text: str, content: Sequence[dict[str, Any]], *, quantile: float = 0.1,
                          span: str = "decision") -> Confidence:
    """The edge's confidence rule over an OpenAI chat answer's ``logprobs.content`` (an upstream's answer).

    Byte offsets come from each token's ``bytes`` (its text's UTF-8 where a server omits them). Tokens past
    the answer's text (an end token some servers list, e.g. ``<|im_end|>``) are not scored, as the engine
    path drops the end token. The choice logprob is what the upstream reports: our own API reports it among
    the grammar-allowed tokens, as the engine does; servers that report the raw distribution's (llama.cpp's
    server, vLLM by default) give a lower bound of it, so their scores read less sure.
    """
    answer = len(text.encode("utf-8"))
    offsets: list[int] = []
    logprobs: list[float] = []
    entropies: list[float] = []
    pos = 0
    for token in content:
        if pos >= answer:
            break
        raw = token.get("bytes")
        size = len(raw) if isinstance(raw, list) else len(str(token.get("token", "")).encode("utf-8"))
        offsets.append(pos)
        logprobs.append(float(token.get("logprob", MIN_LOGPROB)))
        entropies.append(topk_entropy([float(t["logprob"]) for t in token.get("top_logprobs") or []]))
        pos += size
    return measure(text, offsets, logprobs, entropies, quantile=quantile, span=span)

