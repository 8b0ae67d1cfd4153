"""Per-request decoding knobs, validated on construction so bad input fails before it is queued."""
from __future__ import annotations

from dataclasses import dataclass, field

from cloud.engine.errors import RequestRejected


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
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
        ]
        for ok, message in checks:
            if not ok:
                raise RequestRejected(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
