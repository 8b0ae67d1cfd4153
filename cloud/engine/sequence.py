"""A request's life inside the engine: its tokens, KV blocks, priority and timing."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from apiary.cloud.engine.outputs import FinishReason, RequestMetrics
from apiary.cloud.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    seq_no: int  # arrival order; with priority it fixes the place in line, preemptions keep it
    token_ids: list[int]  # prompt + generated
    num_prompt_tokens: int
    params: SamplingParams
    priority: int  # smaller = more urgent
    metrics: RequestMetrics
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks of token_ids
    num_hashed_blocks: int = 0  # leading blocks of block_table registered in the prefix cache
    aging_boost: int = 0  # priority levels earned by waiting (kept once earned)
    waited_steps: int = 0
    generator: torch.Generator | None = None
    num_swapped_blocks: int = 0  # blocks of K/V parked in host memory (swap-mode preemption)
    swapped_kv: tuple[torch.Tensor, ...] | None = None  # that host copy (KVPool.copy_out), kept by the model runner
    finish_reason: FinishReason | None = None
    grammar: Any = None  # the llguidance matcher of a structured request (see cloud.engine.structured)
    logprobs: list[Any] = field(default_factory=list)  # per output token, sampling.TokenLogprob when asked for
    # Incremental detokenization and stop-string state.
    text: str = ""  # decoded output, stop string cut off
    released: int = 0  # characters of `text` already handed out
    prefix_offset: int = 0
    read_offset: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model: a prompt (chunk) or the last sampled token."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def urgency(self) -> tuple[int, int]:
        """Sort key of the line: (effective priority, arrival); smaller goes first."""
        return self.priority - self.aging_boost, self.seq_no

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
