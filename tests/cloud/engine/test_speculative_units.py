"""Speculative decoding parts on their own: rejection rule (incl. a chi-square losslessness test),
n-gram lookup, the adaptive-k policy, and the draft proposer's paged cache on a tiny random model."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from apiary.cloud.engine.config import ModelConfig
from apiary.cloud.engine.errors import EngineError
from apiary.cloud.engine.kv_cache import KVPool
from apiary.cloud.engine.model import LlamaModel
from apiary.cloud.engine.outputs import RequestMetrics
from apiary.cloud.engine.sampling_params import SamplingParams
from apiary.cloud.engine.sequence import Sequence
from apiary.cloud.engine.spec import SpeculativeConfig, rejection
from apiary.cloud.engine.spec.draft import DraftProposer
from apiary.cloud.engine.spec.ngram import NgramHistory, NgramIndex, NgramProposer
from apiary.cloud.engine.spec.policy import AdaptivePolicy, StepCosts, expected_tokens
from apiary.cloud.engine.spec.rejection import verify
from apiary.cloud.engine.spec.batching import Entry, build_inputs


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit; cells with tiny expected counts are pooled into one."""
    n = observed.sum()
    expected = expected_probs.double() * n
    small = expected < min_expected
    obs = torch.cat((observed[~small].double(), observed[small].double().sum()[None]))
    exp = torch.cat((expected[~small], expected[small].sum()[None]))
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    assert dof >= 2, "too few cells for a meaningful test"
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


# ---------------------------------------------------------------- rejection rule

VOCAB = 8


def _first_token_counts(p: torch.Tensor, q: torch.Tensor | None, k: int, n: int, seed: int) -> torch.Tensor:
    """Emit one verification step for ``n`` independent rows; count the first emitted token.

    p ``[k+1, V]`` target distributions, q ``[k, V]`` draft distributions (None: point-mass proposals
    that always propose token 0, then 1, ...). Draft tokens are drawn from q as a real draft would.
    """
    g = torch.Generator().manual_seed(seed)
    logits = p.log()[None].expand(n, -1, -1).contiguous()
    if q is None:
        drafts = torch.arange(k)[None].expand(n, -1).contiguous()
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(k)], dim=1)
        draft_probs = q[None].expand(n, -1, -1).contiguous()
    params = [SamplingParams(temperature=1.0)] * n
    gens = [torch.Generator().manual_seed(seed * 100_003 + i) for i in range(n)]
    verdicts = verify(logits, drafts, torch.full((n,), k), draft_probs, params, gens)
    return torch.bincount(torch.tensor([v.tokens[0] for v in verdicts]), minlength=VOCAB)


