"""What the operator chooses about speculative decoding: the method, how far to look ahead, when to stop."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from apiary.cloud.engine.errors import EngineError

METHODS = ("ngram", "draft")


@dataclass(slots=True)
class SpeculativeConfig:
    """``method="ngram"`` proposes from the sequence's own text (no model); ``"draft"`` runs a small model.

    The draft is any checkpoint with the target's tokenizer (``draft_model_path``; None = the
    target's own file), optionally cut to its first ``draft_num_layers`` layers (final norm and
    head kept) -- a layer-truncated target is a valid, if weak, draft.
    """

    method: str = "ngram"
    k: int = 8  # most draft tokens per sequence and step; the adaptive policy picks 0..k
    draft_model_path: str | Path | None = None
    draft_num_layers: int | None = None
    ngram_max: int = 4  # the longest suffix matched against earlier text; shorter ones are tried next
    ngram_min: int = 1
    # Finished outputs the n-gram proposer also matches against (tokens kept; 0 = only the sequence's
    # own text). Answers to similar sensor events repeat, so this is where most structured hits come from.
    ngram_history_tokens: int = 1 << 16
    # Never speculate while more than this many sequences decode in one step (a hard cap; below it
    # the measured step times decide, see policy.py).
    max_batch: int = 16
    # Priors until step times are measured: the cost of one extra verified position relative to
    # a plain step (kept optimistic so speculation gets tried and measured), and of one draft
    # forward pass (None: the draft's share of the target's parameters).
    prior_token_cost: float = 0.05
    draft_step_cost: float | None = None
    adaptive: bool = True  # False: always propose k (tests, calibration); max_batch still applies
    ewma: float = 0.3  # weight of the newest verification in a sequence's acceptance estimate
    initial_acceptance: float = 0.6  # the estimate a sequence starts from (and drifts back to while idle)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise EngineError(f"SpeculativeConfig.method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.ngram_history_tokens, int) or self.ngram_history_tokens < 0:
            raise EngineError(f"SpeculativeConfig.ngram_history_tokens must be an int >= 0, got {self.ngram_history_tokens!r}")
        for name in ("k", "ngram_max", "ngram_min", "max_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise EngineError(f"SpeculativeConfig.{name} must be an int >= 1, got {value!r}")
        if self.ngram_min > self.ngram_max:
            raise EngineError(f"SpeculativeConfig.ngram_min {self.ngram_min} > ngram_max {self.ngram_max}")
        if self.draft_num_layers is not None and (not isinstance(self.draft_num_layers, int)
                                                  or isinstance(self.draft_num_layers, bool)
                                                  or self.draft_num_layers < 1):
            raise EngineError(f"SpeculativeConfig.draft_num_layers must be an int >= 1, got {self.draft_num_layers!r}")
        if self.method == "ngram" and (self.draft_model_path is not None or self.draft_num_layers is not None):
            raise EngineError("draft_model_path / draft_num_layers only apply to method='draft'")
        if not 0.0 <= self.prior_token_cost < 1.0:
            raise EngineError(f"SpeculativeConfig.prior_token_cost must be in [0, 1), got {self.prior_token_cost!r}")
        if self.draft_step_cost is not None and not 0.0 <= self.draft_step_cost < 1.0:
            raise EngineError(f"SpeculativeConfig.draft_step_cost must be in [0, 1), got {self.draft_step_cost!r}")
        if not 0.0 < self.ewma <= 1.0:
            raise EngineError(f"SpeculativeConfig.ewma must be in (0, 1], got {self.ewma!r}")
        if not 0.0 <= self.initial_acceptance < 1.0:
            raise EngineError(f"SpeculativeConfig.initial_acceptance must be in [0, 1), got {self.initial_acceptance!r}")
