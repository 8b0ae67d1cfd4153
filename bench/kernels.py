"""Triton kernels vs torch references on a CUDA GPU: decode attention GB/s and % of peak, plus prefill, norm, rotary.

Written to run as one short script (a few minutes) on an H100/H200-class GPU. Decode attention
runs at Llama-8B-like shapes (32 query heads, 8 KV heads, head_dim 128, bf16, 16-token blocks,
batch 64, contexts 2k-8k plus a ragged 1..8k batch). For each kernel it reports the time per
call of the Triton kernel and of the torch reference (gather + ``scaled_dot_product_attention``
for attention), the bandwidth the Triton kernel achieves on the bytes it must move (K/V actually
read + q + out + block tables), that bandwidth as a fraction of the device's peak (from its name,
or ``--peak-gbs``) and of a plain device-to-device copy of the same bytes measured in the same
run, and the largest difference between the two outputs. Times are back-to-back calls between
two CUDA events, with every working set far larger than L2, so nothing is served from cache.

Then, unless ``--no-engine``, end-to-end decode throughput of ``apiary.cloud.engine`` with the Triton
path vs the torch path (skipped with a note if the engine is not importable or the model is absent).

``--device cpu --interpret`` is a correctness smoke only: it runs tiny shapes through the Triton
interpreter and reports errors; interpreter times say nothing about GPU speed and no bandwidth
is reported. Without a GPU and without that flag the command refuses.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import typer

# Peak HBM bandwidth, GB/s (vendor figures). Longest / most specific names first.
PEAK_GBS: list[tuple[str, float]] = [
    ("GH200", 4000.0), ("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIE", 2000.0), ("H100", 3350.0),
    ("H800", 3350.0), ("B200", 8000.0), ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIE", 1935.0),
    ("A100", 1555.0), ("L40S", 864.0), ("L40", 864.0), ("L4", 300.0), ("A10G", 600.0), ("A10", 600.0),
    ("RTX 4090", 1008.0),
]


def device_peak_gbs(name: str) -> float | None:
    """The vendor peak memory bandwidth for a CUDA device name, or None if unknown."""
    upper = name.upper()
    for key, gbs in PEAK_GBS:
        if key in upper:
            return gbs
    return None


def _time_cuda(fn: Callable[[], Any], iters: int) -> float:
    """Milliseconds per call: ``iters`` calls back to back between two CUDA events, after a warmup."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _time_cpu(fn: Callable[[], Any], iters: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e3