def _dists(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(3, VOCAB, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(2, VOCAB, generator=g) * 1.5, -1)
    return p, q


@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_sampling_first_token_follows_target(point_mass: bool) -> None:
    p, q = _dists(1)
    counts = _first_token_counts(p, None if point_mass else q, k=2, n=12_000, seed=3)
    assert chi_square_pvalue(counts, p[0]) > 1e-3


def test_chi_square_catches_a_verifier_that_skips_the_residual(monkeypatch) -> None:
    """The same test must fail for the classic bug: resampling from p instead of max(0, p - q)."""
    p, q = _dists(1)
    monkeypatch.setattr(rejection, "residual_probs", lambda p, q: p)
    counts = _first_token_counts(p, q, k=2, n=12_000, seed=3)
    assert chi_square_pvalue(counts, p[0]) < 1e-6


@pytest.mark.parametrize("proposal", ["point_mass", "draft_seeded"])
def test_replay_emits_plain_decodings_tokens_and_random_stream(proposal: str) -> None:
    """n-gram proposals and seeded rows: the tokens plain decoding draws from the same seed, kept while the
    drafts agree, and the generator left where plain decoding leaves it (one race per emitted token)."""
    from apiary.cloud.engine.sampling import draw, race_noise

    k = 3
    p = torch.softmax(torch.randn(k + 1, VOCAB, generator=torch.Generator().manual_seed(4)), -1)
    q = torch.softmax(torch.randn(k, VOCAB, generator=torch.Generator().manual_seed(5)), -1)
    pick = random.Random(0)
    kept = set()
    for seed in range(300):
        plain_g = torch.Generator().manual_seed(seed)
        plain = [int(draw(p[j][None], [plain_g])) for j in range(k + 1)]
        drafts = [t if pick.random() < 0.6 else pick.randrange(VOCAB) for t in plain[:k]]
        g = torch.Generator().manual_seed(seed)
        params = SamplingParams(temperature=1.0, seed=seed if proposal == "draft_seeded" else None)
        verdict = verify(p.log()[None], torch.tensor([drafts]), torch.tensor([k]),
                         None if proposal == "point_mass" else q[None], [params], [g])[0]
        n = next((j for j in range(k) if drafts[j] != plain[j]), k)
        assert (verdict.tokens, verdict.num_accepted) == (plain[:n + 1], n)
        kept.add(n)
        reference = torch.Generator().manual_seed(seed)
        for _ in range(n + 1):
            race_noise(VOCAB, reference)
        assert torch.equal(g.get_state(), reference.get_state())
    assert kept == set(range(k + 1))  # every outcome, from an immediate disagreement to the bonus token


def test_chi_square_catches_an_over_eager_acceptance(monkeypatch) -> None:
    p, q = _dists(1)
    monkeypatch.setattr(rejection, "accepted", lambda p_x, q_x, u: u * q_x < 1.5 * p_x)
    counts = _first_token_counts(p, q, k=2, n=12_000, seed=3)
    assert chi_square_pvalue(counts, p[0]) < 1e-6


def test_greedy_is_prefix_matching() -> None:
    logits = torch.full((3, 4, VOCAB), -5.0)
    best = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 0]])
    logits.scatter_(2, best[:, :, None], 5.0)
    drafts = torch.tensor([[1, 2, 0], [1, 2, 3], [5, 0, 0]])
    gens = [torch.Generator() for _ in range(3)]
    out = verify(logits, drafts, torch.tensor([3, 3, 1]), None, [SamplingParams()] * 3, gens)
    assert [v.tokens for v in out] == [[1, 2, 3], [1, 2, 3, 4], [5, 6]]
    assert [v.num_accepted for v in out] == [2, 3, 1]


def test_rows_past_num_draft_are_ignored_and_mixed_rows_work() -> None:
    """Row 0 (greedy) proposes 1 of a padded 3; row 1 samples with a certain target: accepts only the match."""
    logits = torch.full((2, 4, VOCAB), -30.0)
    logits[0, :, 2] = 10.0  # greedy target: always 2
    logits[1, :, 3] = 10.0  # sampled target: practically always 3
    drafts = torch.tensor([[2, 2, 2], [3, 3, 5]])
    gens = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    out = verify(logits, drafts, torch.tensor([1, 3]), None, [SamplingParams(), SamplingParams(temperature=1.0)], gens)
    assert out[0].tokens == [2, 2] and out[0].num_accepted == 1
    assert out[1].tokens == [3, 3, 3] and out[1].num_accepted == 2  # 5 rejected, resampled from p without 5


def test_zero_proposals_emit_one_target_token() -> None:
    logits = torch.randn(2, 1, VOCAB, generator=torch.Generator().manual_seed(6))
    out = verify(logits, torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long), None,
                 [SamplingParams(), SamplingParams(temperature=0.7, top_k=3, seed=1)], [torch.Generator()] * 2)
    assert out[0].tokens == [int(logits[0, 0].argmax())] and out[1].num_accepted == 0
    assert out[1].tokens[0] in logits[1, 0].topk(3).indices.tolist()


def test_residual_of_identical_distributions_falls_back_to_p() -> None:
    p = torch.softmax(torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(7)), -1)
    res = rejection.residual_probs(p, p.clone())
    assert torch.allclose(res, p)


