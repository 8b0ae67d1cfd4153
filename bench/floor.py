"""The matmul floor of a workload: how fast it could run if the CPU did nothing but its projections.

A decoder's time is mostly its linear layers: per token ``2 * params`` FLOPs for the body (q/k/v,
o, gate/up, down of every layer) and ``2 * vocab * hidden`` for the LM head of each token that
samples. The floor is those FLOPs divided by the rate this CPU sustains on the model's own
projection shapes in the engine's dtype, measured here, in this process, with the engine's
threads. ``floor / wall`` says how much of the machine the engine turns into useful work;
attention, sampling and scheduling are what it spends the rest on.
"""
from __future__ import annotations

import time
from typing import Any

MATMUL_ROWS = 256  # tokens per measured matmul: a batched decode step or a prefill chunk


def projection_shapes(mc: Any) -> list[tuple[int, int]]:
    """(in, out) of one layer's projections, fused as the engine runs them (q/k/v together, gate/up together)."""
    qkv = (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
    return [(mc.hidden_size, qkv), (mc.num_heads * mc.head_dim, mc.hidden_size),
            (mc.hidden_size, 2 * mc.intermediate_size), (mc.intermediate_size, mc.hidden_size)]


def flops_per_token(mc: Any) -> tuple[float, float]:
    """(body, LM head) matmul FLOPs of one token: every token runs the body, only sampling tokens the head."""
    body = 2.0 * mc.num_layers * sum(i * o for i, o in projection_shapes(mc))
    return body, 2.0 * mc.vocab_size * mc.hidden_size


def workload_flops(mc: Any, prompt_tokens: int, output_tokens: int, requests: int) -> float:
    """Each prompt token and each generated token runs the body; the head runs once per generated token
    (the last prompt position samples the first output, each later step one more)."""
    body, head = flops_per_token(mc)
    return body * (prompt_tokens + output_tokens - requests) + head * output_tokens


def matmul_gflops(mc: Any, dtype: Any, seconds: float = 1.5) -> float:
    """Sustained GFLOP/s of ``F.linear`` on this model's projection shapes, ``MATMUL_ROWS`` tokens at a time."""
    import torch
    import torch.nn.functional as F

    shapes = projection_shapes(mc)
    x = {i: torch.randn(MATMUL_ROWS, i).to(dtype) for i, _ in shapes}
    w = [(torch.randn(o, i).to(dtype) / i ** 0.5, i) for i, o in shapes]
    flops = 2.0 * MATMUL_ROWS * sum(i * o for i, o in shapes)
    with torch.inference_mode():
        for weight, i in w:  # warm-up (oneDNN primitive creation)
            F.linear(x[i], weight)
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds or calls < 3:
            for weight, i in w:
                F.linear(x[i], weight)
            calls += 1
    return flops * calls / elapsed / 1e9


def matmul_gflops_fresh(mc: Any, dtype: Any, threads: int, seconds: float = 1.5) -> float:
    """``matmul_gflops`` measured in a fresh interpreter with the engine's thread settings and ``threads`` torch
    threads. Why: in a benchmark process that has run numba's kernels on oneTBB's pool, TBB's idle workers
    took CPU from torch's threads and the same probe measured 335-376 GFLOP/s against 376-387, which would
    flatter every "% of floor" figure."""
    import json
    import subprocess
    import sys

    fields = {k: getattr(mc, k) for k in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim")}
    code = ("import json, sys; from apiary.cloud.engine import threads; import torch; "
            "from types import SimpleNamespace; from apiary.bench import floor; "
            f"torch.set_num_threads({int(threads)}); "
            f"mc = SimpleNamespace(**json.loads({json.dumps(json.dumps(fields))})); "
            f"print(floor.matmul_gflops(mc, getattr(torch, {str(dtype).removeprefix('torch.')!r}), {float(seconds)!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def step_flops(mc: Any, rows: int, head_rows: int) -> float:
    """Matmul FLOPs of steps that ran ``rows`` rows through the body and ``head_rows`` through the LM head."""
    body, head = flops_per_token(mc)
    return body * rows + head * head_rows


def weight_params(mc: Any) -> tuple[int, int]:
    """(body, LM head) parameters a decode step reads: every projection once per step, whatever its rows."""
    return mc.num_layers * sum(i * o for i, o in projection_shapes(mc)), mc.vocab_size * mc.hidden_size


def decode_bytes(mc: Any, steps: int, context_tokens: int, body_bytes: float, head_bytes: float,
                 kv_bytes_per_token: int) -> float:
    """What ``steps`` decode-only steps must read from memory at least: every projection's weights and the LM head's
    once a step (``body_bytes``/``head_bytes`` per parameter, as the engine holds them), and the cached K/V of every
    token their attention saw (``context_tokens``, summed over the steps' rows). Why: at a few rows a step a decode
    step does too little arithmetic per weight byte to reach the matmul rate, so the bytes it streams bound it
    first; the larger of the two floors is the step's roofline."""
    body, head = weight_params(mc)
    return steps * (body * body_bytes + head * head_bytes) + context_tokens * kv_bytes_per_token


def stream_gbps(threads: int, seconds: float = 2.0) -> float:
    """GB/s this CPU reads with ``threads`` threads: ``torch.sum`` over a 1 GiB float32 tensor (far past the caches),
    best of the calls in ``seconds``, in a fresh interpreter (see ``matmul_gflops_fresh``)."""
    import subprocess
    import sys

    code = ("import time, torch; from apiary.cloud.engine import threads; "
            f"torch.set_num_threads({int(threads)}); x = torch.ones(1 << 28); x.sum(); best = 1e9; start = time.perf_counter()\n"
            f"while time.perf_counter() - start < {float(seconds)!r}:\n"
            "    t = time.perf_counter(); x.sum(); best = min(best, time.perf_counter() - t)\n"
            "print(x.numel() * 4 / best / 1e9)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return float(done.stdout.strip().splitlines()[-1])
