"""The one sampling path: logits -> processed logits -> distribution -> token (+ logprobs).

Every place that turns logits into a token calls these functions: the plain step, speculative
verification (the target's distribution at every draft position) and the draft model's own
proposals. Lossless speculation needs the target and the draft under *the same* transforms,
so there is exactly one copy of them. In order, as vLLM applies them:

1. ``process``: per-request logits processors, batched (one call per step for all rows that
   carry them): ``logit_bias``, repetition / presence / frequency penalties, the caller's own
   processors, the grammar's allowed-token bitmask, then ``min_tokens`` (end tokens masked,
   unless that would leave the row nothing: a complete grammar allows only the end).
2. temperature (greedy rows keep their logits; their argmax is the token).
3. ``probs``: top-k, top-p, min-p truncation, softmax.
4. ``draw``: the exponential race (argmax of p / E, E ~ Exp(1)) draws from p exactly, each row
   with its own generator, so a seeded request samples the same tokens whatever its batch.
   Every sampled token consumes exactly one ``race_noise`` (V exponentials) from its request's
   generator, in order, on every path: speculative verification replays the race position by
   position (``spec/rejection.py``), so speculation never changes a seeded request's tokens.

Reported logprobs come from the distribution after step 2 and before step 3 (vLLM's
"processed logprobs"): with a grammar, the chosen token's probability among the tokens the
grammar allowed, which is what the edge reports as its "choice" logprob.

A *row* is one position to sample at: a sequence plus the tokens drafted past its last real
token (verification and draft proposals score several positions of one sequence at once).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence as Seq

import numpy as np
import torch

from apiary.cloud.engine.sampling_params import SamplingParams
from apiary.cloud.engine.sequence import Sequence

NEG_INF = float("-inf")


class LogitsProcessor(Protocol):
    """A per-request logits processor, called once per step with every row that carries it.

    ``logits`` ``[n, V]`` (float32) are those rows' logits; ``output_token_ids[i]`` is what row i
    generated so far (drafted tokens included). Return the new logits (in place is fine).
    """

    def __call__(self, logits: torch.Tensor, output_token_ids: list[list[int]]) -> torch.Tensor: ...


@dataclass(slots=True, frozen=True)
class Row:
    """One sampling position: ``seq``'s tokens followed by ``drafted`` speculative tokens."""

    seq: Sequence
    drafted: tuple[int, ...] = ()

    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.drafted)

    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + list(self.drafted)


@dataclass(slots=True)
class TokenLogprob:
    """A generated token's logprob and, on request, the most likely alternatives (id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


# ------------------------------------------------------------------ 1. processing


_BYTE_BITS = torch.tensor([[(b >> j) & 1 for j in range(8)] for b in range(256)], dtype=torch.bool)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf where the packed allowed-token ``bitmask`` ``[n, ceil(V/32)]`` (int32, bit j of word w = token
    32w + j) has a 0 bit. Unpacked a byte at a time through a 256 x 8 table (little-endian words)."""
    vocab = logits.shape[-1]
    table = _BYTE_BITS.to(logits.device)
    raw = bitmask.contiguous().view(torch.uint8).to(logits.device)  # [n, 4W], byte k holds tokens 8k..8k+7
    allowed = table[raw.long()].flatten(1)[:, :vocab]
    if allowed.shape[1] < vocab:  # tokens past the grammar's vocabulary (padding rows of the head)
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return logits.masked_fill_(~allowed, NEG_INF)


def _counts(rows: list[Row], index: list[int], vocab: int, device: torch.device, prompt: bool) -> torch.Tensor:
    """``[len(index), V]`` occurrence counts of each row's output tokens (plus prompt tokens if ``prompt``)."""
    counts = torch.zeros(len(index), vocab, device=device)
    for j, i in enumerate(index):
        ids = rows[i].seq.token_ids + list(rows[i].drafted) if prompt else rows[i].output_token_ids()
        if ids:
            t = torch.tensor(ids, device=device)
            counts[j].scatter_add_(0, t, torch.ones(len(ids), device=device))
    return counts


