"""Speculative verification: which draft tokens the target keeps, and the token it adds.

The standard rule (Leviathan et al. 2023, Chen et al. 2023): draft token x drawn from q is
accepted with probability min(1, p(x)/q(x)); at the first rejection the target's token is
drawn from the normalised residual max(0, p - q); when all k are accepted a bonus token is
drawn from p at the next position. Every emitted token then follows p exactly. An n-gram
proposal is a point mass (q(x) = 1), so it is kept with probability p(x) and the residual is p
without x. Greedy requests reduce to prefix matching against the target's argmax.

One call verifies a whole batch as padded tensor ops; only the random draws loop over rows,
each from its request's own generator so a seeded request is reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cloud.engine.sampling_params import SamplingParams
from cloud.engine.sampling import TokenLogprob, draw, sampling_probs


@dataclass(slots=True)
class Verdict:
    tokens: list[int]  # the accepted draft tokens, then the target's own token: 1..k+1 tokens
    num_accepted: int  # draft tokens kept
    logprobs: list[TokenLogprob | None] | None = None  # per token, for requests that asked (set by the speculator)


def accepted(p_x: torch.Tensor, q_x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Keep draft token x iff u < p(x) / q(x) with u ~ U[0, 1) (written without a division)."""
    return u * q_x < p_x


def residual_probs(p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """The distribution to resample from after rejecting ``x``: normalised max(0, p - q) per row.

    ``q`` None means point-mass proposals (n-gram): the residual is p with x removed. A row whose
    residual vanishes (p == q up to rounding, so a rejection was a rounding artefact) falls back to p.
    """
    res = p.scatter(1, x[:, None], 0.0) if q is None else (p - q).clamp_(min=0.0)
    total = res.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, res / total.clamp(min=1e-30), p)


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
        best = target_logits[rows].argmax(dim=-1)  # [G, K+1]
        ok = (best[:, :k] == draft_tokens[rows]) & valid[rows]
        n = ok.long().cumprod(dim=1).sum(dim=1)
        num_acc[rows] = n
        out_tokens[rows] = best.gather(1, n[:, None])[:, 0]

    rows = torch.nonzero(~greedy).flatten()
    if rows.numel():
        row_list = rows.tolist()
        row_params = [params[i] for i in row_list]
        gens = [generators[i] for i in row_list]
        p = sampling_probs(target_logits[rows].reshape(-1, vocab),
                           [rp for rp in row_params for _ in range(kp1)]).view(len(row_list), kp1, vocab)
        x = draft_tokens[rows]
        p_x = p[:, :k].gather(2, x[:, :, None])[:, :, 0]
        q = None if draft_probs is None else draft_probs[rows].to(dev).float()
        q_x = torch.ones_like(p_x) if q is None else q.gather(2, x[:, :, None])[:, :, 0]
        u = torch.stack([torch.rand(k, generator=g) for g in gens]).to(dev)
        ok = accepted(p_x, q_x, u) & valid[rows]
        n = ok.long().cumprod(dim=1).sum(dim=1)  # leading accepts
        at = n[:, None, None].expand(-1, 1, vocab)
        p_at = p.gather(1, at)[:, 0]  # target distribution at the first rejection / bonus position
        rejected = n < num_draft[rows]
        final = p_at
        if bool(rejected.any()):  # then k >= 1; rows that were not rejected clamp to a harmless index
            x_at = x.gather(1, n.clamp(max=k - 1)[:, None])[:, 0]
            q_at = None if q is None else q.gather(1, at.clamp(max=k - 1))[:, 0]
            final = torch.where(rejected[:, None], residual_probs(p_at, q_at, x_at), p_at)
        num_acc[rows] = n
        out_tokens[rows] = draw(final, gens)

    drafts, counts, finals = draft_tokens.tolist(), num_acc.tolist(), out_tokens.tolist()
    return [Verdict(tokens=drafts[i][:counts[i]] + [finals[i]], num_accepted=counts[i]) for i in range(b)]