def _paged_batch(context_lens: list[int], q_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype, device: str, seed: int = 0) -> dict[str, Any]:
    """A batch whose K/V sit in shuffled cache blocks (as after a while of serving), plus its queries."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks = [max(1, -(-c // block_size)) for c in context_lens]
    num_blocks = sum(blocks)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(context_lens), max(blocks)), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = perm[at:at + n].int()
        at += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    q = torch.randn(sum(q_lens), num_heads, head_dim, dtype=dtype, device=device)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables.to(device),
                context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device), cu_seqlens_q=cu,
                scale=head_dim ** -0.5)


def command(
    batch: int = typer.Option(64, help="decode batch size"),
    contexts: str = typer.Option("2048,4096,8192", help="comma-separated decode context lengths"),
    num_heads: int = typer.Option(32, help="query heads (Llama-8B: 32)"),
    num_kv_heads: int = typer.Option(8, help="KV heads (Llama-8B: 8)"),
    head_dim: int = typer.Option(128, help="head dimension"),
    block_size: int = typer.Option(16, help="tokens per KV-cache block"),
    dtype: str = typer.Option("bfloat16", help="bfloat16 | float16 | float32"),
    iters: int = typer.Option(20, help="timed calls per measurement"),
    peak_gbs: float = typer.Option(0.0, help="device peak memory bandwidth in GB/s; 0 = from the device name"),
    device: str = typer.Option("cuda", help="cuda, or cpu together with --interpret for a correctness smoke"),
    interpret: bool = typer.Option(False, help="CPU only: run tiny shapes in the Triton interpreter (no speed)"),
    engine: bool = typer.Option(True, help="also measure end-to-end cloud.engine decode, Triton vs torch path"),
    model: str = typer.Option("", help="model for the engine run (GGUF/HF path); default: the smollm2-135m-q4 asset"),
    engine_batch: int = typer.Option(64, help="engine run: concurrent requests"),
    engine_prompt: int = typer.Option(128, help="engine run: prompt tokens per request"),
    engine_tokens: int = typer.Option(128, help="engine run: generated tokens per request"),
) -> None:
    if device == "cpu":
        if not interpret:
            typer.echo("apiary bench kernels measures GPU kernels: on CPU it only offers a correctness smoke "
                       "(--device cpu --interpret), which reports no speed.", err=True)
            raise typer.Exit(2)
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of a Triton kernel module
        _smoke(iters=1)
        return
    if device != "cuda":
        typer.echo(f"--device must be cuda or cpu, got {device!r}", err=True)
        raise typer.Exit(2)

    import torch

    if not torch.cuda.is_available():
        typer.echo("apiary bench kernels needs a CUDA GPU (none is visible here). "
                   "For a CPU correctness smoke of the same kernels run: apiary bench kernels --device cpu --interpret",
                   err=True)
        raise typer.Exit(2)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        typer.echo("TRITON_INTERPRET is set: the kernels would run in the interpreter; unset it to benchmark.",
                   err=True)
        raise typer.Exit(2)
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(dtype)
    if torch_dtype is None:
        typer.echo(f"--dtype must be bfloat16, float16 or float32, got {dtype!r}", err=True)
        raise typer.Exit(2)
    ctx_list = [int(c) for c in contexts.split(",") if c.strip()]
    measure(batch, ctx_list, num_heads, num_kv_heads, head_dim, block_size, torch_dtype, iters, peak_gbs,
            engine, model, engine_batch, engine_prompt, engine_tokens)


def measure(batch: int, contexts: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
            dtype, iters: int, peak_gbs: float, engine: bool, model: str, engine_batch: int, engine_prompt: int,
            engine_tokens: int, tokens: int = 16384, prefill_len: int = 2048, device: str = "cuda",
            out: Path | None = None) -> dict[str, Any]:
    """The GPU benchmark proper. ``device="cpu"`` (with the interpreter) exists only so that tests can run
    this exact code path on tiny shapes before it meets a GPU; its numbers mean nothing."""
    import random

    import torch

    from apiary.bench.common import report
    from apiary.kernels import kv_cache, paged_attention, reference, rms_norm, rotary

    on_gpu = device == "cuda"
    name = torch.cuda.get_device_name() if on_gpu else "cpu (Triton interpreter, not a measurement)"
    peak = peak_gbs or device_peak_gbs(name)
    timer = _time_cuda if on_gpu else _time_cpu
    few = max(3, iters // 4) if on_gpu else 1  # calls for slow paths (torch reference, prefill)

    def free() -> None:
        if on_gpu:
            torch.cuda.empty_cache()

    elem = torch.tensor([], dtype=dtype).element_size()
    rows: list[list[Any]] = []
    t_start = time.perf_counter()

    def copy_gbs(num_bytes: int) -> float:
        """Bandwidth of a plain device-to-device copy moving ``num_bytes`` (read + write)."""
        src = torch.empty(num_bytes // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        ms = timer(lambda: dst.copy_(src), iters)
        del src, dst
        return num_bytes / ms / 1e6

    def add(kernel: str, shape: str, triton_ms: float, torch_ms: float, num_bytes: int | None, copy: float | None,
            err: float, flops: float | None = None) -> None:
        gbs = num_bytes / triton_ms / 1e6 if num_bytes else None
        rows.append([kernel, shape, round(triton_ms, 4), round(torch_ms, 4), round(torch_ms / triton_ms, 2),
                     round(gbs, 1) if gbs else "-", f"{gbs / peak:.0%}" if gbs and peak else "-",
                     f"{gbs / copy:.0%}" if gbs and copy else "-",
                     round(flops / triton_ms / 1e9, 1) if flops else "-", f"{err:.2e}"])
        print(rows[-1], flush=True)

    # ---- decode attention: uniform contexts, then a ragged batch
    rng = random.Random(0)
    cases = [(f"B{batch} ctx {c}", [c] * batch) for c in contexts]
    top = max(contexts)
    cases.append((f"B{batch} ctx ragged 1..{top}", [rng.randint(1, top) for _ in range(batch)]))
    decode_copy: float | None = None
    for label, ctx in cases:
        d = _paged_batch(ctx, [1] * batch, num_heads, num_kv_heads, head_dim, block_size, dtype, device)
        args = (d["q"], d["k_cache"], d["v_cache"], d["block_tables"], d["context_lens"], d["scale"])
        out_t = paged_attention.paged_decode_attention(*args)
        out_r = reference.paged_decode_attention(*args)
        err = (out_t.float() - out_r.float()).abs().max().item()
        t_ms = timer(lambda: paged_attention.paged_decode_attention(*args), iters)
        r_ms = timer(lambda: reference.paged_decode_attention(*args), few)
        num_bytes = (sum(ctx) * num_kv_heads * head_dim * 2 * elem + 2 * batch * num_heads * head_dim * elem
                     + d["block_tables"].numel() * 4)
        copy = copy_gbs(num_bytes)
        decode_copy = copy
        add("decode attention", label, t_ms, r_ms, num_bytes, copy, err)
        del d, args, out_t, out_r
        free()
    rows.append(["d2d copy", "same bytes as last decode row", "-", "-", "-", round(decode_copy or 0, 1),
                 f"{decode_copy / peak:.0%}" if decode_copy and peak else "-", "100%", "-", "-"])

    # ---- prefill attention: fresh prompts, and a mixed chunked-prefill + decode batch
    n, chunk = prefill_len, prefill_len // 4
    for label, ctx, q_lens in [(f"4 prompts x {n}", [n] * 4, [n] * 4),
                               (f"chunk {chunk} @ctx {n} + 63 decodes @ctx {n}", [n] * 64, [chunk] + [1] * 63)]:
        d = _paged_batch(ctx, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device)
        args = (d["q"], d["k_cache"], d["v_cache"], d["block_tables"], d["cu_seqlens_q"], d["context_lens"],
                d["scale"])
        err = (paged_attention.paged_prefill_attention(*args).float()
               - reference.paged_prefill_attention(*args).float()).abs().max().item()
        t_ms = timer(lambda: paged_attention.paged_prefill_attention(*args), max(few, iters // 2))
        r_ms = timer(lambda: reference.paged_prefill_attention(*args), few)
        pairs = sum(ql * (c - ql) + ql * (ql + 1) // 2 for c, ql in zip(ctx, q_lens))  # visible (query, key) pairs
        add("prefill attention", label, t_ms, r_ms, None, None, err, flops=4.0 * pairs * num_heads * head_dim)
        del d, args
        free()

    # ---- fused RMSNorm + residual, rotary, KV write: 16k tokens, Llama-8B widths
    hidden = num_heads * head_dim
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    res = torch.randn_like(x)
    w = torch.randn(hidden, dtype=dtype, device=device)
    err = (rms_norm.rms_norm(x, w, 1e-5, res)[0].float() - reference.rms_norm(x, w, 1e-5, res)[0].float()).abs().max()
    num_bytes = 4 * x.numel() * elem + hidden * elem
    add("rms_norm + residual", f"{tokens} x {hidden}", timer(lambda: rms_norm.rms_norm(x, w, 1e-5, res), iters),
        timer(lambda: reference.rms_norm(x, w, 1e-5, res), iters), num_bytes, copy_gbs(num_bytes), err.item())
    del x, res

    q = torch.randn(tokens, num_heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    cos_sin = reference.rotary_cos_sin_cache(8192, head_dim, device=device)
    pos = torch.randint(0, 8192, (tokens,), device=device)
    err = (rotary.apply_rotary(q, k, pos, cos_sin)[0].float() - reference.apply_rotary(q, k, pos, cos_sin)[0].float())
    num_bytes = 2 * (q.numel() + k.numel()) * elem + tokens * (head_dim * 4 + 8)
    add("rotary q+k", f"{tokens} tok, {num_heads}/{num_kv_heads} heads",
        timer(lambda: rotary.apply_rotary(q, k, pos, cos_sin), iters),
        timer(lambda: reference.apply_rotary(q, k, pos, cos_sin), iters), num_bytes, copy_gbs(num_bytes),
        err.abs().max().item())

    num_blocks = 2 * -(-tokens // block_size)  # half the slots get written
    kc = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    kv_cache.write_kv(k, k, kc, vc, slots)
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    reference.write_kv(k, k, kr, vr, slots)
    err = (kc.float() - kr.float()).abs().max().item()
    num_bytes = 4 * k.numel() * elem + tokens * 8
    add("write_kv", f"{tokens} tok, {num_kv_heads} kv heads",
        timer(lambda: kv_cache.write_kv(k, k, kc, vc, slots), iters),
        timer(lambda: reference.write_kv(k, k, kr, vr, slots), iters), num_bytes, copy_gbs(num_bytes), err)
    del q, k, kc, vc, kr, vr
    free()
    kernel_seconds = time.perf_counter() - t_start

    engine_result = _engine_run(model, engine_batch, engine_prompt, engine_tokens) if engine else {
        "skipped": "--no-engine"}
    if "triton_tok_s" in engine_result and "torch_tok_s" in engine_result:
        e = engine_result
        rows.append(["engine generate (e2e)",
                     f"{engine_batch} req x {engine_prompt}+{engine_tokens} tok: {e['triton_tok_s']:.0f} vs "
                     f"{e['torch_tok_s']:.0f} output tok/s (decode {e.get('triton_decode_tok_s', 0):.0f} vs "
                     f"{e.get('torch_decode_tok_s', 0):.0f}); eager Triton {e.get('eager_tok_s', 0):.0f}"
                     + (f"; stand-in of {e['stand_in_of']}" if "stand_in_of" in e else ""),
                     round(e["triton_s"] * 1e3, 1), round(e["torch_s"] * 1e3, 1),
                     round(e["torch_s"] / e["triton_s"], 2), "-", "-", "-", "-", "-"])

    report("kernels", f"Triton kernels vs torch reference on {name} ({dtype}, peak {peak or '?'} GB/s)".replace(
        "torch.", ""),
        ["kernel", "shape", "triton ms", "torch ms", "speedup", "triton GB/s", "% peak", "% copy", "TFLOP/s",
         "max |diff|"], rows,
        {"device": name, "peak_gbs": peak, "dtype": str(dtype), "torch": torch.__version__,
         "triton": __import__("triton").__version__, "heads": [num_heads, num_kv_heads, head_dim],
         "block_size": block_size, "iters": iters, "kernel_seconds": round(kernel_seconds, 1),
         "engine": engine_result}, out=out)
    if "triton_tok_s" in engine_result:
        print("engine: " + ", ".join(f"{k} {v:.0f}" for k, v in engine_result.items() if k.endswith("tok_s")))
    if "failed" in engine_result or "triton_tok_s" not in engine_result:
        print(f"engine run not measured: {engine_result.get('skipped') or engine_result.get('failed')}")
    return {"rows": rows, "engine": engine_result, "peak_gbs": peak}


# The engine run's configurations, in order: CUDA graphs for decode (the default), the same Triton path
# eager, and the torch reference path (eager: graphs are captured from the Triton kernels only).
ENGINE_RUNS = (("graphs", "triton", True), ("eager", "triton", False), ("torch", "torch", False))
ENGINE_KV_BYTES = 8 << 30  # each engine's KV pool: 256 requests x 256 tokens need ~1.5 GB for SmolLM2-135M


def _engine_run(model: str, batch: int, prompt_len: int, max_tokens: int) -> dict[str, Any]:
    """End-to-end generate() throughput, same requests: CUDA graphs vs eager Triton vs the torch path.

    Per configuration, the best of two runs each of ``max_tokens`` and of 1 output token: the first is the
    end-to-end rate, their difference isolates decode (``batch * (max_tokens - 1)`` tokens)."""
    try:
        from apiary.cloud.engine import EngineConfig, LLMEngine, SamplingParams
    except ImportError as e:
        return {"skipped": f"apiary.cloud.engine not importable: {e}"}
    import gc
    import json
    import random

    import torch

    from apiary.kernels import ops

    if not model:  # only an already-cached copy: GPU hosts are often offline, and pip retries would stall
        from apiary.shared import assets

        cached = assets.cache_dir() / assets.get_asset("smollm2-135m-q4").filename
        if not cached.exists():
            return {"skipped": f"no model: pass --model PATH (nothing cached at {cached})"}
        model = str(cached)
    result: dict[str, Any] = {"model": model, "batch": batch, "prompt_tokens": prompt_len, "max_tokens": max_tokens}
    config_file = Path(model) / "config.json"
    if config_file.is_file() and "stand_in_of" in (cfg := json.loads(config_file.read_text())):
        result["stand_in_of"] = cfg["stand_in_of"]  # bench/stand_in.py: same shapes, random weights
    prompts: list[list[int]] = []
    previous = ops.get_backend()
    for name, backend, graphs in ENGINE_RUNS:
        eng = None
        try:
            ops.set_backend(backend)
            t0 = time.perf_counter()
            eng = LLMEngine(EngineConfig(model_path=model, device="cuda", dtype="bfloat16",
                                         enable_prefix_caching=False, max_num_seqs=max(batch, 1),
                                         max_model_len=prompt_len + max_tokens, kv_cache_bytes=ENGINE_KV_BYTES,
                                         max_num_batched_tokens=8192, cuda_graphs=graphs))
            result[f"{name}_start_s"] = round(time.perf_counter() - t0, 2)
            if not prompts:  # random ids of ordinary tokens, the same for every configuration
                rng, vocab = random.Random(0), eng.model_config.vocab_size
                prompts = [[rng.randrange(min(1000, vocab // 4), min(40000, vocab)) for _ in range(prompt_len)]
                           for _ in range(batch)]
            eng.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up / compile
            for _ in range(2):  # shared GPUs are noisy too: the faster of two is kept
                for tokens, key in ((max_tokens, "s"), (1, "prefill_s")):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    outs = eng.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
                    torch.cuda.synchronize()
                    seconds = time.perf_counter() - t0
                    if f"{name}_{key}" not in result or seconds < result[f"{name}_{key}"]:
                        result[f"{name}_{key}"] = seconds
                        if tokens == max_tokens:
                            result[f"{name}_tok_s"] = sum(len(o.output_token_ids) for o in outs) / seconds
            decode_s = result[f"{name}_s"] - result[f"{name}_prefill_s"]
            if decode_s > 0:
                result[f"{name}_decode_tok_s"] = batch * (max_tokens - 1) / decode_s
            if eng.runner.graphs is not None:
                result[f"{name}_replays"] = eng.runner.graphs.replays
        except Exception as e:  # keep what the other configurations measure: report this one's failure
            result[f"{name}_failed"] = repr(e)
        finally:
            ops.set_backend(previous)
            del eng
            gc.collect()
            torch.cuda.empty_cache()
    failures = [f"{name}: {result[name + '_failed']}" for name, _, _ in ENGINE_RUNS if name + "_failed" in result]
    if failures:
        result["failed"] = "; ".join(failures)
    # The names bench gpu and earlier records read: the Triton path (graphs where they ran) and torch's.
    best = "graphs" if "graphs_tok_s" in result else "eager"
    for key in ("tok_s", "s", "decode_tok_s"):
        if f"{best}_{key}" in result:
            result[f"triton_{key}"] = result[f"{best}_{key}"]
    return result


def _smoke(iters: int) -> None:
    """CPU + Triton interpreter: every kernel on tiny shapes against the reference. Errors only, no speed."""
    import torch

    from apiary.bench.common import RESULTS_DIR, report
    from apiary.kernels import kv_cache, paged_attention, reference, rms_norm, rotary, triton_support

    if not triton_support.INTERPRETED:
        print("the Triton kernels were already imported in compiled mode; run this in a fresh process", file=sys.stderr)
        raise typer.Exit(2)
    rows: list[list[Any]] = []

    def add(kernel: str, shape: str, out: torch.Tensor, ref: torch.Tensor, fn: Callable[[], Any]) -> None:
        rows.append([kernel, shape, f"{(out.float() - ref.float()).abs().max().item():.2e}",
                     round(_time_cpu(fn, iters), 1)])

    dt = torch.bfloat16
    d = _paged_batch([70, 16, 1, 33], [1] * 4, 8, 2, 64, 16, dt, "cpu")
    args = (d["q"], d["k_cache"], d["v_cache"], d["block_tables"], d["context_lens"], d["scale"])
    for part in (512, 32):
        add("decode attention", f"ctx 70/16/1/33, split-K partition {part}",
            paged_attention.paged_decode_attention(*args, partition_size=part),
            reference.paged_decode_attention(*args),
            lambda: paged_attention.paged_decode_attention(*args, partition_size=part))
    d = _paged_batch([40, 9, 64], [7, 9, 1], 8, 2, 64, 16, dt, "cpu")
    args = (d["q"], d["k_cache"], d["v_cache"], d["block_tables"], d["cu_seqlens_q"], d["context_lens"], d["scale"])
    add("prefill attention", "chunk 7@40, prompt 9, decode 1@64", paged_attention.paged_prefill_attention(*args),
        reference.paged_prefill_attention(*args), lambda: paged_attention.paged_prefill_attention(*args))
    x, r, w = torch.randn(8, 576, dtype=dt), torch.randn(8, 576, dtype=dt), torch.randn(576, dtype=dt)
    add("rms_norm + residual", "8 x 576", rms_norm.rms_norm(x, w, 1e-5, r)[0], reference.rms_norm(x, w, 1e-5, r)[0],
        lambda: rms_norm.rms_norm(x, w, 1e-5, r))
    q, k = torch.randn(8, 9, 64, dtype=dt), torch.randn(8, 3, 64, dtype=dt)
    cs, pos = reference.rotary_cos_sin_cache(64, 64), torch.arange(8) * 7
    add("rotary q+k", "8 tok, 9/3 heads", rotary.apply_rotary(q, k, pos, cs)[0],
        reference.apply_rotary(q, k, pos, cs)[0], lambda: rotary.apply_rotary(q, k, pos, cs))
    kc = torch.zeros(4, 16, 3, 64, dtype=dt)
    kr = kc.clone()
    slots = torch.tensor([5, -1, 17, 40, 63, 0, 2, 9])
    kv_cache.write_kv(k, k, kc, kc.clone(), slots)
    reference.write_kv(k, k, kr, kr.clone(), slots)
    add("write_kv", "8 tok, 3 kv heads", kc, kr, lambda: kv_cache.write_kv(k, k, kc, kc.clone(), slots))
    report("kernels", "Triton interpreter on CPU: correctness smoke (times are the interpreter's, NOT kernel speed)",
           ["kernel", "shape", "max |triton - torch|", "interpreter ms (not a speed number)"], rows,
           {"mode": "cpu-interpret-smoke", "dtype": "bfloat16"}, out=RESULTS_DIR / "kernels-cpu-smoke.json")
