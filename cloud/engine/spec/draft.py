"""Draft-model proposals: a small same-tokenizer model guesses k tokens per sequence, batched.

The draft keeps its own paged KV cache and block manager (with prefix caching: sensor prompts
share a long system message). Each sequence's draft state is a shadow ``Sequence`` over the
same token list, so the engine's ``BlockManager`` does the bookkeeping; after verification the
draft cache is rolled back to the accepted tokens (block table truncated, blocks freed) and
the next proposal first catches up on whatever the target added (the bonus token, or a whole
prompt for a new sequence). New sequences are caught up at most ``CATCH_UP_TOKENS`` prompt
tokens per step (always at least one), which bounds that step's latency and lets later ones find
a system prompt they share with earlier ones in the draft's prefix cache.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from apiary.cloud.engine.kv_cache import KVPool
from apiary.cloud.engine.block_manager import BlockManager
from apiary.cloud.engine.errors import EngineError
from apiary.cloud.engine.loader import Checkpoint, load_checkpoint
from apiary.cloud.engine.model import LlamaModel
from apiary.cloud.engine.outputs import RequestMetrics
from apiary.cloud.engine.sequence import Sequence
from apiary.cloud.engine.spec.batching import Entry, build_inputs
from apiary.cloud.engine.sampling import Row, argmax_rows, draw, sampling_probs


CATCH_UP_TOKENS = 512

# The engine's logits processing (penalties, grammar mask, ...) for rows of raw logits: the draft's
# distribution must go through the same transforms as the target's for speculation to stay lossless.
ProcessFn = Callable[[torch.Tensor, list[Row]], torch.Tensor]


@dataclass(slots=True)
class DraftProposal:
    tokens: list[list[int]]  # per sequence, 0..k tokens
    probs: torch.Tensor | None  # [B, K, V] the draft's (transformed) distributions for sampled rows; None if all greedy


def truncated(checkpoint: Checkpoint, num_layers: int | None) -> tuple[Checkpoint, int]:
    """``checkpoint`` cut to its first ``num_layers`` layers (final norm and head kept); shares the tensors."""
    config = checkpoint.config
    n = config.num_layers if num_layers is None else num_layers
    if not 1 <= n <= config.num_layers:
        raise EngineError(f"draft_num_layers={num_layers} but the draft checkpoint has {config.num_layers} layers")
    keep = {k: v for k, v in checkpoint.weights.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < n}
    return Checkpoint(dataclasses.replace(config, num_layers=n), keep, checkpoint.source, checkpoint.metadata), n


def check_same_tokenizer(target: Checkpoint, draft: Checkpoint) -> None:
    """A draft is only lossless-useful if token ids mean the same thing: same vocab size, same token list."""
    if target.config.vocab_size != draft.config.vocab_size:
        raise EngineError(f"draft vocab {draft.config.vocab_size} != target vocab {target.config.vocab_size}: "
                          "the draft must share the target's tokenizer")
    a, b = target.metadata.get("tokenizer.ggml.tokens"), draft.metadata.get("tokenizer.ggml.tokens")
    if a is not None and b is not None and list(a) != list(b):
        raise EngineError("draft and target GGUF token lists differ: the draft must share the target's tokenizer")


def parameter_count(model: LlamaModel) -> int:
    tensors = [model.embed, model.norm] + ([] if model.lm_head is model.embed else [model.lm_head])
    for layer in model.layers:
        tensors += layer.tensors()
    return sum(t.numel() for t in tensors)


class DraftProposer:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.model = model
        c = model.config
        self.block_size = block_size
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.kv_caches = KVPool(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, model.dtype,
                                model.device).layers
        self.states: dict[Sequence, Sequence] = {}  # target sequence -> its draft shadow

    @classmethod
    def load(cls, target: Checkpoint, path: str | Path | None, num_layers: int | None, *, device: torch.device,
             dtype: torch.dtype, max_positions: int, num_blocks: int, block_size: int,
             enable_prefix_caching: bool = True) -> "DraftProposer":
        """The draft from ``path`` (None or the target's own file: reuse the loaded target weights)."""
        same = path is None or Path(path).expanduser().resolve() == Path(target.source).expanduser().resolve()
        source = target if same else load_checkpoint(path)
        if not same:
            check_same_tokenizer(target, source)
        ckpt, _ = truncated(source, num_layers)
        return cls(LlamaModel(ckpt.config, ckpt.weights, device, dtype, max_positions), num_blocks, block_size,
                   enable_prefix_caching)

    # ------------------------------------------------------------ per-sequence state

    def _shadow(self, seq: Sequence) -> Sequence:
        shadow = self.states.get(seq)
        if shadow is None:
            shadow = self.states[seq] = Sequence(
                request_id=seq.request_id, seq_no=seq.seq_no, token_ids=seq.token_ids,
                num_prompt_tokens=seq.num_prompt_tokens, params=seq.params, priority=seq.priority,
                metrics=RequestMetrics(arrival_time=0.0))
        shadow.token_ids = seq.token_ids
        return shadow

    def _reserve(self, shadow: Sequence, num_new: int) -> bool:
        """Slots for ``num_new`` more tokens in the draft cache (attaching a cached prefix first); False if full."""
        bm = self.bm
        if not shadow.block_table:
            cached = bm.cached_prefix(shadow)
            rest = num_new - len(cached) * bm.block_size
            if bm.admit_cost(shadow, cached, rest) > bm.num_free_blocks:
                return False
            bm.admit(shadow, cached, rest)
            return True
        if bm.append_cost(shadow, num_new) > bm.num_free_blocks:
            return False
        bm.append(shadow, num_new)
        return True

    def rollback(self, seq: Sequence, num_valid: int) -> None:
        """Keep draft K/V only for the first ``num_valid`` tokens of ``seq`` (its accepted text)."""
        shadow = self.states.get(seq)
        if shadow is None:
            return
        shadow.token_ids = seq.token_ids
        if shadow.num_computed_tokens > num_valid:
            self.bm.truncate(shadow, num_valid)
        self.bm.commit(shadow)

    def drop(self, seq: Sequence) -> None:
        """Forget ``seq``'s draft state and free its blocks (finished, aborted or preempted)."""
        shadow = self.states.pop(seq, None)
        if shadow is not None:
            self.bm.free(shadow)

    # ------------------------------------------------------------ proposing

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], generators: list[torch.Generator],
                process: ProcessFn | None = None) -> DraftProposal:
        """Up to ``ks[i]`` draft tokens for each ``seqs[i]`` (fewer when the draft cache is full), each drawn
        from the draft's logits after ``process`` (the engine's own processing; none when None)."""
        ks = list(ks)
        tokens: list[list[int]] = [[] for _ in seqs]
        k_max = max(ks, default=0)
        sampled = [i for i, s in enumerate(seqs) if ks[i] > 0 and not s.params.greedy]
        probs = None
        if sampled and k_max:
            probs = torch.zeros(len(seqs), k_max, self.model.config.vocab_size, device=self.model.device)
        active = [i for i in range(len(seqs)) if ks[i] > 0]
        # A seeded row is verified by replaying plain decoding's draws (spec/rejection.py): it proposes with
        # the very noise the target will draw at each position, read ahead and then rewound.
        rewind = {i: generators[i].get_state() for i in sampled if seqs[i].params.seed is not None}
        admitted = 0  # prompt tokens of sequences new to the draft this step
        for step in range(k_max):
            entries, rows = [], []
            for i in active:
                if ks[i] <= step:
                    continue
                shadow = self._shadow(seqs[i])
                if step == 0 and shadow.num_computed_tokens >= seqs[i].num_tokens:
                    self.drop(seqs[i])  # nothing left to run, but the last token's logits are needed: start over
                    shadow = self._shadow(seqs[i])
                if step == 0 and not shadow.block_table:
                    # Bound the catch-up work of one step; a sequence left out waits a step (and may then
                    # find a prompt it shares with one admitted now in the prefix cache).
                    if admitted and admitted + seqs[i].num_tokens > CATCH_UP_TOKENS:
                        ks[i] = 0
                        continue
                    admitted += seqs[i].num_tokens
                new = seqs[i].token_ids[shadow.num_computed_tokens:] if step == 0 else tokens[i][-1:]
                if not self._reserve(shadow, len(new)):
                    ks[i] = step  # the draft cache is full: propose what we have
                    continue
                # admit() may have attached a cached prefix, moving num_computed_tokens forward.
                new = seqs[i].token_ids[shadow.num_computed_tokens:] if step == 0 else new
                entries.append(Entry(new, shadow.num_computed_tokens, shadow.block_table))
                rows.append(i)
            if not entries:
                break
            inputs = build_inputs(entries, self.block_size, self.model.device)
            hidden = self.model.forward(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
            logits = self.model.logits(hidden[inputs.last_rows]).float()
            if process is not None:
                logits = process(logits, [Row(seqs[i], tuple(tokens[i])) for i in rows])
            chosen = argmax_rows(logits)
            pick = [j for j, i in enumerate(rows) if not seqs[i].params.greedy]
            if pick:
                q = sampling_probs(logits[pick], [seqs[rows[j]].params for j in pick])
                chosen[pick] = draw(q, [generators[rows[j]] for j in pick])
                assert probs is not None
                probs[[rows[j] for j in pick], step] = q
            for i, entry in zip(rows, entries):
                shadow = self.states[seqs[i]]
                shadow.num_computed_tokens += len(entry.token_ids)
                if step == 0:  # caught up on real tokens only: their full blocks can be shared now
                    self.bm.commit(shadow)
            for i, tok in zip(rows, chosen.tolist()):
                tokens[i].append(tok)
        for i, state in rewind.items():
            generators[i].set_state(state)
        return DraftProposal(tokens, probs)
