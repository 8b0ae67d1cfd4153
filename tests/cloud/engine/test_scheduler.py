"""Scheduler: priority order, chunked prefill under a token budget, preemption victims, no starvation."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from apiary.cloud.engine.block_manager import BlockManager
from apiary.cloud.engine.config import EngineConfig
from apiary.cloud.engine.scheduler import ScheduledBatch, Scheduler
from apiary.cloud.engine.sequence import Sequence, SequenceStatus
from tests.cloud.engine.helpers import make_seq


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 64, max_seqs: int = 8,
                   aging_steps: int = 1000, mode: str = "recompute", swap_blocks: int = 0) -> Scheduler:
    config = EngineConfig(model_path="unused", block_size=block_size, max_num_batched_tokens=budget,
                          max_num_seqs=max_seqs, aging_steps=aging_steps, preemption_mode=mode)  # type: ignore[arg-type]
    return Scheduler(config, BlockManager(num_blocks, block_size), swap_capacity_blocks=swap_blocks)


def run_step(sched: Scheduler) -> ScheduledBatch:
    """One step with a fake model: computed tokens advance, finished prompts/decodes emit a token."""
    batch = sched.schedule()
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        sched.bm.commit(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                seq.status = SequenceStatus.FINISHED
                sched.remove(seq)
    for seq, _ in batch.swap_out:
        seq.swapped_kv = object()  # type: ignore[assignment]  # the runner's copy
    return batch


def test_waiting_line_is_priority_then_arrival() -> None:
    sched = make_scheduler(max_seqs=2)
    late_urgent, early_lazy, early_urgent = make_seq(4, priority=0), make_seq(4, priority=5), make_seq(4, priority=0)
    early_lazy.seq_no, early_urgent.seq_no, late_urgent.seq_no = 1, 2, 3
    for s in (late_urgent, early_lazy, early_urgent):
        sched.add(s)
    batch = run_step(sched)
    assert batch.seqs == [early_urgent, late_urgent]  # two slots: both priority-0 requests, earliest first


def test_budget_respected_and_decodes_go_first() -> None:
    sched = make_scheduler(budget=16, max_seqs=8)
    decoders = [make_seq(3, max_tokens=100) for _ in range(3)]
    for s in decoders:
        sched.add(s)
    run_step(sched)  # prefill all three (9 tokens)
    long_prompt = make_seq(40, priority=-1)  # more urgent than the decoders, but only prefill
    sched.add(long_prompt)
    chunks = []
    while long_prompt.num_computed_tokens < long_prompt.num_prompt_tokens:
        last = long_prompt.num_prompt_tokens - long_prompt.num_computed_tokens <= 16
        batch = run_step(sched)
        assert batch.num_tokens <= 16
        counts = dict(zip(batch.seqs, batch.num_new_tokens))
        if last:  # the step that yields the urgent prompt's first token carries no less urgent decode
            assert not any(d in counts for d in decoders)
        else:  # earlier chunks: decodes never stall behind the long prompt
            assert all(counts.get(d) == 1 for d in decoders)
        chunks.append(counts[long_prompt])
        # Single-token entries (decodes) lead the batch, multi-token chunks follow.
        assert batch.num_new_tokens[:batch.num_decodes] == [1] * batch.num_decodes
        assert all(n > 1 for n in batch.num_new_tokens[batch.num_decodes:])
    assert chunks == [13, 13, 14]  # beside 3 decodes, beside 3 decodes, alone


def test_kv_exhaustion_preempts_least_urgent_latest_arrival() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    a, b, c = make_seq(8, priority=0, max_tokens=50), make_seq(4, priority=1, max_tokens=50), \
        make_seq(4, priority=1, max_tokens=50)
    for s in (a, b, c):
        sched.add(s)
    run_step(sched)  # 2 + 1 + 1 blocks used, 2 free
    preempted = []
    for _ in range(12):
        preempted += run_step(sched).preempted
    assert preempted[0] is c  # same priority as b but arrived later; a is more urgent
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0 and c.num_output_tokens > 0
    assert c.metrics.preemptions >= 1 and sched.num_preemptions == len(preempted)
    assert a.status is SequenceStatus.RUNNING


def test_preempted_request_keeps_its_place_in_line() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, budget=64, max_seqs=2)
    a, c = make_seq(8, priority=0, max_tokens=6), make_seq(4, priority=1, max_tokens=12)
    sched.add(a)
    sched.add(c)
    run_step(sched)  # a's prompt (c's less urgent prefill waits a step)
    run_step(sched)  # a decodes, c's prompt
    assert c.status is SequenceStatus.RUNNING
    d = make_seq(4, priority=1, max_tokens=4)  # same priority as c, arrives later; no free slot yet
    sched.add(d)
    while c.status is SequenceStatus.RUNNING:
        assert d not in run_step(sched).seqs
    assert c.metrics.preemptions == 1 and sched.waiting == [c, d]
    order: list[Sequence] = []
    while sched.has_unfinished():
        batch = run_step(sched)
        order += [s for s in batch.seqs if s in (c, d) and s not in order]
    assert order == [c, d]  # back in before the later arrival of equal priority
    assert c.num_output_tokens == 12 and d.num_output_tokens == 4


def test_urgent_arrival_preempts_less_urgent_running() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    low = [make_seq(8, priority=5, max_tokens=100), make_seq(8, priority=5, max_tokens=100)]
    for s in low:
        sched.add(s)
    run_step(sched)  # all 4 blocks used
    urgent = make_seq(6, priority=0, max_tokens=2)
    sched.add(urgent)
    batch = run_step(sched)
    assert urgent in batch.seqs and batch.preempted == [low[1]]


def test_equal_priority_arrival_waits_instead_of_preempting() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    low = [make_seq(7, priority=5, max_tokens=6), make_seq(list(range(20, 27)), priority=5, max_tokens=6)]
    for s in low:
        sched.add(s)
    run_step(sched)  # all 4 blocks used; the next decode still fits in them
    peer = make_seq(list(range(40, 46)), priority=5, max_tokens=2)
    sched.add(peer)
    batch = run_step(sched)
    assert batch.preempted == [] and peer not in batch.seqs and sched.waiting == [peer]


def test_max_num_seqs_and_slot_preemption() -> None:
    sched = make_scheduler(max_seqs=2)
    runners = [make_seq(4, priority=3, max_tokens=100) for _ in range(3)]
    for s in runners:
        sched.add(s)
    assert len(run_step(sched).seqs) == 2 and len(sched.running) == 2
    urgent = make_seq(4, priority=0, max_tokens=3)
    sched.add(urgent)
    batch = run_step(sched)
    assert urgent in batch.seqs and batch.preempted == [runners[1]] and len(sched.running) == 2


def test_aging_prevents_starvation() -> None:
    sched = make_scheduler(max_seqs=1, aging_steps=2)
    starving = make_seq(4, priority=3, max_tokens=1)
    sched.add(starving)
    sched.running, sched.waiting = [], [starving]
    steps = 0
    while starving.status is not SequenceStatus.FINISHED and steps < 200:
        sched.add(make_seq(4, priority=0, max_tokens=1))  # a new urgent request every step
        run_step(sched)
        steps += 1
    assert starving.status is SequenceStatus.FINISHED
    assert starving.aging_boost >= 3  # it earned its way up to priority 0, then won on arrival order


def test_without_aging_it_would_starve() -> None:
    sched = make_scheduler(max_seqs=1, aging_steps=10_000)
    starving = make_seq(4, priority=3, max_tokens=1)
    sched.add(starving)
    for _ in range(50):
        sched.add(make_seq(4, priority=0, max_tokens=1))
        run_step(sched)
    assert starving.status is SequenceStatus.WAITING  # the control: the aging rule is what saves it


def test_waiting_earns_a_place_in_line_not_an_eviction() -> None:
    """An equal that aged while waiting takes the next free slot, ahead of later arrivals, but does not push a
    running request out (which would only recompute that one's K/V: churn, no gain)."""
    sched = make_scheduler(max_seqs=1, aging_steps=1)
    running = make_seq(4, priority=1, max_tokens=20)
    sched.add(running)
    run_step(sched)
    aged = make_seq(4, priority=1, max_tokens=1)
    sched.add(aged)
    for _ in range(5):
        run_step(sched)
        sched.add(make_seq(4, priority=1, max_tokens=1))  # later arrivals of the same priority
    assert aged.aging_boost >= 5 and aged.status is SequenceStatus.WAITING
    assert running.status is SequenceStatus.RUNNING and sched.num_preemptions == 0
    while running.status is not SequenceStatus.FINISHED:
        run_step(sched)
    batch = run_step(sched)
    assert batch.seqs == [aged] and sched.num_preemptions == 0  # the freed slot goes to the aged one


def test_a_more_urgent_priority_still_evicts_but_not_one_that_earned_its_place() -> None:
    sched = make_scheduler(max_seqs=1, aging_steps=2)
    lazy = make_seq(4, priority=2, max_tokens=50)
    sched.add(lazy)
    run_step(sched)
    sched.add(urgent := make_seq(4, priority=0, max_tokens=1))
    batch = run_step(sched)
    assert batch.preempted == [lazy] and urgent in batch.seqs  # its own priority beats the running one's
    for _ in range(50):  # urgent traffic every step until lazy has waited its way back up to priority 0
        sched.add(make_seq(4, priority=0, max_tokens=1))
        run_step(sched)
        if lazy.status is SequenceStatus.RUNNING:
            break
    assert lazy.status is SequenceStatus.RUNNING and lazy.aging_boost >= 2
    sched.add(late := make_seq(4, priority=0, max_tokens=1))
    batch = run_step(sched)
    assert not batch.preempted and late.status is SequenceStatus.WAITING  # what lazy earned protects it


def test_running_prompts_go_on_past_a_request_that_may_not_evict_them() -> None:
    """The aged request at the head of the line waits for the slot a prompt mid-prefill holds and may not
    take it: that prompt keeps going (and frees it), where stopping the line there would stall both."""
    sched = make_scheduler(budget=4, max_seqs=1, aging_steps=1)
    prompt = make_seq(12, priority=1, max_tokens=1)
    sched.add(prompt)
    run_step(sched)
    assert 0 < prompt.num_computed_tokens < 12  # mid-prefill
    aged = make_seq(4, priority=1, max_tokens=1)
    sched.add(aged)
    for _ in range(20):
        if not sched.has_unfinished():
            break
        run_step(sched)
    assert aged.aging_boost >= 1  # it stood ahead of the running prompt in line
    assert prompt.status is SequenceStatus.FINISHED and aged.status is SequenceStatus.FINISHED
    assert sched.num_preemptions == 0


def test_decodes_do_not_sit_out_for_a_prompt_that_cannot_start() -> None:
    """Decodes sit a step out for a more urgent prompt only when that prompt runs in it: an aged one that
    waits for their slots would otherwise idle them, and itself, for good."""
    sched = make_scheduler(max_seqs=2, aging_steps=1)
    decoders = [make_seq(4, priority=1, max_tokens=6) for _ in range(2)]
    for s in decoders:
        sched.add(s)
    run_step(sched)
    aged = make_seq(4, priority=1, max_tokens=1)
    sched.add(aged)
    for _ in range(20):
        if not sched.has_unfinished():
            break
        batch = run_step(sched)
        assert batch.seqs or not sched.has_unfinished()  # never an idle step
    assert all(s.status is SequenceStatus.FINISHED for s in [*decoders, aged]) and sched.num_preemptions == 0


def test_swap_mode_parks_kv_and_restores_it() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, mode="swap", swap_blocks=8)
    low = make_seq(8, priority=5, max_tokens=100)
    sched.add(low)
    run_step(sched)
    run_step(sched)  # 9 tokens computed: 3 blocks
    urgent = make_seq(list(range(50, 56)), priority=0, max_tokens=1)  # needs 2 blocks, 1 is free
    sched.add(urgent)
    batch = run_step(sched)
    assert batch.swap_out and batch.swap_out[0][0] is low and len(batch.swap_out[0][1]) == 3
    assert low.num_computed_tokens == 9 and low.num_swapped_blocks == 3 and sched.swap_used_blocks == 3
    batch = run_step(sched)  # urgent finished last step; low comes back from host memory
    assert batch.swap_in and batch.swap_in[0][0] is low and len(batch.swap_in[0][1]) == 3
    assert batch.num_new_tokens == [1] and sched.swap_used_blocks == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 3), st.integers(0, 3)),
                min_size=1, max_size=12),
       st.integers(4, 24), st.integers(4, 40), st.integers(1, 6), st.sampled_from(["recompute", "swap"]))
