"""Speculation counters per method, for ``LLMEngine.metrics()``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class SpecStats:
    proposed: int = 0  # draft tokens sent to verification
    accepted: int = 0  # of those, kept
    verifications: int = 0  # (sequence, step) pairs that verified >= 1 draft token
    emitted: int = 0  # tokens those verifications produced (accepted + the target's own token)
    steps_on: int = 0  # engine steps that speculated
    steps_off: int = 0  # decode steps where the policy judged speculation not worth it

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.verifications += 1
        self.emitted += accepted + 1

    def snapshot(self, method: str) -> dict[str, Any]:
        def ratio(a: int, b: int) -> float | None:
            return a / b if b else None

        prefix = f"spec_{method}_"
        return {
            prefix + "proposed": self.proposed, prefix + "accepted": self.accepted,
            prefix + "verifications": self.verifications,
            prefix + "acceptance_rate": ratio(self.accepted, self.proposed),
            prefix + "mean_accepted_length": ratio(self.accepted, self.verifications),
            prefix + "tokens_per_verification": ratio(self.emitted, self.verifications),
            prefix + "steps_on": self.steps_on, prefix + "steps_off": self.steps_off,
        }
