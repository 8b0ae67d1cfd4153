"""Iteration-level scheduler: which sequences run this step, how many tokens each, and who is preempted.

Every step spends a token budget: first one token for each decoding sequence (so a long prompt
never stalls decodes; in a step that carries a prompt more urgent than some of them, those less
urgent decodes sit the step out), then prefill work - chunks of running prompts and newly admitted
requests - in order of urgency = (priority - aging boost, arrival). A step that carries an
urgent prefill carries no less urgent prefill, so urgent requests see short steps. When KV
blocks or sequence slots run out,
the least urgent, latest-arrived running sequence is preempted: its blocks are freed (its K/V
copied to host memory first in swap mode) and it waits again with its original place in line.
A request earns one priority level per ``aging_steps`` steps it waits (queued, or running but left
out of a step), so none starves. What it earns is a place in line, not the right to push a running
request out: only a request whose own priority beats the running one's (aged) priority does that
(``_outranks``). Evicting an equal for an aged one only moved work around: the 64 requests of
``apiary bench engine`` at 16 in flight made 31 such evictions, each recomputing its sequence.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Callable

from apiary.cloud.engine.block_manager import BlockManager
from apiary.cloud.engine.config import EngineConfig
from apiary.cloud.engine.sequence import Sequence, SequenceStatus


def _urgency(seq: Sequence) -> tuple[int, int]:
    return seq.urgency


def _outranks(waiting: Sequence, running: Sequence) -> bool:
    """Whether ``waiting`` may push ``running`` out: its own priority (not what it earned by waiting) beats
    the running one's effective priority (what that one earned protects it). Slots and blocks that free up
    go by the whole urgency, aging included, so an aged request still gets the next one."""
    return waiting.priority < running.urgency[0]


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)  # single-token (decode) entries first, then prefill chunks
    num_new_tokens: list[int] = field(default_factory=list)
    num_decodes: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    swap_out: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # copy these blocks to host first
    swap_in: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # then copy host K/V into these
    # Speculative verification: these decoding sequences run their last token plus these draft tokens.
    spec_tokens: dict[Sequence, list[int]] = field(default_factory=dict)
    spec_plan: Any = None  # the speculator's SpecPlan for this step (None: no speculation)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


@dataclass(slots=True)
class SpeculationHooks:
    """How the scheduler involves a speculative decoder: ``propose`` turns a scheduled batch's decodes into
    verifications (reserving their KV slots, setting ``spec_tokens``) and returns the plan;
    ``preempted`` tells it a sequence lost its blocks (its draft state goes too)."""

    propose: Callable[[ScheduledBatch], Any]
    preempted: Callable[[Sequence], None]


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, swap_capacity_blocks: int = 0) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: list[Sequence] = []  # sorted by urgency
        self.running: list[Sequence] = []  # sorted by urgency; the victim is the last one
        self.swap_capacity_blocks = swap_capacity_blocks if config.preemption_mode == "swap" else 0
        self.swap_used_blocks = 0
        self.num_preemptions = 0
        self.speculation: SpeculationHooks | None = None

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=_urgency)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its blocks / host copy."""
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        self.bm.free(seq)
        self._drop_swap(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _drop_swap(self, seq: Sequence) -> None:
        self.swap_used_blocks -= seq.num_swapped_blocks
        seq.num_swapped_blocks, seq.swapped_kv = 0, None

    def _preempt(self, seq: Sequence, batch: ScheduledBatch, scheduled: dict[Sequence, int]) -> None:
        self.running.remove(seq)
        scheduled.pop(seq, None)  # not run yet, so simply unscheduled
        keep = self.bm.blocks_for(seq.num_computed_tokens)
        if 0 < keep <= self.swap_capacity_blocks - self.swap_used_blocks:
            batch.swap_out.append((seq, seq.block_table[:keep]))
            seq.num_swapped_blocks = keep
            self.swap_used_blocks += keep
        else:
            seq.num_computed_tokens = 0  # recompute from scratch (the prefix cache often still holds it)
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.metrics.preemptions += 1
        self.num_preemptions += 1
        if self.speculation is not None:
            self.speculation.preempted(seq)
        batch.preempted.append(seq)
        bisect.insort(self.waiting, seq, key=_urgency)

    def _grow(self, seq: Sequence, n: int, batch: ScheduledBatch, scheduled: dict[Sequence, int]) -> bool:
        """Give running ``seq`` slots for ``n`` more tokens, preempting the least urgent if blocks run out."""
        while self.bm.append_cost(seq, n) > self.bm.num_free_blocks:
            victim = self.running[-1]
            self._preempt(victim, batch, scheduled)
            if victim is seq:
                return False
        self.bm.append(seq, n)
        scheduled[seq] = n
        return True

    def _fits(self, seq: Sequence, budget: int) -> tuple[list[int], int, bool]:
        """For waiting ``seq``: its cached prefix blocks, the tokens it would run now, and whether a free slot and
        free blocks take it as things stand."""
        cached = [] if seq.num_swapped_blocks > 0 else self.bm.cached_prefix(seq)
        n = min(seq.num_tokens - seq.num_computed_tokens - len(cached) * self.bm.block_size, budget)
        fits = len(self.running) < self.config.max_num_seqs and self.bm.admit_cost(seq, cached, n) <= self.bm.num_free_blocks
        return cached, n, fits

    def _can_start(self, seq: Sequence) -> bool:
        """Whether ``seq`` would run this step: it is running, or it fits, or it outranks someone to push out."""
        return (seq.status is SequenceStatus.RUNNING or self._fits(seq, self.config.max_num_batched_tokens)[2]
                or (bool(self.running) and _outranks(seq, self.running[-1])))

    def _admit(self, seq: Sequence, budget: int, batch: ScheduledBatch, scheduled: dict[Sequence, int]) -> bool:
        """Start waiting ``seq`` (prefix-cache hit or swapped-out K/V first); may push out less urgent ones."""
        while True:
            swapped = seq.num_swapped_blocks > 0
            cached, n, fits = self._fits(seq, budget)
            if fits:
                break
            if not self.running or not _outranks(seq, self.running[-1]):
                return False  # nothing it outranks to push out: wait for a slot or blocks to free up
            self._preempt(self.running[-1], batch, scheduled)
        self.waiting.remove(seq)
        restore = seq.num_swapped_blocks
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.cached_prompt_tokens = len(cached) * self.bm.block_size
        self.bm.admit(seq, cached, n)
        if swapped:
            batch.swap_in.append((seq, seq.block_table[:restore]))
            self.swap_used_blocks -= restore
            seq.num_swapped_blocks = 0
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_urgency)
        scheduled[seq] = n
        return True

    def _prefill_left(self, seq: Sequence) -> int:
        """Prompt tokens ``seq`` still has to compute before its first output token (prefix-cache hits excluded)."""
        cached = 0 if seq.status is SequenceStatus.RUNNING or seq.num_swapped_blocks else len(self.bm.cached_prefix(seq))
        return seq.num_tokens - seq.num_computed_tokens - cached * self.bm.block_size

    def schedule(self) -> ScheduledBatch:
        batch, scheduled = ScheduledBatch(), {}

        def budget() -> int:
            return self.config.max_num_batched_tokens - sum(scheduled.values())

        def line_now() -> list[Sequence]:
            return sorted([s for s in self.running if s.num_uncomputed_tokens > 1] + self.waiting, key=_urgency)

        line = line_now()
        # The step that finishes a prompt more urgent than some decoding sequences is an urgent step:
        # those less urgent decodes sit it out (one step), so the urgent request's first token comes
        # about as fast as on an idle engine. Earlier chunks of a long urgent prompt keep decodes flowing.
        # (Only a prompt that can start: one stuck behind equals it may not push out would idle them for nothing.)
        urgent = None
        if line and self._prefill_left(line[0]) <= self.config.max_num_batched_tokens and self._can_start(line[0]):
            urgent = line[0].urgency[0]
        # 1. Decodes: one token for every running sequence that has one to run, most urgent first.
        for seq in [s for s in self.running if s.num_uncomputed_tokens == 1]:
            if urgent is not None and seq.urgency[0] > urgent:
                continue
            if seq.status is SequenceStatus.RUNNING and budget() > 0:
                self._grow(seq, 1, batch, scheduled)
        # 2. Prefill work (running chunks and waiting requests) in line order. Once a prefill of priority
        #    p is in the step, less urgent prefills wait a step: an urgent prompt's step stays short.
        #    The line of waiting requests stops at the first that cannot start (none overtakes it); prompts
        #    already running go on past it, since it may be waiting for their blocks and may not evict them.
        level, closed = None, False
        for seq in line_now():  # again: decodes may have preempted someone back into the line
            if budget() <= 0 or (level is not None and seq.urgency[0] > level):
                break
            if seq.status is SequenceStatus.RUNNING:
                if not self._grow(seq, min(seq.num_uncomputed_tokens, budget()), batch, scheduled):
                    continue
            elif closed or seq in batch.preempted or not self._admit(seq, budget(), batch, scheduled):
                closed = True
                continue
            level = seq.urgency[0]
        # 3. Aging: a step spent waiting (queued, or running but left out) counts toward a priority boost.
        for seq in self.waiting + [s for s in self.running if s not in scheduled]:
            seq.waited_steps += 1
            if seq.waited_steps % self.config.aging_steps == 0:
                seq.aging_boost += 1
        # Single-token entries first, shortest context first (the runner groups them by length); then chunks.
        order = sorted(scheduled.items(),
                       key=lambda item: (item[1] > 1, item[0].num_computed_tokens if item[1] == 1 else 0,
                                         item[0].urgency))
        batch.seqs = [s for s, _ in order]
        batch.num_new_tokens = [n for _, n in order]
        batch.num_decodes = sum(1 for n in batch.num_new_tokens if n == 1)
        if self.speculation is not None and batch.seqs:
            plan = self.speculation.propose(batch)
            batch.spec_plan = plan if plan else None
        return batch