def test_sampling_probs_match_the_engine_sampler() -> None:
    """top-k / top-p masks and temperature as the engine's sampler applies them (empirically, same seed noise)."""
    from apiary.cloud.engine.sampling import Row, sample, sampling_probs

    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    params = SamplingParams(temperature=1.5, top_k=6, top_p=0.9, seed=0)
    probs = sampling_probs(logits, [params])[0]
    assert 3 <= int((probs > 0).sum()) <= 6  # both masks bite
    seq = Sequence("r", 0, [0], 1, params, 0, RequestMetrics(0.0), generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(torch.tensor([sample(logits.clone(), [Row(seq)], [seq.generator])[0][0]
                                          for _ in range(4000)]),
                            minlength=VOCAB)
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(torch.nonzero(probs).flatten().tolist())
    assert chi_square_pvalue(counts, probs) > 1e-3


# ---------------------------------------------------------------- n-gram lookup


def test_ngram_prefers_the_longest_then_latest_match() -> None:
    index = NgramIndex(1, 3)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 1, 2, 3, 9, 1, 2, 7, 4, 1, 2]
    assert index.propose(tokens, 3) == [7, 4, 1]  # "1 2" last seen at 5..6, followed by 7 4 1
    tokens = [5, 1, 2, 3, 9, 8, 2, 7, 4, 1, 2]
    assert NgramIndex(1, 3).propose(tokens, 2) == [3, 9]  # "1 2" only at 1..2 beats the later "2" at 6
    assert NgramIndex(1, 3).propose([1, 2, 3, 4], 4) == []  # nothing repeats
    assert NgramIndex(2, 3).propose([1, 2, 1], 2) == []  # single-token matches disabled


def _brute_force(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    length = len(tokens)
    for n in range(min(hi, length), lo - 1, -1):
        suffix = tokens[length - n:]
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                return tokens[end:end + k]
    return []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(0, 5), st.integers(1, 6))
def test_incremental_ngram_index_matches_brute_force(tokens: list[int], k: int, cut: int) -> None:
    index = NgramIndex(1, 3)
    for upto in range(1, len(tokens) + 1, cut):  # the index grows as text arrives
        index.propose(tokens[:upto], k)
    assert index.propose(tokens, k) == _brute_force(tokens, k, 1, 3)


def test_history_of_finished_outputs_feeds_other_requests() -> None:
    proposer = NgramProposer(1, 3, history_tokens=1000)
    prompt = [7, 8, 9]  # the shared prompt tail, e.g. '{"assessment": "'
    proposer.finish("old", prompt + [1, 2, 3, 4, 5], num_prompt_tokens=3)
    assert proposer.propose("new", [50, 51, 7, 8, 9], 4) == [1, 2, 3, 4]  # matched through the prompt context
    # The sequence's own longer match beats a shorter history match ...
    own = [5, 6, 2, 3, 99, 40, 5, 6, 2, 3]
    proposer.finish("other", [60, 2, 3, 11, 12], num_prompt_tokens=1)
    assert proposer.propose("own", own, 2) == [99, 40]
    # ... and on equal length the history (real answers) wins over the prompt.
    assert proposer.propose("tie", [2, 3, 77, 2, 3], 2) == [11, 12]


def test_history_forgets_the_oldest_past_capacity_and_can_freeze() -> None:
    history = NgramHistory(1, 2, capacity=8)
    history.add([1, 2, 3, 4])
    history.add([5, 6, 7, 8])
    assert history.match([3])[0] == 1
    history.add([9, 10, 11])  # 11 tokens > 8: [1, 2, 3, 4] goes
    assert history.match([3]) == (0, [], 0) and history.num_tokens == 7
    assert history.match([6])[1] == [5, 6, 7, 8]
    history.frozen = True
    history.add([20, 21])
    assert history.match([20]) == (0, [], 0)
    assert all(text_id in history.texts for text_id, _ in history.last_end.values())


# ---------------------------------------------------------------- policy


def test_expected_tokens_matches_simulation() -> None:
    rng = random.Random(0)
    for a, k in ((0.3, 2), (0.7, 4), (0.9, 3)):
        sims = []
        for _ in range(20_000):
            n = 0
            while n < k and rng.random() < a:
                n += 1
            sims.append(n + 1)
        assert abs(sum(sims) / len(sims) - expected_tokens(a, k)) < 0.05


def costs_from(times: dict[int, float], prior: float = 0.05) -> StepCosts:
    costs = StepCosts(prior_token_cost=prior, prior_draft_cost=0.5)
    for n, t in times.items():
        costs.observe(n, t)
    return costs


