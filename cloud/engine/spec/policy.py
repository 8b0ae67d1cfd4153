"""How many tokens to speculate, per sequence and per step, from acceptance and measured step times.

A verification of k proposals whose per-token acceptance is a emits on average
(1 - a^(k+1)) / (1 - a) tokens, so the j-th extra proposal of a sequence adds a^j expected
tokens. Every step the policy hands out proposals in order of that gain (the most promising
sequences get the longest lookahead) and keeps the total that maximises expected tokens per
second, where a step's time comes from ``StepCosts``: wall times the engine measured for
steps of each size, plus the draft model's own time. Nothing is hard-coded about the
hardware: on a CPU where one extra position turns a matrix-vector product into a
matrix-matrix one, or in a batch large enough to be compute-bound, the measured times make
speculation lose and the policy switches it off; when the batch drains it comes back.

Each sequence's acceptance is an EWMA over its verifications. A new sequence starts from the
prior: an EWMA over all recent verifications (so on a free-text workload where nothing is
accepted, new requests do not waste their first steps finding that out again). While a
sequence is not speculating its estimate drifts back to the prior, and while nobody
speculates the prior drifts back to ``initial_acceptance``, so both get retried. Likewise,
after ``PROBE_EVERY`` decode steps without speculation one step is planned with the prior
costs instead of the measured ones, so a step time measured during a load spike cannot
switch speculation off for good (at most one step in ``PROBE_EVERY`` is spent exploring).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

IDLE_DRIFT = 0.05  # per idle step, the share of the gap to the prior an estimate closes
PRIOR_WEIGHT = 0.05  # weight of one verification in the shared prior
PRIOR_DRIFT = 0.002  # per quiet step, the share of the gap to initial_acceptance the prior closes
PROBE_EVERY = 32  # decode steps without speculation before one is planned on prior costs


def expected_tokens(acceptance: float, k: int) -> float:
    """Mean tokens emitted by one verification of k proposals with i.i.d. per-token acceptance."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@dataclass(slots=True)
class StepCosts:
    """EWMA wall time of decode steps by their token count, and of one draft forward pass.

    Unmeasured sizes are interpolated between measured ones; above the largest, each extra token
    is assumed to add ``prior_token_cost`` of a step (optimistic, so speculation gets tried and
    then measured). Times only matter relative to each other.
    """

    prior_token_cost: float
    prior_draft_cost: float  # one draft pass, relative to a plain step
    weight: float = 0.3
    sizes: list[int] = field(default_factory=list)  # sorted keys of `seconds`
    seconds: dict[int, float] = field(default_factory=dict)
    draft_pass: float | None = None

    def observe(self, num_tokens: int, seconds: float) -> None:
        old = self.seconds.get(num_tokens)
        if old is None:
            bisect.insort(self.sizes, num_tokens)
            self.seconds[num_tokens] = seconds
        else:
            self.seconds[num_tokens] = old + self.weight * (seconds - old)

    def observe_draft(self, passes: int, seconds: float) -> None:
        if passes > 0:
            per = seconds / passes
            self.draft_pass = per if self.draft_pass is None else self.draft_pass + self.weight * (per - self.draft_pass)

    def step_time(self, n: int) -> float:
        sizes, sec = self.sizes, self.seconds
        if not sizes:
            return 1.0 + self.prior_token_cost * (n - 1)
        i = bisect.bisect_left(sizes, n)
        if i < len(sizes) and sizes[i] == n:
            return sec[n]
        if i == 0:
            return sec[sizes[0]]
        if i == len(sizes):
            top = sizes[-1]
            return sec[top] * (1.0 + self.prior_token_cost * (n - top))
        lo, hi = sizes[i - 1], sizes[i]
        return sec[lo] + (sec[hi] - sec[lo]) * (n - lo) / (hi - lo)

    def draft_time(self, passes: int, base: float) -> float:
        per = self.draft_pass if self.draft_pass is not None else self.prior_draft_cost * base
        return passes * per


@dataclass(slots=True)
class SeqSpecState:
    acceptance: float


class AdaptivePolicy:
    def __init__(self, k_max: int, max_batch: int, ewma: float, initial_acceptance: float, costs: StepCosts) -> None:
        self.k_max, self.max_batch = k_max, max_batch
        self.ewma, self.initial_acceptance = ewma, initial_acceptance
        self.costs = costs
        self.uses_draft = False  # draft passes cost time too
        self.states: dict[object, SeqSpecState] = {}
        self.quiet_steps = 0  # decode steps in a row that did not speculate
        self.prior = initial_acceptance  # where new sequences start

    def acceptance(self, key: object) -> float:
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = SeqSpecState(self.prior)
        return state.acceptance

    def choose(self, keys: list[object], limits: list[int], num_tokens: int) -> list[int]:
        """Proposal lengths for the decoding sequences ``keys`` in a step of ``num_tokens`` plain tokens.

        All zeros when more than ``max_batch`` sequences decode or no lookahead beats plain decoding.
        """
        ks = [0] * len(keys)
        if not keys or len(keys) > self.max_batch:
            return ks
        alphas = [self.acceptance(key) for key in keys]
        # Every possible extra proposal with its expected gain; per sequence the gains fall (a, a^2, ...).
        gains = sorted(((alphas[i] ** (j + 1), i) for i in range(len(keys))
                        for j in range(min(self.k_max, limits[i]))), reverse=True)
        costs = self.costs
        if self.quiet_steps >= PROBE_EVERY:  # explore: judge by the priors, the outcome gets measured
            costs = StepCosts(costs.prior_token_cost, costs.prior_draft_cost)
        base = costs.step_time(num_tokens)
        best_score, best_len = len(keys) / base, 0
        expected, taken, longest = float(len(keys)), [0] * len(keys), 0
        for n, (gain, i) in enumerate(gains, start=1):
            expected += gain
            taken[i] += 1
            longest = max(longest, taken[i])
            time = costs.step_time(num_tokens + n)
            if self.uses_draft:
                time += costs.draft_time(longest, base)
            if expected / time > best_score:
                best_score, best_len = expected / time, n
        for _, i in gains[:best_len]:
            ks[i] += 1
        self.quiet_steps = 0 if best_len else self.quiet_steps + 1
        if not best_len:  # nobody speculates: the shared prior recovers toward the configured one
            self.prior += PRIOR_DRIFT * (self.initial_acceptance - self.prior)
        for key, k in zip(keys, ks):
            if k == 0:  # idle: drift back toward the prior so it gets retried
                state = self.states[key]
                state.acceptance += IDLE_DRIFT * (self.prior - state.acceptance)
        return ks

    def update(self, key: object, proposed: int, accepted: int) -> None:
        """Fold one verification into the sequence's acceptance: ``accepted`` leading hits of ``proposed``."""
        if proposed == 0:
            return
        self.acceptance(key)
        state = self.states[key]
        trials = accepted + (1 if accepted < proposed else 0)
        state.acceptance += self.ewma * (accepted / trials - state.acceptance)
        self.prior += PRIOR_WEIGHT * (accepted / trials - self.prior)
        state.acceptance = min(state.acceptance, 0.99)  # keep the geometric model finite

    def drop(self, key: object) -> None:
        self.states.pop(key, None)
