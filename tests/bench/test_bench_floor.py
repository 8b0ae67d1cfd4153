"""The matmul floor (bench.floor); its columns in ``apiary bench engine`` are checked in test_bench_engine.py."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from apiary.bench import floor

SMOLLM2_135M = SimpleNamespace(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                               num_kv_heads=3, head_dim=64)


def test_flops_per_token_count_every_projection_once() -> None:
    body, head = floor.flops_per_token(SMOLLM2_135M)
    per_layer = 576 * (9 + 6) * 64 + 576 * 576 + 576 * 2 * 1536 + 1536 * 576  # q/k/v, o, gate/up, down
    assert body == 2 * 30 * per_layer
    assert head == 2 * 49152 * 576
    assert round((body + head) / 1e9, 2) == 0.27  # the issue's ~0.27 GFLOP per token


def test_the_head_runs_once_per_generated_token_and_the_body_for_every_position() -> None:
    body, head = floor.flops_per_token(SMOLLM2_135M)
    # two requests: prompts of 10 and 20 tokens, 5 outputs each: the body sees 30 + 10 - 2 positions
    assert floor.workload_flops(SMOLLM2_135M, 30, 10, 2) == body * 38 + head * 10


def test_the_measured_rate_is_a_positive_number_of_gflops() -> None:
    assert floor.matmul_gflops(SMOLLM2_135M, torch.float32, seconds=0.2) > 0


def test_the_rate_measured_in_a_fresh_process_is_a_positive_number_of_gflops() -> None:
    assert floor.matmul_gflops_fresh(SMOLLM2_135M, torch.float32, threads=1, seconds=0.2) > 0