def test_random_workloads_finish_within_limits(requests: list[tuple[int, int, int, int]], num_blocks: int,
                                               budget: int, max_seqs: int, mode: str) -> None:
    block_size = 4
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, budget=budget, max_seqs=max_seqs,
                           aging_steps=8, mode=mode, swap_blocks=10)
    pending: list[tuple[int, Sequence]] = []
    for prompt, out, prio, arrive in requests:
        if -(-(prompt + out - 1) // block_size) <= num_blocks:  # the engine rejects the rest up front
            pending.append((arrive, make_seq(prompt, priority=prio, max_tokens=out)))
    seqs = [s for _, s in pending]
    for step in range(2000):
        for arrive, s in pending:
            if arrive == step:
                sched.add(s)
        batch = run_step(sched)
        assert batch.num_tokens <= budget and len(sched.running) <= max_seqs
        used = sched.bm.num_blocks - sched.bm.num_free_blocks
        assert used == len({b for s in sched.running for b in s.block_table})
        if step > 3 and not sched.has_unfinished():
            break
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)
    assert sched.bm.num_free_blocks == num_blocks and sched.swap_used_blocks == 0


def test_urgent_prompt_gets_a_short_step() -> None:
    sched = make_scheduler(budget=32, max_seqs=8)
    decoder = make_seq(3, priority=5, max_tokens=100)
    sched.add(decoder)
    run_step(sched)
    long_low = make_seq(200, priority=5, max_tokens=4)
    sched.add(long_low)
    run_step(sched)  # long_low is mid-prefill now
    assert 0 < long_low.num_computed_tokens < 200
    urgent = make_seq(list(range(60, 70)), priority=0, max_tokens=2)
    sched.add(urgent)
    batch = run_step(sched)
    counts = dict(zip(batch.seqs, batch.num_new_tokens))
    # The urgent prompt goes in whole and alone: the less urgent decode and chunk sit this one step out.
    assert counts == {urgent: 10}
    batch = run_step(sched)
    counts = dict(zip(batch.seqs, batch.num_new_tokens))
    assert counts[decoder] == 1 and counts[long_low] == 32 - 2  # back to decodes + full chunks


def test_aging_also_rescues_a_running_prefill_from_urgent_traffic() -> None:
    sched = make_scheduler(budget=16, max_seqs=8, aging_steps=2)
    lazy = make_seq(64, priority=3, max_tokens=1)
    sched.add(lazy)
    run_step(sched)
    assert 0 < lazy.num_computed_tokens < 64  # mid-prefill
    steps = 0
    while lazy.status is not SequenceStatus.FINISHED and steps < 100:
        sched.add(make_seq(list(range(500 + 10 * steps, 510 + 10 * steps)), priority=0, max_tokens=1))
        run_step(sched)
        steps += 1
    assert lazy.status is SequenceStatus.FINISHED and lazy.aging_boost >= 3