def test_step_costs_interpolate_and_extrapolate() -> None:
    costs = costs_from({1: 1.0, 5: 2.0})
    assert costs.step_time(1) == 1.0 and costs.step_time(3) == 1.5
    assert costs.step_time(7) == pytest.approx(2.0 * (1 + 0.05 * 2))
    costs.observe(5, 3.0)  # EWMA, not overwrite
    assert 2.0 < costs.step_time(5) < 3.0
    assert StepCosts(0.1, 0.5).step_time(3) == pytest.approx(1.2)  # nothing measured: the prior alone


def test_policy_speculates_when_extra_positions_are_cheap() -> None:
    policy = AdaptivePolicy(4, 16, 0.3, 0.8, costs_from({n: 1.0 + 0.01 * n for n in range(1, 40)}))
    assert policy.choose(["a"], [4], 1) == [4]
    assert policy.choose(["a", "b"], [4, 2], 2) == [4, 2]  # limits respected


def test_policy_switches_off_when_the_step_is_compute_bound() -> None:
    """Time proportional to tokens: every verified position costs a token's worth, so nothing pays."""
    policy = AdaptivePolicy(4, 64, 0.3, 0.9, costs_from({n: float(n) for n in range(1, 200)}))
    assert policy.choose([f"s{i}" for i in range(32)], [4] * 32, 32) == [0] * 32


def test_policy_pays_the_gemv_to_gemm_jump_only_for_good_acceptance() -> None:
    """One token 1.0, two or more 2.0 (a CPU quirk): k=4 needs E[tokens] > 2, i.e. high acceptance."""
    times = {1: 1.0, **{n: 2.0 for n in range(2, 10)}}
    assert AdaptivePolicy(4, 16, 0.3, 0.9, costs_from(times)).choose(["a"], [4], 1) == [4]
    assert AdaptivePolicy(4, 16, 0.3, 0.4, costs_from(times)).choose(["a"], [4], 1) == [0]


def test_policy_gives_longer_lookahead_to_better_sequences_and_respects_max_batch() -> None:
    times = {n: 1.0 + 0.12 * n for n in range(1, 40)}
    policy = AdaptivePolicy(4, 2, 0.5, 0.6, costs_from(times))
    for _ in range(8):
        policy.update("good", 4, 4)
        policy.update("bad", 4, 0)
    ks = policy.choose(["good", "bad"], [4, 4], 2)
    assert ks[0] > ks[1]
    assert policy.choose(["good", "bad", "c"], [4, 4, 4], 3) == [0, 0, 0]  # more than max_batch decode


def test_idle_sequences_drift_back_to_the_prior() -> None:
    policy = AdaptivePolicy(4, 16, 0.5, 0.8, costs_from({1: 1.0, **{n: 2.0 for n in range(2, 10)}}))
    for _ in range(10):
        policy.update("s", 4, 0)
    collapsed = policy.acceptance("s")
    assert collapsed < 0.01 and policy.choose(["s"], [4], 1) == [0]
    idle = 0
    while policy.choose(["s"], [4], 1) == [0]:
        idle += 1
        assert idle < 100, "never retried"
    assert idle > 5 and collapsed < policy.acceptance("s") < 0.8


def test_a_stale_step_time_is_reprobed() -> None:
    """Sizes measured during a load spike switch speculation off, but every PROBE_EVERY steps it is retried."""
    from apiary.cloud.engine.spec.policy import PROBE_EVERY

    policy = AdaptivePolicy(4, 16, 0.3, 0.9, costs_from({1: 1.0, **{n: 100.0 for n in range(2, 10)}}))
    decisions = [policy.choose(["a"], [4], 1) for _ in range(3 * PROBE_EVERY + 3)]
    probes = [i for i, ks in enumerate(decisions) if ks != [0]]
    assert probes == [PROBE_EVERY, 2 * PROBE_EVERY + 1, 3 * PROBE_EVERY + 2]