def process(logits: torch.Tensor, rows: Seq[Row], stop_token_ids: Seq[int] = (),
            bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-request logits processing for ``logits`` ``[N, V]`` (float32, modified in place and returned).

    ``stop_token_ids``: the model's end-of-generation ids (masked while a row is under ``min_tokens``).
    ``bitmask``: ``[N, W]`` allowed-token bitmask of the grammar rows (rows without one all ones), or None.
    """
    rows = list(rows)
    vocab = logits.shape[-1]
    dev = logits.device
    for i, row in enumerate(rows):
        bias = row.params.logit_bias
        if bias:
            ids = torch.tensor(list(bias), device=dev)
            logits[i].index_add_(0, ids, torch.tensor(list(bias.values()), device=dev, dtype=logits.dtype))
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        seen = _counts(rows, rep, vocab, dev, prompt=True) > 0
        penalty = torch.tensor([rows[i].params.repetition_penalty for i in rep], device=dev)[:, None]
        sub = logits[rep]
        scaled = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits[rep] = torch.where(seen, scaled, sub)
    pen = [i for i, r in enumerate(rows) if r.params.presence_penalty or r.params.frequency_penalty]
    if pen:
        counts = _counts(rows, pen, vocab, dev, prompt=False)
        freq = torch.tensor([rows[i].params.frequency_penalty for i in pen], device=dev)[:, None]
        pres = torch.tensor([rows[i].params.presence_penalty for i in pen], device=dev)[:, None]
        logits[pen] -= freq * counts + pres * (counts > 0)
    groups: dict[int, tuple[LogitsProcessor, list[int]]] = {}
    for i, row in enumerate(rows):
        for proc in row.params.logits_processors:
            groups.setdefault(id(proc), (proc, []))[1].append(i)
    for proc, index in groups.values():
        logits[index] = proc(logits[index], [rows[i].output_token_ids() for i in index]).to(logits.dtype)
    if bitmask is not None:
        apply_bitmask(logits, bitmask)
    for i, row in enumerate(rows):
        p = row.params
        if p.min_tokens and row.num_output_tokens < p.min_tokens:
            stops = [t for t in (*stop_token_ids, *p.stop_token_ids) if t < vocab]
            if stops:
                # Never leave a row nothing to say (say the grammar allows only the end): the end wins then.
                kept = logits[i, stops].clone()
                logits[i, stops] = NEG_INF
                if bool(torch.isneginf(logits[i]).all()):
                    logits[i, stops] = kept
    return logits


# ------------------------------------------------------------------ 2./3. the distribution


def temper(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """Logits divided by each row's temperature (greedy rows by 1: their reported logprobs are the model's)."""
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=logits.dtype,
                         device=logits.device)
    return logits / temps[:, None]


def probs(tempered: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """Probabilities ``[N, V]`` (vocab order) after top-k, top-p and min-p, for tempered logits.

    top-k keeps the k largest; top-p keeps a token while the mass before it is at most top_p;
    min-p keeps tokens at least min_p times as likely as the best one.
    """
    logits = tempered
    vocab = logits.shape[-1]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        ranked, index = logits.sort(dim=-1, descending=True)
        ks = torch.tensor([p.top_k or vocab for p in params], device=logits.device)
        ranks = torch.arange(vocab, device=logits.device)
        ranked = ranked.masked_fill(ranks[None, :] >= ks[:, None], NEG_INF)
        pr = ranked.softmax(dim=-1)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=logits.device)
        ranked = ranked.masked_fill(pr.cumsum(dim=-1) - pr > top_p[:, None], NEG_INF)
        logits = torch.full_like(logits, NEG_INF).scatter_(1, index, ranked)
    out = logits.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=out.dtype, device=out.device)
        out = out.masked_fill(out < min_p[:, None] * out.max(dim=-1, keepdim=True).values, 0.0)
        out = out / out.sum(dim=-1, keepdim=True)
    return out


def sampling_probs(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """Steps 2-3 for already processed logits of sampled (non-greedy) rows."""
    return probs(temper(logits.float(), params), params)


# ------------------------------------------------------------------ 4. the draw


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)``: the first maximum of each row (NaN counting as the largest, as in torch). CPU float32
    goes through numpy: torch's CPU argmax took 500 us for a decode step's 14 x 49,152 logits (2 threads), numpy's
    45 us, about 2% of the step."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() >= 1 and x.shape[-1] and not x.requires_grad:
        return torch.from_numpy(np.asarray(x.numpy().argmax(axis=-1)))  # a 1-D input: a 0-d tensor, as torch's
    return x.argmax(dim=-1)


def race_noise(vocab: int, generator: torch.Generator) -> torch.Tensor:
    """One position's Exp(1) noise ``[V]`` from a request's generator: what one sampled token costs its
    random stream, on the plain and the speculative path alike."""
    return torch.empty(vocab, dtype=torch.float32).exponential_(generator=generator)


def race(p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The winners of the exponential race, argmax of p / E over the last dim: an exact draw from p."""
    return argmax_rows(p.float().cpu() / noise.clamp(min=1e-30)).to(p.device)


def draw(p: torch.Tensor, generators: Seq[torch.Generator]) -> torch.Tensor:
    """One token per row of ``p`` ``[N, V]``, row i with its own generator (exponential race: exact)."""
    vocab = p.shape[-1]
    noise = torch.stack([race_noise(vocab, g) for g in generators]) if len(generators) else torch.empty(0, vocab)
    return race(p, noise)


def choose(processed: torch.Tensor, params: Seq[SamplingParams], generators: Seq[torch.Generator]) -> torch.Tensor:
    """The token of each row of processed logits: argmax for greedy rows, a draw for the others."""
    tokens = argmax_rows(processed)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        tokens[rows] = draw(sampling_probs(processed[rows], [params[i] for i in rows]), [generators[i] for i in rows])
    return tokens


def logprobs_of(processed: torch.Tensor, params: Seq[SamplingParams], tokens: Seq[int]) -> list[TokenLogprob | None]:
    """Each row's reported logprob of ``tokens[i]`` and its top ``params[i].logprobs`` alternatives
    (None for rows that asked for no logprobs)."""
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(params)
    if not want:
        return out
    lp = temper(processed[want].float(), [params[i] for i in want]).log_softmax(dim=-1)
    k = max(params[i].logprobs or 0 for i in want)
    chosen = lp.gather(1, torch.tensor([tokens[i] for i in want], device=lp.device)[:, None])[:, 0].tolist()
    top_v, top_i = (lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
    top_v, top_i = top_v.tolist(), top_i.tolist()
    for j, i in enumerate(want):
        n = params[i].logprobs or 0
        out[i] = TokenLogprob(int(tokens[i]), chosen[j], list(zip(top_i[j][:n], top_v[j][:n])))
    return out


def sample(logits: torch.Tensor, rows: Seq[Row], generators: Seq[torch.Generator], stop_token_ids: Seq[int] = (),
           bitmask: torch.Tensor | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
    """The plain step: one token per row (and its logprobs where asked) for raw logits ``[N, V]``."""
    processed = process(logits.float(), rows, stop_token_ids, bitmask)
    params = [r.params for r in rows]
    tokens = choose(processed, params, generators).tolist()
    return tokens, logprobs_of(processed, params, tokens)
