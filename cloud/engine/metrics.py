"""Engine counters and latency samples behind ``LLMEngine.metrics()``."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from apiary.cloud.engine.sequence import Sequence

WINDOW = 4096  # latency samples kept (most recent requests)


def _summary(name: str, values: deque[float]) -> dict[str, float | None]:
    if not values:
        return {f"{name}_mean": None, f"{name}_p50": None, f"{name}_p99": None}
    arr = np.asarray(values)
    return {f"{name}_mean": float(arr.mean()), f"{name}_p50": float(np.percentile(arr, 50)),
            f"{name}_p99": float(np.percentile(arr, 99))}


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0  # at first admission
    cached_prompt_tokens: int = 0  # of those, served by the prefix cache
    generated_tokens: int = 0
    computed_tokens: int = 0  # tokens run through the model (prefill + decode + recompute)
    interrupted_steps: int = 0  # cut short for a more urgent arrival (their tokens ran again later)
    # KV slot accounting, summed over steps: slots in allocated blocks vs slots holding a token.
    kv_slots_allocated: int = 0
    kv_slots_unused: int = 0
    kv_tokens: int = 0
    kv_reserved_request: int = 0  # what reserving prompt + max_tokens contiguously would hold
    kv_reserved_max_len: int = 0  # what reserving max_model_len contiguously would hold
    # Wall time of whole steps (schedule, model, sampling) by kind, for the fraction of the compute floor each kind
    # reaches (``apiary bench engine``, bench/floor.py): steps that run a prompt chunk (decode rows may ride along)
    # and decode-only steps (speculative verifications included). Rows run, rows sampled (the LM head's), and for
    # decode-only steps the cached tokens their attention read (the KV cache's bytes per step).
    prompt_steps: int = 0
    prompt_step_seconds: float = 0.0
    prompt_step_rows: int = 0
    prompt_step_sampled: int = 0
    decode_steps: int = 0
    decode_step_seconds: float = 0.0
    decode_step_rows: int = 0
    decode_step_sampled: int = 0
    decode_step_context_tokens: int = 0
    ttft: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    tpot: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    queue_time: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    e2e: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def record_admission(self, seq: Sequence) -> None:
        self.prompt_tokens += seq.num_prompt_tokens
        self.cached_prompt_tokens += seq.metrics.cached_prompt_tokens

    def record_finish(self, seq: Sequence) -> None:
        m = seq.metrics
        if seq.finish_reason == "abort":
            self.requests_aborted += 1
            return
        self.requests_finished += 1
        if m.ttft is not None:
            self.ttft.append(m.ttft)
        if m.queue_time is not None:
            self.queue_time.append(m.queue_time)
        if m.finish_time is not None:
            self.e2e.append(m.finish_time - m.arrival_time)
            if m.first_token_time is not None and seq.num_output_tokens > 1:
                self.tpot.append((m.finish_time - m.first_token_time) / (seq.num_output_tokens - 1))

    def record_step(self, prompt: bool, rows: int, sampled: int, context_tokens: int, seconds: float) -> None:
        if prompt:
            self.prompt_steps += 1
            self.prompt_step_seconds += seconds
            self.prompt_step_rows += rows
            self.prompt_step_sampled += sampled
        else:
            self.decode_steps += 1
            self.decode_step_seconds += seconds
            self.decode_step_rows += rows
            self.decode_step_sampled += sampled
            self.decode_step_context_tokens += context_tokens

    def record_kv(self, running: list[Sequence], used_blocks: int, block_size: int, max_model_len: int) -> None:
        self.kv_slots_allocated += used_blocks * block_size
        for seq in running:
            self.kv_slots_unused += len(seq.block_table) * block_size - seq.num_computed_tokens
            self.kv_tokens += seq.num_computed_tokens
            self.kv_reserved_request += seq.num_prompt_tokens + seq.params.max_tokens
            self.kv_reserved_max_len += max_model_len

    def snapshot(self) -> dict[str, Any]:
        def ratio(a: int, b: int) -> float | None:
            return a / b if b else None

        return {
            "steps": self.steps, "requests_finished": self.requests_finished,
            "requests_aborted": self.requests_aborted, "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens, "computed_tokens": self.computed_tokens,
            "prefix_cached_tokens": self.cached_prompt_tokens,
            "prefix_hit_rate": ratio(self.cached_prompt_tokens, self.prompt_tokens),
            "kv_slot_waste": ratio(self.kv_slots_unused, self.kv_slots_allocated),
            "kv_waste_contiguous_request": None if not self.kv_reserved_request
            else 1 - self.kv_tokens / self.kv_reserved_request,
            "kv_waste_contiguous_max_len": None if not self.kv_reserved_max_len
            else 1 - self.kv_tokens / self.kv_reserved_max_len,
            "prompt_steps": self.prompt_steps, "prompt_step_seconds": self.prompt_step_seconds,
            "prompt_step_rows": self.prompt_step_rows, "prompt_step_sampled": self.prompt_step_sampled,
            "decode_steps": self.decode_steps, "decode_step_seconds": self.decode_step_seconds,
            "decode_step_rows": self.decode_step_rows, "decode_step_sampled": self.decode_step_sampled,
            "decode_step_context_tokens": self.decode_step_context_tokens,
            **_summary("ttft", self.ttft), **_summary("tpot", self.tpot),
            **_summary("queue_time", self.queue_time), **_summary("e2e", self.e2e),
        }
