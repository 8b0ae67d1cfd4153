"""CUDA graphs for decode steps: buckets, inert padding rows, and graph replays equal to the eager forward.

The padding check runs everywhere (the eager forward over the static buffers is what a graph captures);
the replay checks need a CUDA GPU with Triton (``apiary bench gpu`` runs them: ``-k cuda``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from apiary.cloud.engine import SamplingParams
from apiary.cloud.engine.cuda_graphs import BUCKETS, DecodeGraphs, buckets_for
from apiary.cloud.engine.model import paged_layout
from apiary.kernels import ops
from tests.cloud.engine.test_engine import engine_for

needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and ops.triton_available()),
                                reason="needs a CUDA GPU and Triton (graphs are captured on CUDA only)")


@pytest.mark.parametrize("max_num_seqs", [1, 5, 64, 256, 600])
def test_every_batch_size_gets_the_smallest_bucket_that_holds_it(max_num_seqs):
    buckets = buckets_for(max_num_seqs)
    assert buckets == sorted(set(buckets)) and buckets[0] == 1 and buckets[-1] == max_num_seqs
    assert set(buckets[:-1]) <= set(BUCKETS)
    assert all(b <= 2 * a for a, b in zip(buckets, buckets[1:]))  # no step pads to more than twice its rows


def _decode_step(runner, rng: np.random.Generator, contexts: list[int]):
    """A decode step of ``len(contexts)`` sequences with that many tokens already cached (random K/V)."""
    bs = runner.block_size
    for kv in runner.kv_caches:
        kv.k.copy_(torch.randn(kv.k.shape, generator=torch.Generator().manual_seed(1)).to(kv.k))
        kv.v.copy_(torch.randn(kv.v.shape, generator=torch.Generator().manual_seed(2)).to(kv.v))
    blocks = rng.permutation(runner.num_blocks).tolist()
    tables, used = [], 0
    for c in contexts:
        need = c // bs + 1
        tables.append(blocks[used:used + need])
        used += need
    starts = np.asarray(contexts, dtype=np.int64)
    positions, meta, _ = paged_layout(starts, np.ones(len(contexts), dtype=np.int64), tables, bs, len(contexts),
                                      runner.device)
    ids = torch.from_numpy(rng.integers(3, 300, len(contexts))).to(runner.device)
    return ids, positions, meta


def _caches(runner) -> torch.Tensor:
    """Every layer's K and V, one row per cache slot: ``[slots, layers * 2 * Hkv * D]``."""
    return torch.cat([t.reshape(t.shape[0] * t.shape[1], -1) for kv in runner.kv_caches for t in (kv.k, kv.v)], 1)


def _written(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    return set(torch.nonzero((before != after).any(dim=1)).flatten().tolist())


def _padded_equals_eager(runner, graphs: DecodeGraphs, replay: bool) -> None:
    rng = np.random.default_rng(0)
    # Stale static inputs from an earlier, bigger step: live slots and long contexts in the padding rows.
    graphs.slot_mapping.copy_(torch.arange(graphs.slot_mapping.shape[0]))
    graphs.context_lens.fill_(9)
    ids, positions, meta = _decode_step(runner, rng, [5, 11, 3])
    real_slots = set(meta.slot_mapping.tolist())
    before = _caches(runner)
    eager = runner.model.forward(ids, positions, meta, runner.kv_caches)
    after_eager = _caches(runner)
    assert _written(before, after_eager) == real_slots
    ids, positions, meta = _decode_step(runner, np.random.default_rng(0), [5, 11, 3])  # the same caches again
    b = graphs.bucket(meta, 3)
    assert b == 4
    if replay:
        out = graphs.run(ids, positions, meta, b)
    else:
        graphs.load(ids, positions, meta, b)
        out = graphs.forward(b)[:3]
    torch.testing.assert_close(out, eager, atol=1e-4, rtol=1e-4)
    after = _caches(runner)
    assert _written(before, after) == real_slots  # the padding row wrote nothing, though its stale slot was live
    torch.testing.assert_close(after, after_eager, atol=1e-5, rtol=1e-5)


def test_padding_rows_write_no_kv_and_leave_the_real_rows_unchanged(tiny_llama: Path):
    engine = engine_for(tiny_llama, max_num_seqs=8)
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, 8, 256, runner.block_size, runner.device)
    assert graphs.buckets == [1, 2, 4, 8]
    with torch.inference_mode():
        _padded_equals_eager(runner, graphs, replay=False)


