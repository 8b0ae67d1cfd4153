"""Engine test fixtures: tiny random checkpoints (fast) and the real SmolLM2 engine (session-wide)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from apiary.cloud.engine import EngineConfig, LLMEngine, SamplingParams
from apiary.cloud.engine.sequence import Sequence
from tests.cloud.engine.tiny import make_checkpoint


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Run engine tests on one torch thread, then give other tests theirs back.

    The test prompts are small, and on a shared 2-core machine OpenMP hand-offs between two
    threads cost more than they gain (measured 5x slower under load). Speed is the benchmarks' job.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", tie=True)


@pytest.fixture(scope="session")
def tiny_llama3_rope(tmp_path_factory: pytest.TempPathFactory) -> Path:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    return make_checkpoint(tmp_path_factory.mktemp("tiny_llama3"), "llama", rope_scaling=scaling, heads=2, kv_heads=1)


@pytest.fixture(scope="session")
def real_engine(gguf_path: Path) -> LLMEngine:
    """One fp32 SmolLM2 engine for the real-model tests (loading costs seconds; reuse it)."""
    return LLMEngine(EngineConfig(model_path=gguf_path, dtype="float32", kv_cache_bytes=256 << 20,
                                  max_num_batched_tokens=512))


@pytest.fixture(scope="session")
def gate_references(real_engine: LLMEngine) -> list[tuple[list[int], torch.Tensor]]:
    """The fp32 engine's picks on the int8 accuracy gates' texts (``test_int8.gate_positions``), computed once for
    the int8 weights' and the int8 KV cache's gates."""
    from tests.cloud.engine.test_int8 import gate_positions

    return gate_positions(real_engine)


def prompt_logits(engine: LLMEngine, token_ids: list[int], chunk: int | None = None,
                  use_prefix_cache: bool = True) -> tuple[int, torch.Tensor]:
    """``(cached, logits)``: logits ``[len(token_ids) - cached, vocab]`` for the prompt positions the engine
    computed, through the paged path; ``cached`` leading tokens came from the prefix cache.

    With ``chunk`` the prompt runs in pieces of that many tokens (chunked prefill). The request is
    removed afterwards (its full blocks stay in the prefix cache).
    """
    rid = engine.add_request(token_ids, request_id=f"logits-{id(token_ids)}-{len(engine.requests)}")
    seq: Sequence = engine.requests[rid]
    saved = engine.config.max_num_batched_tokens, engine.block_manager.enable_prefix_caching
    engine.config.max_num_batched_tokens = chunk or len(token_ids)
    engine.block_manager.enable_prefix_caching = use_prefix_cache and saved[1]
    try:
        batch = engine.scheduler.schedule()
        assert batch.seqs == [seq], "prompt_logits needs an otherwise idle engine"
        cached = seq.num_computed_tokens
        parts = []
        while True:
            parts.append(engine.runner.forward_logits(batch))
            seq.num_computed_tokens += batch.num_new_tokens[0]
            engine.block_manager.commit(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                break
            batch = engine.scheduler.schedule()
        return cached, torch.cat(parts)
    finally:
        engine.config.max_num_batched_tokens, engine.block_manager.enable_prefix_caching = saved
        engine.abort(rid)
        engine.step()  # deliver the abort


def attention_calls(monkeypatch: pytest.MonkeyPatch, kernel: str) -> list[int]:
    """Spy on one of ``kernels.cpu_attention``'s prefill kernels (``_varlen``: verifications, ``_runs``: prompt
    chunks): the returned list gets the number of sequences of each call."""
    from apiary.kernels import cpu_attention

    real = getattr(cpu_attention, kernel)

    def spy(*args):  # type: ignore[no-untyped-def]
        served.append(len(args[9]))  # the kernels' arguments: ..., context_lens, seqs, scale, window, out
        return real(*args)

    served: list[int] = []
    monkeypatch.setattr(cpu_attention, kernel, spy)
    return served


def decodes_through_the_run(engine: LLMEngine, prompts: list, max_tokens: int,
                            monkeypatch: pytest.MonkeyPatch) -> tuple[list, list, int]:
    """Greedy generations with logprobs, with the model's run of layers in one call (``layer_stack``) and then
    without it; also how many decode steps took the run."""
    from apiary.kernels import cpu_layers

    calls = []
    through = cpu_layers.CpuStep.stacked_layers
    monkeypatch.setattr(cpu_layers.CpuStep, "stacked_layers", lambda *a: calls.append(1) or through(*a))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    model = engine.runner.model
    fused = engine.generate(prompts, params)
    stack, model.layer_stack = model.layer_stack, None
    try:
        engine.reset_prefix_cache()
        layered = engine.generate(prompts, params)
    finally:
        model.layer_stack = stack
    return fused, layered, len(calls)