def test_draft_time_counts_against_speculation() -> None:
    cheap = {n: 1.0 for n in range(1, 10)}
    policy = AdaptivePolicy(4, 16, 0.3, 0.5, costs_from(cheap))
    assert policy.choose(["a"], [4], 1) != [0]
    policy.uses_draft = True
    policy.costs.observe_draft(1, 0.9)  # a draft pass nearly as slow as the target
    assert policy.choose(["a"], [4], 1) == [0]


def test_config_validates() -> None:
    with pytest.raises(EngineError):
        SpeculativeConfig(method="medusa")
    with pytest.raises(EngineError):
        SpeculativeConfig(k=0)
    with pytest.raises(EngineError):
        SpeculativeConfig(method="ngram", draft_num_layers=2)
    with pytest.raises(EngineError):
        SpeculativeConfig(method="draft", draft_num_layers=0)


# ---------------------------------------------------------------- draft proposer on a tiny random model

TINY = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, max_position=256, tie_word_embeddings=True)


def tiny_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    c = config

    def r(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    w = {"model.embed_tokens.weight": r(c.vocab_size, c.hidden_size, scale=1.0), "model.norm.weight": 1 + r(c.hidden_size)}
    kv = c.num_kv_heads * c.head_dim
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + r(c.hidden_size), p + "post_attention_layernorm.weight": 1 + r(c.hidden_size),
              p + "self_attn.q_proj.weight": r(c.num_heads * c.head_dim, c.hidden_size),
              p + "self_attn.k_proj.weight": r(kv, c.hidden_size), p + "self_attn.v_proj.weight": r(kv, c.hidden_size),
              p + "self_attn.o_proj.weight": r(c.hidden_size, c.num_heads * c.head_dim),
              p + "mlp.gate_proj.weight": r(c.intermediate_size, c.hidden_size),
              p + "mlp.up_proj.weight": r(c.intermediate_size, c.hidden_size),
              p + "mlp.down_proj.weight": r(c.hidden_size, c.intermediate_size)}
    return w


def tiny_model() -> LlamaModel:
    return LlamaModel(TINY, tiny_weights(TINY), torch.device("cpu"), torch.float32, max_positions=256)