def test_steps_graphs_cannot_serve_run_eagerly(tiny_llama: Path):
    engine = engine_for(tiny_llama, max_num_seqs=8)
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, 8, 32, runner.block_size, runner.device)
    rng = np.random.default_rng(1)
    _, _, meta = _decode_step(runner, rng, [5, 9])
    assert graphs.bucket(meta, 2) == 2
    assert graphs.bucket(meta, 3) is None  # a prefill token in the step
    _, _, wide = _decode_step(runner, rng, [5, 40])  # a block table wider than the graphs'
    assert graphs.bucket(wide, 2) is None


def test_cpu_engines_capture_no_graphs(tiny_llama: Path):
    assert engine_for(tiny_llama).runner.graphs is None


@needs_cuda
def test_graph_replay_equals_the_eager_forward_on_cuda(tiny_llama: Path):
    engine = engine_for(tiny_llama, device="cuda", max_num_seqs=8, max_model_len=256)
    runner = engine.runner
    assert runner.graphs is not None and sorted(runner.graphs.graphs) == [1, 2, 4, 8]
    with torch.inference_mode():
        _padded_equals_eager(runner, runner.graphs, replay=True)
    assert runner.graphs.replays == 1


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_graphs_generates_what_the_eager_engine_does_on_cuda(tiny_llama: Path, dtype: str):
    prompts = [[5 + i, 17, 42 + 3 * i] + list(range(60, 60 + 4 * i)) for i in range(6)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {}
    for graphs in (True, False):
        engine = engine_for(tiny_llama, device="cuda", dtype=dtype, max_num_seqs=8, max_model_len=256,
                            cuda_graphs=graphs)
        outs[graphs] = [o.output_token_ids for o in engine.generate(prompts, params)]
        assert (engine.runner.graphs is not None) == graphs
        if graphs:
            assert engine.runner.graphs.replays >= 20  # the decode steps were replays
    agree = sum(a == b for x, y in zip(outs[True], outs[False]) for a, b in zip(x, y))
    total = sum(len(x) for x in outs[False])
    # float32 replays the same kernels on the same inputs; bf16 matmuls may pick another algorithm for the
    # padded batch (a last-bit difference can flip a near-tie of a random model), so it gets a little slack.
    assert agree == total if dtype == "float32" else agree >= 0.95 * total, (agree, total)


SENSOR_TEXTS = ["Hive 7 at the orchard reports brood temperature 41.2 C and humidity 18% at noon.",
                "Acoustic sensor on hive 3: piping detected three times in the last hour, colony weight falling.",
                "Entrance camera counts 12 bees per minute, down from 140 yesterday; outside air 9 C and rain.",
                "Hive 12 lid switch opened at 02:14, no beekeeper visit scheduled; accelerometer shows knocks."]


def real_student_tracks_cpu_float32(device: str) -> None:
    """Greedy decode of the shipped edge student on ``device`` in bf16 (CUDA: decode steps are graph replays),
    checked token by token against the CPU float32 engine fed the same sequences (teacher-forced): its picks
    agree almost everywhere, and where they differ the float32 logits call it a near-tie."""
    from apiary.cloud.engine import EngineConfig, LLMEngine
    from apiary.shared import assets
    from tests.cloud.engine.conftest import prompt_logits

    path = assets.model_file("edge-student")
    ours = LLMEngine(EngineConfig(model_path=path, device=device, dtype="bfloat16", kv_cache_bytes=256 << 20,
                                  max_num_seqs=8, max_model_len=512, enable_prefix_caching=False))
    ids = [ours.tokenizer.encode(t) for t in SENSOR_TEXTS]
    outs = ours.generate(ids, SamplingParams(max_tokens=24, ignore_eos=True))
    if device == "cuda":
        assert ours.runner.graphs is not None and ours.runner.graphs.replays >= 20
    reference = LLMEngine(EngineConfig(model_path=path, dtype="float32", kv_cache_bytes=256 << 20,
                                       max_num_batched_tokens=1024, enable_prefix_caching=False))
    agree = total = 0
    for prompt, out in zip(ids, outs):
        _, logits = prompt_logits(reference, prompt + out.output_token_ids, use_prefix_cache=False)
        picks = logits[len(prompt) - 1:-1]  # float32's view of every position our engine generated
        got = torch.tensor(out.output_token_ids)
        for pos in torch.nonzero(picks.argmax(-1) != got).flatten().tolist():
            gap = picks[pos].max() - picks[pos, got[pos]]
            assert gap < 1.0, f"position {pos}: {got[pos].item()} is {gap:.2f} below float32's pick, not a near-tie"
        agree += int((picks.argmax(-1) == got).sum())
        total += len(got)
    assert agree >= 0.9 * total, (agree, total)


@needs_cuda
@pytest.mark.timeout(600)
def test_the_real_student_decoded_on_cuda_with_graphs_tracks_the_cpu_float32_engine():
    real_student_tracks_cpu_float32("cuda")
