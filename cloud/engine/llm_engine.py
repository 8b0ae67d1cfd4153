"""The engine: requests in, ``step()`` = schedule -> run -> postprocess, outputs out.

Not thread-safe: one thread drives it (``AsyncEngine`` does so for concurrent callers).
"""
from __future__ import annotations

import itertools
import math
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence as Seq

import torch

from apiary.cloud.engine import adapter, detokenizer, host_memory
from apiary.cloud.engine.block_manager import BlockManager
from apiary.cloud.engine.config import EngineConfig
from apiary.cloud.engine.errors import EngineError, EngineOverloaded, RequestRejected, StepInterrupted
from apiary.cloud.engine.loader import Checkpoint, load_checkpoint
from apiary.cloud.engine.metrics import EngineStats
from apiary.cloud.engine.model_runner import ModelRunner
from apiary.cloud.engine.outputs import RequestMetrics, RequestOutput
from apiary.cloud.engine import sampling
from apiary.cloud.engine.sampling import Row, TokenLogprob
from apiary.cloud.engine.sampling_params import SamplingParams
from apiary.cloud.engine.scheduler import ScheduledBatch, Scheduler, SpeculationHooks
from apiary.cloud.engine.sequence import Sequence, SequenceStatus
from apiary.cloud.engine.spec.draft import DraftProposer, parameter_count
from apiary.cloud.engine.spec.speculator import SpecPlan, Speculator
from apiary.cloud.engine.structured import StructuredOutputs
from apiary.cloud.engine.tokenizer import load_tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if not isinstance(config, EngineConfig):
            raise EngineError(f"LLMEngine needs an EngineConfig, got {type(config).__name__}")
        self.config = config
        checkpoint = load_checkpoint(config.model_path)
        self.adapter = (adapter.merge(checkpoint.weights, config.adapter_path, config.model_path)
                        if config.adapter_path is not None else None)
        self.model_config = checkpoint.config
        self.tokenizer = load_tokenizer(Path(config.model_path).expanduser(), checkpoint.metadata or None)
        self.max_model_len = min(config.max_model_len or checkpoint.config.max_position, checkpoint.config.max_position)
        self.runner = ModelRunner(config, checkpoint, self.max_model_len)
        self.speculator = self._speculator(config, checkpoint) if config.speculative is not None else None
        del checkpoint  # the float32 copy; the model holds its own (possibly bf16) weights
        if self.runner.device.type == "cpu":
            host_memory.return_freed_memory()  # the load's temporaries: no step reuses them
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, config.swap_space_bytes // self.runner.bytes_per_block)
        if self.speculator is not None:
            self.scheduler.speculation = SpeculationHooks(propose=self._propose, preempted=self.speculator.preempted)
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size)
        self._step_bitmask: torch.Tensor | None = None  # the grammar bitmask this step computed (_allowed_tokens)
        self.stop_token_ids = sorted(self.tokenizer.stop_token_ids)
        self.requests: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self._arrivals = itertools.count()
        self._pending: list[RequestOutput] = []  # produced outside step() (aborts) or held back by generate()
        self._finished: dict[str, Sequence] = {}  # finished during this step (the speculator forgets them after)
        self._announced: list[int] = []  # priorities of requests on their way in (see announce_arrival)
        self._announced_lock = threading.Lock()

    def _speculator(self, config: EngineConfig, checkpoint: Checkpoint) -> Speculator:
        """The speculative decoder; a draft model gets as many KV blocks as the target (it never runs out first)."""
        spec = config.speculative
        assert spec is not None
        if spec.method != "draft":
            return Speculator(spec)
        runner = self.runner
        draft = DraftProposer.load(checkpoint, spec.draft_model_path, spec.draft_num_layers, device=runner.device,
                                   dtype=runner.dtype, max_positions=self.max_model_len, num_blocks=runner.num_blocks,
                                   block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching)
        share = parameter_count(draft.model) / parameter_count(runner.model)
        return Speculator(spec, draft, draft_step_cost=min(share, 0.9))

    def _generator_of(self, seq: Sequence) -> torch.Generator:
        return seq.generator or self.runner.generator

    def _propose(self, batch: ScheduledBatch) -> SpecPlan:
        """Scheduler hook: speculative proposals for the batch's decodes, with KV slots reserved for them."""
        assert self.speculator is not None
        return self.speculator.extend_batch(batch, self.block_manager, self.max_model_len,
                                            self.config.max_num_batched_tokens, self._generator_of, self._process,
                                            self.structured.valid_prefix)

    def _process(self, logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """The one logits processing of every sampling position (plain step, verification, draft)."""
        return sampling.process(logits, rows, self.stop_token_ids, self.structured.bitmask(rows))

    # ------------------------------------------------------------ requests

    def add_request(self, prompt: str | list[int] | None = None, *, messages: list[dict[str, Any]] | None = None,
                    params: SamplingParams | None = None, priority: int = 0, request_id: str | None = None) -> str:
        """Queue a request and return its id; ``priority``: smaller is more urgent (0 = critical).

        Raises RequestRejected for bad input or a request that can never fit, EngineOverloaded
        when the waiting queue is full.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise RequestRejected(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise RequestRejected(f"priority must be an int, got {priority!r}")
        request_id = uuid.uuid4().hex if request_id is None else request_id
        if not isinstance(request_id, str) or not request_id:
            raise RequestRejected(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise RequestRejected(f"request_id {request_id!r} is already in use")
        token_ids = self.prompt_tokens(prompt, messages)
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                                  f"exceeds max_model_len {self.max_model_len}")
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in (*params.logit_bias, *params.stop_token_ids)):
            raise RequestRejected(f"logit_bias and stop_token_ids take token ids below the vocabulary size {vocab}")
        needed = self.block_manager.blocks_for(total - 1)  # the last sampled token is never run
        if needed > self.block_manager.num_blocks:
            raise RequestRejected(f"request needs {needed} KV blocks but the whole pool has "
                                  f"{self.block_manager.num_blocks}; it can never run")
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise EngineOverloaded(f"{len(self.scheduler.waiting)} requests already waiting "
                                   f"(max_waiting={self.config.max_waiting}); retry later")
        seq = Sequence(request_id=request_id, seq_no=next(self._arrivals), token_ids=token_ids,
                       num_prompt_tokens=len(token_ids), params=params, priority=priority,
                       metrics=RequestMetrics(arrival_time=time.monotonic()),
                       generator=None if params.seed is None else torch.Generator().manual_seed(params.seed))
        self.structured.start(seq)  # compiles (cached) or refuses the grammar before the request is queued
        detokenizer.start(seq)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def prompt_tokens(self, prompt: str | list[int] | None, messages: list[dict[str, Any]] | None) -> list[int]:
        """The token ids of ``prompt`` (text or ids) or of chat ``messages`` rendered by the chat template."""
        if (prompt is None) == (messages is None):
            raise RequestRejected("give exactly one of prompt or messages")
        if messages is not None:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            vocab = self.model_config.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
                raise RequestRejected(f"prompt token ids must be ints in [0, {vocab})")
            token_ids = list(prompt)
        else:
            raise RequestRejected(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise RequestRejected("prompt is empty")
        return token_ids

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its KV blocks; its final output (reason "abort") comes with the next step."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        self._finish(seq, "abort")
        if self.speculator is not None:
            self.speculator.release(seq)
        self._pending.append(self._output(seq, [], ""))
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    # ------------------------------------------------------------ the step

    def announce_arrival(self, priority: int) -> None:
        """Thread-safe: a request of ``priority`` is on its way in (it will be added between steps).

        While it is announced, a running step that holds any less urgent sequence stops at the
        next layer boundary and is discarded, so the newcomer is scheduled a partial step sooner:
        an urgent request never waits out a long low-priority prefill step. The partial work is
        redone later (it was never committed). The step that then starts the newcomer carries
        nothing less urgent (see the scheduler), so equally urgent arrivals do not stop it.
        ``AsyncEngine`` announces every submission and withdraws it once ``add_request`` has run,
        whatever its outcome.
        """
        with self._announced_lock:
            self._announced.append(priority)

    def withdraw_arrival(self, priority: int) -> None:
        """The announced request was added (or refused): it no longer interrupts steps."""
        with self._announced_lock:
            if priority in self._announced:
                self._announced.remove(priority)

    def _most_urgent_announced(self) -> float:
        with self._announced_lock:
            return min(self._announced, default=math.inf)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule -> run -> postprocess. One output per request that produced tokens or finished."""
        outputs, self._pending = self._pending, []
        step_started = time.perf_counter()
        batch = self.scheduler.schedule()  # with speculation: proposals and their KV slots (scheduler hooks)
        if not batch.seqs and not batch.swap_out:
            return outputs
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
                self.stats.record_admission(seq)
        plan = batch.spec_plan
        if self.runner.governor is not None:
            self.runner.governor.tick()  # adaptive waits: spin or sleep by the cores others use, before this step
        started = time.perf_counter()
        try:
            self._step_bitmask = None
            sampled, logits, spec_logits = self.runner.execute(batch, plan.seqs if plan else [],
                                                               self._stop_rule(batch), self._allowed_tokens)
        except StepInterrupted:
            # Nothing was committed: the same sequences keep their blocks and are scheduled again.
            self.stats.interrupted_steps += 1
            return outputs
        chunk = any(n > 1 and s not in batch.spec_tokens for s, n in zip(batch.seqs, batch.num_new_tokens))
        context = 0 if chunk else sum(s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens))
        outputs += self._postprocess(batch, sampled, logits, spec_logits, time.perf_counter() - started)
        head_rows = sum(x.shape[0] for x in (logits, spec_logits) if x is not None)
        self.stats.record_step(chunk, batch.num_tokens, head_rows, context, time.perf_counter() - step_started)
        return outputs

    def _allowed_tokens(self, rows: list[Row]) -> torch.Tensor | None:
        """The grammar bitmask of sampling positions, for a head that needs it before sampling
        (``ModelRunner.execute``); the plain rows' is kept for the sampling of the same step."""
        mask = self.structured.bitmask(rows)
        if not any(r.drafted for r in rows):
            self._step_bitmask = mask
        return mask

    def _stop_rule(self, batch: ScheduledBatch) -> Callable[[], bool] | None:
        """When a running step should stop early: a newcomer is more urgent than some of its work (the more
        urgent part, say an earlier urgent request's decode, runs again in the very next step). A
        speculative step keeps draft state, so it always runs to the end."""
        if batch.spec_plan or not batch.seqs:
            return None
        most_lenient = max(s.urgency[0] for s in batch.seqs)
        return lambda: self._most_urgent_announced() < most_lenient

    def _postprocess(self, batch: ScheduledBatch, sampled: list[Sequence], logits: torch.Tensor | None,
                     spec_logits: torch.Tensor | None, seconds: float) -> list[RequestOutput]:
        """Sample, verify proposals, commit K/V and append tokens; outputs of this step."""
        outputs = []
        spec, plan = self.speculator, batch.spec_plan
        if sampled:
            rows = [Row(s) for s in sampled]
            bitmask = self._step_bitmask if self._step_bitmask is not None else self.structured.bitmask(rows)
            tokens, logprobs = sampling.sample(logits, rows, [self._generator_of(s) for s in sampled],
                                               self.stop_token_ids, bitmask)
        verdicts = (spec.verify(plan, spec_logits, [self._generator_of(s) for s in plan.seqs], self._process)
                    if plan else [])
        if spec is not None and batch.seqs and all(n == 1 or s in batch.spec_tokens
                                                   for s, n in zip(batch.seqs, batch.num_new_tokens)):
            spec.observe_step(batch.num_tokens, seconds)  # decode-only steps teach the policy
        now = time.monotonic()
        self.stats.steps += 1
        self.stats.computed_tokens += batch.num_tokens
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq not in batch.spec_tokens:
                seq.num_computed_tokens += n
                self.block_manager.commit(seq)
        for i, seq in enumerate(sampled):
            outputs.append(self._append_tokens(seq, [tokens[i]], now, [logprobs[i]])[0])
        if plan:
            emitted = []
            for seq, verdict in zip(plan.seqs, verdicts):
                # Valid K/V: the last real token and the accepted drafts; blocks holding only rejected ones go.
                valid = seq.num_computed_tokens + 1 + verdict.num_accepted
                self.block_manager.truncate(seq, valid)
                seq.num_computed_tokens = valid
                out, n = self._append_tokens(seq, verdict.tokens, now, verdict.logprobs)
                if not seq.finished:
                    self.block_manager.commit(seq)
                outputs.append(out)
                emitted.append(n)
            spec.record(plan, verdicts, emitted)
        if spec is not None:
            for seq in self._finished.values():
                spec.release(seq)
        self._finished.clear()
        self.stats.record_kv(self.scheduler.running, self.block_manager.num_blocks - self.block_manager.num_free_blocks,
                             self.config.block_size, self.max_model_len)
        return outputs

    def _append_tokens(self, seq: Sequence, tokens: list[int], now: float,
                       logprobs: list[TokenLogprob | None] | None = None) -> tuple[RequestOutput, int]:
        """Append generated ``tokens`` one by one until one finishes the request; (its output, tokens kept).

        A structured request's matcher consumes each kept token; it finishes when its grammar is complete.
        """
        params = seq.params
        reason = None
        kept = 0
        first_logprob = len(seq.logprobs)
        for j, token in enumerate(tokens):
            seq.token_ids.append(token)
            kept += 1
            if logprobs and logprobs[j] is not None:
                seq.logprobs.append(logprobs[j])
            self.stats.generated_tokens += 1
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            complete = self.structured.accept(seq, token)
            if (token in params.stop_token_ids or (not params.ignore_eos and token in self.tokenizer.stop_token_ids)
                    or (complete and token in self.stop_token_ids)):
                reason = "stop"
                detokenizer.update_text(self.tokenizer, seq, final=True, end=seq.num_tokens - 1)  # stop token not shown
            else:
                searched_from = len(seq.text)
                if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                    reason = "length"
                detokenizer.update_text(self.tokenizer, seq, final=reason is not None)
                if (params.stop and detokenizer.find_stop(seq, searched_from)) or complete:
                    reason = "stop"
            if reason is not None:
                break
        if reason is not None:
            self.requests.pop(seq.request_id, None)
            self.scheduler.remove(seq)
            self._finish(seq, reason, now)
            self._finished[seq.request_id] = seq
        out = self._output(seq, tokens[:kept], detokenizer.release(seq, final=reason is not None))
        out.new_logprobs = seq.logprobs[first_logprob:]
        return out, kept

    def _finish(self, seq: Sequence, reason: str, now: float | None = None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason  # type: ignore[assignment]
        seq.metrics.finish_time = time.monotonic() if now is None else now
        self.stats.record_finish(seq)

    def _output(self, seq: Sequence, new_tokens: list[int], delta: str) -> RequestOutput:
        return RequestOutput(request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
                             output_token_ids=seq.output_token_ids, new_token_ids=new_tokens,
                             text=seq.text[:seq.released], text_delta=delta, finished=seq.finished,
                             finish_reason=seq.finish_reason, metrics=seq.metrics, logprobs=list(seq.logprobs))

    # ------------------------------------------------------------ conveniences

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Blocking: run the prompts to completion and return their final outputs, in order.

        Outputs of other requests that progress meanwhile are kept for the next ``step()``.
        """
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(batch)
        if len(plist) != len(batch):
            raise RequestRejected(f"{len(plist)} SamplingParams for {len(batch)} prompts")
        ids: list[str] = []
        try:
            for prompt, p in zip(batch, plist):
                ids.append(self.add_request(prompt, params=p))
        except EngineError:
            for rid in ids:
                self.abort(rid)
            self._pending = [o for o in self._pending if o.request_id not in ids]
            raise
        wanted, finals, others = set(ids), {}, []
        while len(finals) < len(ids):
            for out in self.step():
                if out.request_id in wanted:
                    if out.finished:
                        finals[out.request_id] = out
                else:
                    others.append(out)
        self._pending.extend(others)
        return [finals[rid] for rid in ids]

    def reset_prefix_cache(self) -> None:
        """Drop all cached prefixes (benchmarks' cold runs; after changing weights)."""
        self.block_manager.reset_prefix_cache(self.scheduler.running)

    def metrics(self) -> dict[str, Any]:
        bm = self.block_manager
        return {
            **self.stats.snapshot(),
            "requests_running": len(self.scheduler.running), "requests_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": bm.num_blocks, "kv_blocks_used": bm.num_blocks - bm.num_free_blocks,
            "kv_blocks_free": bm.num_free_blocks, "kv_blocks_cached_free": len(bm.evictable),
            "kv_cache_tokens": bm.num_blocks * bm.block_size,  # what the pool holds (int8 rows: ~2-4x more)
            "kv_cache_bytes_per_token": self.runner.bytes_per_block // bm.block_size,
            "preemptions": self.scheduler.num_preemptions,
            "interrupted_steps": self.stats.interrupted_steps,
            **(self.speculator.metrics() if self.speculator is not None else {}),
        }
