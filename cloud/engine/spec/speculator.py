"""Speculative decoding for the engine: propose per sequence, verify in the target's batch, keep score.

Per step the engine hands over its decoding sequences; the speculator decides each one's k
(adaptive policy, switched off for large batches), gets proposals (n-gram lookup or the draft
model), and after the target scored all k+1 positions in its ordinary batched forward, turns
those logits into accepted tokens (``rejection.verify``). It then updates acceptance
estimates and metrics and rolls the draft cache back to what was kept.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from apiary.cloud.engine.block_manager import BlockManager
from apiary.cloud.engine.errors import EngineError
from apiary.cloud.engine.scheduler import ScheduledBatch
from apiary.cloud.engine.sequence import Sequence
from apiary.cloud.engine.spec.config import METHODS, SpeculativeConfig
from apiary.cloud.engine.sampling import Row, logprobs_of
from apiary.cloud.engine.spec.draft import DraftProposer, ProcessFn
from apiary.cloud.engine.spec.ngram import NgramProposer
from apiary.cloud.engine.spec.policy import AdaptivePolicy, StepCosts
from apiary.cloud.engine.spec.rejection import Verdict, verify
from apiary.cloud.engine.spec.stats import SpecStats


@dataclass(slots=True)
class SpecPlan:
    """This step's proposals; ``seqs[i]`` verifies ``drafts[i]`` (never empty)."""

    method: str
    seqs: list[Sequence] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [len(seqs), K, V], draft method with sampled rows only

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft: DraftProposer | None = None,
                 draft_step_cost: float | None = None) -> None:
        if config.method == "draft" and draft is None:
            raise EngineError("method='draft' needs a draft model")
        self.config = config
        self.draft = draft
        self.ngram = NgramProposer(config.ngram_min, config.ngram_max, config.ngram_history_tokens)
        self.stats = {m: SpecStats() for m in METHODS}
        self.enabled = True  # benchmarks switch speculation off and on in one engine
        self.costs = StepCosts(prior_token_cost=config.prior_token_cost,
                               prior_draft_cost=config.draft_step_cost or draft_step_cost or 0.5)
        # One policy per method (acceptance differs by method); all share the measured step times.
        self.policies = {m: AdaptivePolicy(config.k, config.max_batch, config.ewma, config.initial_acceptance,
                                           self.costs) for m in METHODS}
        self.policies["draft"].uses_draft = True
        self.method = config.method

    @property
    def method(self) -> str:
        return self._method

    @method.setter
    def method(self, method: str) -> None:
        """Switch proposer (e.g. to compare both on one loaded engine)."""
        if method not in METHODS:
            raise EngineError(f"speculative method must be one of {METHODS}, got {method!r}")
        if method == "draft" and self.draft is None:
            raise EngineError("method='draft' needs a draft model (SpeculativeConfig(method='draft', ...))")
        self._method = method

    @property
    def policy(self) -> AdaptivePolicy:
        return self.policies[self._method]

    # ------------------------------------------------------------ per step

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """The engine's measured time to run (and verify) a decode-only step of ``num_tokens`` tokens."""
        self.costs.observe(num_tokens, seconds)

    def plan(self, seqs: list[Sequence], limits: list[int], num_tokens: int,
             generators: list[torch.Generator], process: ProcessFn | None = None,
             valid_prefix: Callable[[Sequence, list[int]], int] | None = None) -> SpecPlan:
        """Proposals for the decoding ``seqs`` of a step that runs ``num_tokens`` tokens without them;
        ``limits[i]``: the most draft tokens ``seqs[i]`` may take (before max_tokens / max_model_len).
        Empty when speculation does not pay. ``process``: the engine's logits processing, which the
        draft model samples through; ``valid_prefix(seq, tokens)``: how many leading proposed tokens
        the sequence's grammar allows (proposals are cut there: a token the grammar forbids would
        be rejected anyway, so cutting it changes no output)."""
        plan = SpecPlan(self.method)
        stats = self.stats[self.method]
        if not self.enabled or not seqs:
            return plan
        if self.config.adaptive:
            ks = self.policy.choose(seqs, limits, num_tokens)
        else:
            ks = [min(self.config.k, lim) if len(seqs) <= self.config.max_batch else 0 for lim in limits]
        if not any(ks):
            stats.steps_off += 1
            return plan
        if self.method == "ngram":
            drafts = [self.ngram.propose(s, s.token_ids, k) for s, k in zip(seqs, ks)]
            if valid_prefix is not None:  # a draft model samples under the grammar mask already
                for s, d in zip(seqs, drafts):
                    if d and s.params.structured is not None:
                        del d[valid_prefix(s, d):]
            probs = None
        else:
            assert self.draft is not None
            idx = [i for i, k in enumerate(ks) if k > 0]
            start = time.perf_counter()
            proposal = self.draft.propose([seqs[i] for i in idx], [ks[i] for i in idx], [generators[i] for i in idx],
                                          process)
            self.costs.observe_draft(max(ks), time.perf_counter() - start)
            drafts = [[] for _ in seqs]
            for j, i in enumerate(idx):
                drafts[i] = proposal.tokens[j]
            keep = [j for j, i in enumerate(idx) if drafts[i]]
            probs = None if proposal.probs is None else proposal.probs[keep]
        for s, d in zip(seqs, drafts):
            if d:
                plan.seqs.append(s)
                plan.drafts.append(d)
        plan.draft_probs = probs
        if plan:
            stats.steps_on += 1
        return plan

    def extend_batch(self, batch: ScheduledBatch, block_manager: BlockManager, max_model_len: int,
                     max_num_batched_tokens: int, generator_of: Callable[[Sequence], torch.Generator],
                     process: ProcessFn | None = None,
                     valid_prefix: Callable[[Sequence, list[int]], int] | None = None) -> SpecPlan:
        """Speculate inside a scheduled batch: propose for its decoding sequences, give each verifying
        sequence KV slots for its k extra tokens, and reorder the batch (plain decodes, then
        verifications, then prefill chunks) with ``batch.spec_tokens`` set. Proposals that find no
        room (KV pool, token budget) shrink or are withdrawn; the batch is left as is when none remain.
        """
        seqs, limits = [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if n == 1 and seq.num_computed_tokens == seq.num_tokens - 1:  # decoding: only its last token is new
                seqs.append(seq)
                limits.append(max(0, min(seq.params.max_tokens - seq.num_output_tokens - 1,
                                         max_model_len - seq.num_tokens - 1)))
        plan = self.plan(seqs, limits, batch.num_tokens, [generator_of(s) for s in seqs], process, valid_prefix)
        bm, budget, i = block_manager, max_num_batched_tokens - batch.num_tokens, 0
        while i < len(plan.seqs):
            seq, draft = plan.seqs[i], plan.drafts[i]
            room = (len(seq.block_table) + bm.num_free_blocks) * bm.block_size - seq.num_computed_tokens - 1
            k = min(len(draft), budget, room)
            if k <= 0:
                self.drop_proposal(plan, i)
                continue
            del draft[k:]
            bm.append(seq, 1 + k)
            budget -= k
            i += 1
        if plan:
            spec = dict(zip(plan.seqs, plan.drafts))
            entries = list(zip(batch.seqs, batch.num_new_tokens))
            plain = [(s, n) for s, n in entries if n == 1 and s not in spec]
            verifying = [(s, 1 + len(spec[s])) for s, _ in entries if s in spec]
            chunks = [(s, n) for s, n in entries if n > 1]
            order = plain + verifying + chunks
            batch.seqs, batch.num_new_tokens = [s for s, _ in order], [n for _, n in order]
            batch.num_decodes = len(plain)
            batch.spec_tokens = spec
        return plan

    def drop_proposal(self, plan: SpecPlan, index: int) -> None:
        """Withdraw ``plan.seqs[index]``'s proposal (e.g. the target's KV pool has no room for it)."""
        if self.draft is not None and plan.method == "draft":
            seq = plan.seqs[index]
            self.draft.rollback(seq, seq.num_tokens)  # forget the K/V of the withdrawn draft tokens
        del plan.seqs[index], plan.drafts[index]
        if plan.draft_probs is not None:
            plan.draft_probs = torch.cat((plan.draft_probs[:index], plan.draft_probs[index + 1:]))

    def verify(self, plan: SpecPlan, target_logits: torch.Tensor, generators: list[torch.Generator],
               process: ProcessFn | None = None) -> list[Verdict]:
        """``target_logits`` ``[sum(k_i + 1), V]`` (raw): each planned sequence's k_i + 1 rows, in plan order.

        Each row goes through ``process`` as the position it scores (the sequence plus the drafts
        before it), so penalties and grammar masks see exactly what a plain step would have seen.
        """
        ks = [len(d) for d in plan.drafts]
        k_max = max(ks)
        starts, total = [], 0
        for k in ks:
            starts.append(total)
            total += k + 1
        if total != target_logits.shape[0]:
            raise EngineError(f"verification got {target_logits.shape[0]} logit rows for {total} positions")
        rows = [Row(s, tuple(d[:j])) for s, d in zip(plan.seqs, plan.drafts) for j in range(len(d) + 1)]
        logits = target_logits.float()
        if process is not None:
            logits = process(logits, rows)
        index = torch.tensor([[s + min(j, k) for j in range(k_max + 1)] for s, k in zip(starts, ks)],
                             device=logits.device)
        padded = logits[index]  # [B, K+1, V]; rows past a sequence's k repeat its last row (ignored)
        draft_tokens = torch.tensor([d + [0] * (k_max - len(d)) for d in plan.drafts], dtype=torch.long)
        probs = None if plan.draft_probs is None else plan.draft_probs[:, :k_max]  # drafts may have been trimmed
        verdicts = verify(padded, draft_tokens, torch.tensor(ks), probs, [s.params for s in plan.seqs], generators)
        want = [b for b, s in enumerate(plan.seqs) if s.params.logprobs is not None]
        if want:  # each emitted token's logprobs at its own position
            at = [starts[b] + j for b in want for j in range(len(verdicts[b].tokens))]
            toks = [t for b in want for t in verdicts[b].tokens]
            lps = logprobs_of(logits[at], [rows[i].params for i in at], toks)
            n = 0
            for b in want:
                m = len(verdicts[b].tokens)
                verdicts[b].logprobs = lps[n:n + m]
                n += m
        return verdicts

    def record(self, plan: SpecPlan, verdicts: list[Verdict], num_emitted: list[int]) -> None:
        """After the engine appended the verdicts' tokens (``num_emitted[i]`` of them, fewer if a stop hit):
        update acceptance estimates and metrics, and roll the draft cache back to the kept text."""
        stats = self.stats[plan.method]
        policy = self.policies[plan.method]
        for seq, draft, verdict, emitted in zip(plan.seqs, plan.drafts, verdicts, num_emitted):
            stats.record(len(draft), verdict.num_accepted)
            policy.update(seq, len(draft), verdict.num_accepted)
            if self.draft is not None and not seq.finished:
                # Valid draft K/V: the text before this step's new tokens, plus the accepted drafts.
                self.draft.rollback(seq, seq.num_tokens - emitted + verdict.num_accepted)

    def preempted(self, seq: Sequence) -> None:
        """A preempted sequence gives up its draft cache; it is rebuilt when it decodes again."""
        if self.draft is not None:
            self.draft.drop(seq)

    def release(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence; a finished one's output joins the n-gram history."""
        if seq.finish_reason in ("stop", "length"):
            self.ngram.finish(seq, seq.token_ids, seq.num_prompt_tokens)
        else:
            self.ngram.drop(seq)
        for policy in self.policies.values():
            policy.drop(seq)
        if self.draft is not None:
            self.draft.drop(seq)

    def metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {"spec_method": self.method if self.enabled else "off"}
        for method, stats in self.stats.items():
            out.update(stats.snapshot(method))
        return out