@torch.inference_mode()
def reference_greedy(model: LlamaModel, tokens: list[int], k: int) -> list[int]:
    """k greedy tokens by re-running the whole text from an empty cache each time (no incremental state)."""
    out = []
    for _ in range(k):
        text = tokens + out
        blocks = -(-len(text) // 4)
        caches = KVPool(TINY.num_layers, blocks, 4, 2, 8, torch.float32, torch.device("cpu")).layers
        inputs = build_inputs([Entry(text, 0, list(range(blocks)))], 4, torch.device("cpu"))
        hidden = model.forward(inputs.input_ids, inputs.positions, inputs.meta, caches)
        out.append(int(model.logits(hidden[-1:]).argmax()))
    return out


def make_seq(tokens: list[int], i: int = 0, params: SamplingParams | None = None) -> Sequence:
    return Sequence(f"r{i}", i, list(tokens), len(tokens), params or SamplingParams(), 0, RequestMetrics(0.0))


def test_draft_proposals_equal_full_recompute_through_catch_up_and_rollback() -> None:
    model = tiny_model()
    draft = DraftProposer(model, num_blocks=64, block_size=4)
    rng = random.Random(0)
    seqs = [make_seq([rng.randrange(32) for _ in range(n)], i) for i, n in enumerate((1, 6, 13))]
    gens = [torch.Generator() for _ in seqs]
    for round_ in range(4):
        ks = [3, 1 + round_ % 3, 2]
        proposal = draft.propose(seqs, ks, gens)
        assert proposal.probs is None  # all greedy
        for seq, k, got in zip(seqs, ks, proposal.tokens):
            assert got in ([], reference_greedy(model, seq.token_ids, k))
        # Verification outcome: keep a prefix of the drafts plus one "target" token, then roll back.
        for seq, got in zip(seqs, proposal.tokens):
            if not got:
                seq.token_ids.append(rng.randrange(32))  # decoded without speculation
                continue
            keep = rng.randrange(len(got) + 1)
            old_len = seq.num_tokens
            computed = draft.states[seq].num_computed_tokens
            assert computed == old_len + len(got) - 1  # the last draft token is proposed, never run
            seq.token_ids.extend(got[:keep] + [rng.randrange(32)])
            draft.rollback(seq, old_len + keep)
            assert draft.states[seq].num_computed_tokens == min(computed, old_len + keep)
            assert len(draft.states[seq].block_table) == -(-draft.states[seq].num_computed_tokens // 4)
    for seq in seqs:
        draft.drop(seq)
    assert draft.bm.num_free_blocks == draft.bm.num_blocks


def test_draft_catch_up_is_bounded_per_step(monkeypatch) -> None:
    from apiary.cloud.engine.spec import draft as draft_module

    monkeypatch.setattr(draft_module, "CATCH_UP_TOKENS", 20)
    draft = DraftProposer(tiny_model(), num_blocks=64, block_size=4)
    seqs = [make_seq([1 + i] + list(range(2, 13)), i) for i in range(3)]  # 12 prompt tokens each
    first = draft.propose(seqs, [2, 2, 2], [torch.Generator()] * 3)
    assert [bool(t) for t in first.tokens] == [True, False, False]  # 12 + 12 > 20: one new sequence
    seqs[0].token_ids += first.tokens[0][:1] + [9]
    draft.rollback(seqs[0], seqs[0].num_tokens - 1)
    second = draft.propose(seqs, [2, 2, 2], [torch.Generator()] * 3)
    assert [bool(t) for t in second.tokens] == [True, True, False]


def test_draft_shares_cached_prefix_blocks_and_survives_a_full_cache() -> None:
    model = tiny_model()
    draft = DraftProposer(model, num_blocks=6, block_size=4)
    shared = list(range(1, 10))  # two full blocks + 1
    a, b = make_seq(shared + [20, 21], 0), make_seq(shared + [22], 1)
    gens = [torch.Generator()]
    assert draft.propose([a], [2], gens).tokens[0] == reference_greedy(model, a.token_ids, 2)
    a.token_ids.extend([5])
    draft.rollback(a, a.num_tokens - 1)  # commits a's full blocks to the draft's prefix cache
    got = draft.propose([b], [2], gens).tokens[0]
    assert got == reference_greedy(model, b.token_ids, 2)
    assert draft.states[b].block_table[:2] == draft.states[a].block_table[:2]  # prefix reused, not recomputed
    big = make_seq(list(range(30)), 2)
    assert draft.propose([big], [3], gens).tokens == [[]]  # no room: no proposal, no crash
    for s in (a, b, big):
        draft.drop(s)
    assert draft.bm.num_free_blocks == draft.bm.num_blocks


def test_draft_sampled_rows_return_their_distributions() -> None:
    model = tiny_model()
    draft = DraftProposer(model, num_blocks=32, block_size=4)
    seqs = [make_seq([1, 2, 3], 0, SamplingParams(temperature=1.0, seed=0)), make_seq([4, 5], 1)]
    gens = [torch.Generator().manual_seed(0), torch.Generator()]
    out = draft.propose(seqs, [2, 3], gens)
    assert out.probs is not None and out.probs.shape == (2, 3, 32)
    assert torch.allclose(out.probs[0, :2].sum(-1), torch.ones(2)) and out.probs[1].abs().sum() == 0
    assert all(out.probs[0, j, t] > 0 for j, t in enumerate(out.tokens[0]))
    assert out.tokens[1] == reference_greedy(model, [4, 5], 3)


def test_new_sequences_start_from_what_recent_ones_achieved() -> None:
    times = {1: 1.0, **{n: 2.0 for n in range(2, 10)}}
    policy = AdaptivePolicy(4, 16, 0.3, 0.6, costs_from(times))
    for i in range(60):  # a free-text workload: nothing is ever accepted
        policy.update(f"old{i}", 4, 0)
    assert policy.acceptance("new") < 0.05 and policy.choose(["new"], [4], 1) == [0]
    low = policy.prior
    for quiet in range(300):  # nobody speculates: the prior recovers, and speculation is tried again
        if policy.choose(["new"], [4], 1) != [0]:
            break
    assert quiet < 299 and policy.prior > low
