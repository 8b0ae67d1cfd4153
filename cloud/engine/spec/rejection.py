"""Speculative verification: which draft tokens the target keeps, and the token it adds.

Two rules, both exact (every emitted token follows the target's distribution p):

* **Replay** (greedy rows, n-gram proposals, and every seeded row): position by position, the
  target draws its token exactly as plain decoding would (argmax for greedy, the exponential
  race with one ``race_noise`` from the request's generator when sampled), keeps the draft
  token while they agree and emits its own at the first disagreement (or the bonus position).
  The emitted text and the generator's state are then those of plain decoding, token for
  token, whatever k, the batch or the proposer. For a point-mass proposal (n-gram) a draft
  token is kept with probability p(x), exactly as often as under the rule below.
* **Rejection sampling** (unseeded rows with a draft model's q; Leviathan et al. 2023, Chen et
  al. 2023): keep draft token x with probability min(1, p(x)/q(x)), at the first rejection draw
  from the normalised residual max(0, p - q), after k acceptances a bonus token from p. It keeps
  more draft tokens than replaying the race against q can, but consumes extra uniforms and
  its output depends on where the proposals start and stop, so a seed could not pin it.

Greedy rows are verified as padded tensor ops; the random draws loop over rows, each from its
request's own generator.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from apiary.cloud.engine.sampling_params import SamplingParams
from apiary.cloud.engine.sampling import TokenLogprob, argmax_rows, draw, race, race_noise, sampling_probs


@dataclass(slots=True)
class Verdict:
    tokens: list[int]  # the accepted draft tokens, then the target's own token: 1..k+1 tokens
    num_accepted: int  # draft tokens kept
    logprobs: list[TokenLogprob | None] | None = None  # per token, for requests that asked (set by the speculator)


def accepted(p_x: torch.Tensor, q_x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Keep draft token x iff u < p(x) / q(x) with u ~ U[0, 1) (written without a division)."""
    return u * q_x < p_x


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution to resample from after a rejection: normalised max(0, p - q) per row.

    A row whose residual vanishes (p == q up to rounding, so a rejection was a rounding artefact)
    falls back to p.
    """
    res = (p - q).clamp_(min=0.0)
    total = res.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, res / total.clamp(min=1e-30), p)


def replay(p: torch.Tensor, drafts: list[int], generator: torch.Generator) -> tuple[int, int]:
    """Plain decoding's draws at each position of ``p`` ``[len(drafts) + 1, V]``, kept while they equal the
    drafts: (drafts kept, the target's own token). One ``race_noise`` per emitted token, as plain decoding."""
    vocab = p.shape[-1]
    for j in range(len(drafts) + 1):
        token = int(race(p[j], race_noise(vocab, generator)))
        if j == len(drafts) or token != drafts[j]:
            return j, token
    raise AssertionError("unreachable: the bonus position always emits")


def rejection_sample(p: torch.Tensor, x: torch.Tensor, num_draft: torch.Tensor, q: torch.Tensor,
                     generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard rule for rows proposed from q: (drafts kept ``[B]``, the target's token ``[B]``).

    p ``[B, K+1, V]`` target distributions, x ``[B, K]`` proposals, num_draft ``[B]``, q ``[B, K, V]``.
    """
    b, kp1, vocab = p.shape
    k = kp1 - 1
    dev = p.device
    valid = torch.arange(k, device=dev)[None, :] < num_draft[:, None]
    p_x = p[:, :k].gather(2, x[:, :, None])[:, :, 0]
    q_x = q.gather(2, x[:, :, None])[:, :, 0]
    u = torch.stack([torch.rand(k, generator=g) for g in generators]).to(dev)
    n = (accepted(p_x, q_x, u) & valid).long().cumprod(dim=1).sum(dim=1)  # leading accepts
    at = n[:, None, None].expand(-1, 1, vocab)
    p_at = p.gather(1, at)[:, 0]  # target distribution at the first rejection / bonus position
    rejected = n < num_draft
    final = p_at
    if bool(rejected.any()):  # then k >= 1; rows that were not rejected clamp to a harmless index
        q_at = q.gather(1, at.clamp(max=k - 1))[:, 0]
        final = torch.where(rejected[:, None], residual_probs(p_at, q_at), p_at)
    return n, draw(final, generators)


def verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor, num_draft: torch.Tensor,
           draft_probs: torch.Tensor | None, params: list[SamplingParams],
           generators: list[torch.Generator]) -> list[Verdict]:
    """Verify a padded batch of proposals.

    target_logits ``[B, K+1, V]``: the target at each draft position and one past the last, already
    through ``sampling.process`` (penalties, grammar mask: what the plain step applies too);
    draft_tokens ``[B, K]`` (int64, padding arbitrary), num_draft ``[B]`` (0..K, rows may differ);
    draft_probs ``[B, K, V]`` the draft's distributions under the same sampling transforms, or
    None for point-mass proposals. Rows past ``num_draft[b]`` are ignored.
    """
    b, kp1, vocab = target_logits.shape
    k = kp1 - 1
    dev = target_logits.device
    draft_tokens = draft_tokens.to(dev)
    num_draft = num_draft.to(dev)
    positions = torch.arange(k, device=dev)
    valid = positions[None, :] < num_draft[:, None]  # [B, K]
    greedy = torch.tensor([p.greedy for p in params], device=dev)
    out_tokens = torch.empty(b, dtype=torch.long, device=dev)
    num_acc = torch.zeros(b, dtype=torch.long, device=dev)

    rows = torch.nonzero(greedy).flatten()
    if rows.numel():  # prefix match against the target's argmax
        best = argmax_rows(target_logits[rows])  # [G, K+1]
        ok = (best[:, :k] == draft_tokens[rows]) & valid[rows]
        n = ok.long().cumprod(dim=1).sum(dim=1)
        num_acc[rows] = n
        out_tokens[rows] = best.gather(1, n[:, None])[:, 0]

    sampled = torch.nonzero(~greedy).flatten().tolist()
    if sampled:
        p = sampling_probs(target_logits[sampled].reshape(-1, vocab),
                           [params[i] for i in sampled for _ in range(kp1)]).view(len(sampled), kp1, vocab)
        proposed, counts = draft_tokens[sampled].tolist(), num_draft.tolist()
        rejection = []
        for j, i in enumerate(sampled):
            if draft_probs is None or params[i].seed is not None:
                num_acc[i], out_tokens[i] = replay(p[j], proposed[j][:counts[i]], generators[i])
            else:
                rejection.append(j)
        if rejection:
            rows = [sampled[j] for j in rejection]
            n, tokens = rejection_sample(p[rejection], draft_tokens[rows], num_draft[rows],
                                         draft_probs[rows].to(dev).float(), [generators[i] for i in rows])
            num_acc[rows] = n
            out_tokens[rows] = tokens

    drafts, counts, finals = draft_tokens.tolist(), num_acc.tolist(), out_tokens.tolist()
    return [Verdict(tokens=drafts[i][:counts[i]] + [finals[i]], num_accepted=counts[i]) for i in range(b)]
