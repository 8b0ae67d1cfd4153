"""Per-request decoding knobs, validated on construction so bad input fails before it is queued."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from apiary.cloud.engine.errors import RequestRejected

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclass(slots=True, frozen=True)
class StructuredOutput:
    """A constraint on the output's text, enforced token by token by the engine's grammar backend.

    ``kind``: ``json_schema`` (``spec`` is the schema as JSON text), ``json_object`` (any JSON
    object; ``spec`` unused), ``regex``, ``grammar`` (EBNF: GBNF as llama.cpp writes it, or Lark),
    ``choice`` (``spec`` is a JSON list of the allowed strings).
    """

    kind: Literal["json_schema", "json_object", "regex", "grammar", "choice"]
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise RequestRejected(f"structured output kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str) or (self.kind != "json_object" and not self.spec):
            raise RequestRejected(f"structured output {self.kind!r} needs a non-empty spec string")


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # per-request generator: same seed, same tokens, whatever the batch
    stop: list[str] = field(default_factory=list)  # stop strings; excluded from the returned text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_p: float = 0.0  # drop tokens less than min_p times as likely as the best one
    min_tokens: int = 0  # end-of-generation tokens are masked until this many tokens were generated
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the output so far
    repetition_penalty: float = 1.0  # vLLM's: logits of prompt and output tokens divided (>0) / multiplied (<0)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, [-100, 100]
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: and the k most likely alternatives
    structured: StructuredOutput | None = None  # grammar the output must follow (JSON schema, regex, EBNF)
    logits_processors: tuple[Any, ...] = ()  # cloud.engine.sampling.LogitsProcessor objects, applied in order

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.logits_processors = tuple(self.logits_processors)
        if isinstance(self.logit_bias, dict):
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise RequestRejected(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
        checks = [
            (isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens >= 1,
             f"max_tokens must be an int >= 1, got {self.max_tokens!r}"),
            (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0,
             f"temperature must be in [0, 100], got {self.temperature!r}"),
            (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0,
             f"top_k must be an int >= 0, got {self.top_k!r}"),
            (self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
             f"seed must be an int or None, got {self.seed!r}"),
            (isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
             f"stop must be a list of non-empty strings, got {self.stop!r}"),
            (isinstance(self.stop_token_ids, list)
             and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}"),
            (_number(self.min_p) and 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p!r}"),
            (_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be an int in [0, max_tokens], got {self.min_tokens!r}"),
            (_number(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}"),
            (_number(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"),
            (_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
             f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}"),
            (isinstance(self.logit_bias, dict) and len(self.logit_bias) <= 1024
             and all(k >= 0 and -100.0 <= v <= 100.0 for k, v in self.logit_bias.items()),
             f"logit_bias must map at most 1024 token ids >= 0 to values in [-100, 100], got {self.logit_bias!r}"),
            (self.logprobs is None or (_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"),
            (self.structured is None or isinstance(self.structured, StructuredOutput),
             f"structured must be a StructuredOutput, got {self.structured!r}"),
            (all(callable(p) for p in self.logits_processors), "logits_processors must be callables"),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestRejected(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
