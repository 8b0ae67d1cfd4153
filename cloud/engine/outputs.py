"""What the engine hands back per request and step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    preemptions: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache at first admission

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    # The brief's names for the same times.
    @property
    def arrival(self) -> float:
        return self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # everything generated so far
    new_token_ids: list[int]  # generated in this step
    text: str  # everything released so far (stop strings and held-back partial text excluded)
    text_delta: str  # released in this step
    finished: bool
    finish_reason: FinishReason | None
    metrics: RequestMetrics = field(repr=False)
    # sampling.TokenLogprob per output token (all so far) and for this step's tokens; empty unless asked for
    logprobs: list[Any] = field(default_factory=list, repr=False)
    new_logprobs: list[Any] = field(default_factory=list, repr=False)
