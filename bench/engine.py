"""Engine throughput: continuous batching vs batch size 1 vs HF generate vs llama.cpp on one workload.

Every system serves the same seeded requests (prompt and output lengths drawn uniformly,
the same prompt token ids everywhere, greedy, EOS ignored so every system generates exactly
the same number of tokens) from the same GGUF file, one system after the other in one run,
with the same thread count. Our engine gets all requests at once (continuous batching), and
again with ``max_num_seqs=1``; transformers ``generate`` and llama-cpp-python serve them one
at a time. Reported: output tokens/s and the ratios between systems, plus the paged KV cache's
waste (slots allocated but unused) against contiguous per-request allocation. The machine is
shared and noisy: the load average before and after each system is recorded; compare the
rows of one run, not numbers across runs. With ``--rounds N`` every system runs N times,
interleaved, and the table shows each system's median round and the median per-round ratio.
With ``--background N``, N busy processes (``while :; do :; done``) run beside every system's
run, started before it and stopped after it, alike for all: a shared CPU, as in the demo or on a
server with its REST layer, broker and database. The table shows each system's CPU use (its
process's CPU seconds per wall second) beside its throughput.
``llama-server`` and ``cloud-http`` are servers through HTTP (``apiary.bench.http_serving``; ``-ngram``: both with
n-gram speculation, ours under its adaptive policy, llama.cpp's ``ngram-simple`` at our lookup and draft lengths): each round
starts the server fresh, probes its warm-up (first vs tenth TTFT), then streams the same requests
from ``--clients`` concurrent clients; their CPU % and peak RSS are the server process's.
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

WORDS = ("hive colony brood queen worker drone nectar pollen honey comb frame wax propolis forage swarm "
         "temperature humidity weight sensor battery solar morning evening meadow flower clover heather "
         "entrance guard robbing varroa mite inspection super winter spring summer autumn beekeeper smoke "
         "the a of and to in is was rose fell steady kg degrees percent alert normal check report hive7 "
         "12 3.5 2024 why how when colony's bees' calm busy loud quiet").split()
SYSTEMS = ("engine", "engine-torch-attn", "engine-fp32", "engine-bf16w", "engine-bf16w-kv32", "engine-int8",
           "engine-int8-fp32", "engine-kv8", "engine-ngram", "engine-bs1", "hf",
           "llama-cpp", "llama-server", "llama-server-ngram", "cloud-http", "cloud-http-dtype-kv", "cloud-http-bf16w",
           "cloud-http-int8", "cloud-http-kv8", "cloud-http-ngram")
HTTP_SYSTEMS = ("llama-server", "llama-server-ngram", "cloud-http", "cloud-http-dtype-kv", "cloud-http-bf16w",
                "cloud-http-int8", "cloud-http-kv8", "cloud-http-ngram")


@dataclass(slots=True)
class Request:
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class Result:
    system: str
    detail: str
    wall: float
    output_tokens: int
    ttfts: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    cpu_s: float = 0.0  # this process's CPU seconds (user + system) during the run

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[list[subprocess.Popen]]:
    """``n`` shell loops that each keep one CPU busy while the block runs; stopped (by pid) after it."""
    procs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def make_workload(tokenizer: Any, n: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  seed: int) -> list[Request]:
    """``n`` requests with uniform prompt/output lengths; prompts are tokenized random word sequences."""
    import random

    rng = random.Random(seed)
    work = []
    for i in range(n):
        length = rng.randint(*prompt_range)
        ids: list[int] = []
        while len(ids) < length:
            ids += tokenizer.encode(f"Report {i}: " + " ".join(rng.choice(WORDS) for _ in range(length)))
        work.append(Request(prompt=ids[:length], max_tokens=rng.randint(*output_range)))
    return work


def run_engine(engine: Any, work: list[Request], max_num_seqs: int) -> Result:
    from apiary.cloud.engine import SamplingParams

    engine.config.max_num_seqs = max_num_seqs
    engine.reset_prefix_cache()
    before = engine.metrics()
    start, cpu_start = time.perf_counter(), cpu_seconds()
    ids = [engine.add_request(r.prompt, params=SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
           for r in work]
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
    outs = [finals[i] for i in ids]
    assert all(len(o.output_token_ids) == r.max_tokens for o, r in zip(outs, work))
    after = engine.metrics()
    by_kind = {k: after[k] - before[k] for k in STEP_FIELDS}
    return Result("", "", wall, sum(r.max_tokens for r in work), [o.metrics.ttft for o in outs],
                  {"steps": after["steps"] - before["steps"], "preemptions": after["preemptions"] - before["preemptions"],
                   "kv_slot_waste": after["kv_slot_waste"], "tokens": [o.output_token_ids for o in outs],
                   "steps_by_kind": by_kind, "kv_bytes_per_token": after["kv_cache_bytes_per_token"],
                   "weight_bytes": weight_bytes(engine)}, cpu)


# The engine's step accounting by kind (EngineStats.record_step): prompt steps, decode-only steps
STEP_FIELDS = ("prompt_steps", "prompt_step_seconds", "prompt_step_rows", "prompt_step_sampled", "decode_steps",
               "decode_step_seconds", "decode_step_rows", "decode_step_sampled", "decode_step_context_tokens")


def weight_bytes(engine: Any) -> tuple[float, float]:
    """Bytes per parameter a decode step reads, (decoder projections, LM head), as ``engine`` holds them: int8
    weights 1 (their scales, and an int8 engine's first and last layers in its dtype, left out), bf16 or bf16-held
    weights 2, float32 4; a head that ranks in int8 (``int8.RefinedHead``) 1."""
    from apiary.cloud.engine.int8 import RefinedHead

    runner = engine.runner
    body = 1.0 if runner.weights == "int8" else 2.0 if runner.weights == "bf16" else float(runner.dtype.itemsize)
    return body, 1.0 if isinstance(runner.model.head, RefinedHead) else float(runner.dtype.itemsize)


def hf_model_from_gguf(path: Path) -> Any:
    """transformers' Llama with the GGUF's weights, loaded by transformers' own GGUF reader.

    (``from_pretrained(gguf_file=...)`` needs the accelerate package, which this project does not use.)
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF -> transformers mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


def run_hf(path: Path, work: list[Request]) -> Result:
    import torch

    model = hf_model_from_gguf(path)
    outputs = []
    start, cpu_start = time.perf_counter(), cpu_seconds()
    with torch.inference_mode():
        for r in work:
            ids = torch.tensor([r.prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=r.max_tokens,
                                 min_new_tokens=r.max_tokens, do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(r.prompt):].tolist())
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
    assert [len(o) for o in outputs] == [r.max_tokens for r in work]
    return Result("", "", wall, sum(r.max_tokens for r in work), extra={"tokens": outputs}, cpu_s=cpu)


def run_llama_cpp(path: Path, work: list[Request], threads: int) -> Result:
    import llama_cpp
    import numpy as np

    n_ctx = max(len(r.prompt) + r.max_tokens for r in work) + 8
    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                          verbose=False)
    n_vocab = llm.n_vocab()
    outputs = []
    try:
        start, cpu_start = time.perf_counter(), cpu_seconds()
        for r in work:
            llm.reset()
            llm.eval(r.prompt)
            tokens = []
            for i in range(r.max_tokens):  # greedy on the last logits, EOS ignored
                logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))
                tokens.append(int(logits.argmax()))
                if i + 1 < r.max_tokens:
                    llm.eval([tokens[-1]])
            outputs.append(tokens)
        wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
    finally:
        llm.close()
    return Result("", "", wall, sum(r.max_tokens for r in work), extra={"tokens": outputs}, cpu_s=cpu)


def run_llama_cpp_process(path: Path, work: list[Request], threads: int, env: dict[str, str]) -> Result:
    """``run_llama_cpp`` in a fresh interpreter with ``env``: llama.cpp as its users run it.

    In this process the engine has set its OpenMP wait policy, and llama.cpp's libgomp (its
    ``ggml_barrier`` is an OpenMP barrier) would share it; a child with the operator's own
    environment keeps the comparison to llama.cpp's defaults.
    """
    payload = json.dumps({"path": str(path), "threads": threads, "work": [[r.prompt, r.max_tokens] for r in work]})
    done = subprocess.run([sys.executable, "-m", "apiary.bench.engine"], input=payload, capture_output=True, text=True,
                          env=env, check=True)
    d = json.loads(done.stdout.splitlines()[-1])
    return Result("", "", d["wall"], d["output_tokens"], extra={"tokens": d["tokens"]}, cpu_s=d["cpu_s"])


def _llama_cpp_child() -> None:
    d = json.loads(sys.stdin.read())
    res = run_llama_cpp(Path(d["path"]), [Request(prompt, n) for prompt, n in d["work"]], d["threads"])
    print(json.dumps({"wall": res.wall, "output_tokens": res.output_tokens, "cpu_s": res.cpu_s,
                      "tokens": res.extra["tokens"]}))


FLOOR_DTYPES = {"engine": None, "engine-torch-attn": None, "engine-ngram": None, "cloud-http": None, "cloud-http-kv8": None,
                "cloud-http-ngram": None,
                "cloud-http-int8": None, "engine-kv8": None, "engine-int8": "int8",
                "engine-fp32": "float32", "engine-bs1": "float32", "engine-int8-fp32": "float32", "engine-bf16w": "float32",
                "engine-bf16w-kv32": "float32", "cloud-http-bf16w": None, "cloud-http-dtype-kv": None}


def matmul_floors(results: dict[str, Result], engines: dict[str, Any], dtype: str, work: list[Request],
                  seq_work: list[Request]) -> dict[str, dict[str, Any]]:
    """Each engine system's matmul floor (bench.floor): its workload's projection FLOPs at the rate this CPU
    sustains in the system's float dtype (int8 systems against their activations' dtype: they may beat it).
    Measured after the runs, with nothing beside them, as the machine's capability."""
    import torch

    from apiary.bench import floor

    mc = engines[dtype].runner.model_config
    rates: dict[str, float] = {}
    out: dict[str, dict[str, Any]] = {}
    for system in results:
        if system not in FLOOR_DTYPES:
            continue  # llama.cpp's quantized dot products have another floor
        key = FLOOR_DTYPES[system]
        engine = engines["int8"] if key == "int8" else engines[dtype]
        torch_dtype = torch.float32 if key == "float32" else engine.runner.dtype
        name = str(torch_dtype).removeprefix("torch.")
        if name not in rates:
            rates[name] = floor.matmul_gflops_fresh(mc, torch_dtype, torch.get_num_threads())
        reqs = seq_work if system == "engine-bs1" else work
        flops = floor.workload_flops(mc, sum(len(r.prompt) for r in reqs), sum(r.max_tokens for r in reqs), len(reqs))
        out[system] = {"dtype": name, "gflops": round(rates[name], 1), "workload_gflop": round(flops / 1e9, 1),
                       "seconds": flops / 1e9 / rates[name]}
        extra = results[system].extra
        kinds = extra.get("steps_by_kind")
        if kinds and kinds["prompt_step_seconds"] and kinds["decode_step_seconds"]:
            if "stream" not in rates:
                rates["stream"] = floor.stream_gbps(torch.get_num_threads())
            held = extra.get("weight_bytes") or (weight_bytes(engines[dtype]) if system in SERVED_AS_DEFAULT else None)
            out[system].update(step_floors(mc, kinds, rates[name], rates["stream"], held, extra["kv_bytes_per_token"]))
    return out


# HTTP systems whose server holds its weights as this process's default engine does (their decode roofline needs
# the bytes per parameter; the int8 and bf16-weight servers' are left out: their decode column shows no roofline)
SERVED_AS_DEFAULT = ("cloud-http", "cloud-http-dtype-kv", "cloud-http-kv8", "cloud-http-ngram")


def step_floors(mc: Any, kinds: dict[str, float], gflops: float, gbps: float,
                bytes_per_param: tuple[float, float] | None, kv_bytes_per_token: int) -> dict[str, Any]:
    """The compute floor of each kind of step (``EngineStats.record_step``: prompt steps, decode-only steps) against
    the wall time the engine spent in them, and, where the weights' bytes per parameter are known, decode steps'
    memory floor (``floor.decode_bytes`` at ``gbps``)."""
    from apiary.bench import floor

    prompt = floor.step_flops(mc, kinds["prompt_step_rows"], kinds["prompt_step_sampled"]) / 1e9 / gflops
    decode = floor.step_flops(mc, kinds["decode_step_rows"], kinds["decode_step_sampled"]) / 1e9 / gflops
    decode_steps: dict[str, Any] = {"seconds": kinds["decode_step_seconds"], "floor_seconds": decode,
                                    "fraction": decode / kinds["decode_step_seconds"]}
    if bytes_per_param is not None:
        memory = floor.decode_bytes(mc, int(kinds["decode_steps"]), int(kinds["decode_step_context_tokens"]),
                                    *bytes_per_param, kv_bytes_per_token) / 1e9 / gbps
        decode_steps.update({"memory_floor_seconds": memory, "stream_gbps": round(gbps, 1),
                             "roofline_fraction": max(decode, memory) / kinds["decode_step_seconds"]})
    return {"prompt_steps": {"seconds": kinds["prompt_step_seconds"], "floor_seconds": prompt,
                             "fraction": prompt / kinds["prompt_step_seconds"]},
            "decode_steps": decode_steps}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of requests whose first 16 greedy tokens are identical (runtimes differ at near-ties)."""
    return sum(x[:16] == y[:16] for x, y in zip(a, b)) / max(1, len(a))


def command(
    requests: int = typer.Option(64, help="number of requests"),
    quick: bool = typer.Option(False, help="small smoke run: 12 requests, prompts 32-128, outputs 16-48"),
    prompt_tokens: str = typer.Option("32-512", help="prompt length range LO-HI (tokens)"),
    output_tokens: str = typer.Option("16-256", help="output length range LO-HI (tokens)"),
    systems: str = typer.Option(",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}"),
    dtype: str = typer.Option("auto", help="dtype of the batched engine run (engine-fp32 is always float32); auto: "
                                           "bfloat16 where the CPU has avx512_bf16 or amx_bf16, else float32"),
    threads: int = typer.Option(0, help="torch and llama.cpp threads; 0: the CPUs this process may use "
                                       "(affinity and cgroup quota, cloud.engine.threads)"),
    max_num_seqs: int = typer.Option(64, help="engine: concurrent sequences"),
    budget: int = typer.Option(1024, help="engine: max tokens per step"),
    seed: int = typer.Option(0, help="workload seed"),
    sequential_requests: int = typer.Option(0, help="run the one-at-a-time systems on only the first N requests "
                                                    "(a random sample of the same workload; 0 = all)"),
    model: str = typer.Option("", help="GGUF path; default: the smollm2-135m-q4 asset"),
    rounds: int = typer.Option(1, min=1, help="run the systems this many times, interleaved (order reversed every "
                                              "other round), and report medians: ratios survive a noisy machine"),
    background: int = typer.Option(0, min=0, help="busy processes (shell loops) running beside every system's run"),
    clients: int = typer.Option(16, min=1, help="HTTP systems: concurrent streaming clients (and llama-server's "
                                               "parallel slots)"),
    llama_server: str = typer.Option("", help="llama-server binary for the llama-server systems; default: "
                                              ".venv/llama-server/llama-server (deploy/build_llama_server.sh)"),
) -> None:
    # cloud.engine first: it sets the OpenMP wait policy and thread counts before torch loads.
    from apiary.cloud.engine import EngineConfig, LLMEngine, threads as engine_threads
    from apiary.cloud.engine.model_runner import numba_runs_projections

    import torch

    from apiary.bench.common import percentile, report
    from apiary.shared import assets

    chosen = [s.strip() for s in systems.split(",") if s.strip()]
    unknown = set(chosen) - set(SYSTEMS)
    if unknown:
        raise typer.BadParameter(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    from apiary.bench.http_serving import LLAMA_SERVER

    llama_server_binary = Path(llama_server) if llama_server else LLAMA_SERVER
    if any(s.startswith("llama-server") for s in chosen) and not llama_server_binary.is_file():
        raise typer.BadParameter(f"no llama-server at {llama_server_binary}: run bash deploy/build_llama_server.sh, "
                                 "or pass --llama-server with the path of a build", param_hint="--llama-server")
    int8_systems = [s for s in chosen if s.startswith("engine-int8") or s == "cloud-http-int8"]
    in_process_int8 = any(s.startswith("engine-int8") for s in chosen)
    if (in_process_int8 or any(s.startswith("engine-bf16w") for s in chosen)
            or numba_runs_projections(EngineConfig(model_path="-", dtype=dtype))):
        # numba's pool is per process and chosen at its first parallel loop (the probe below): an engine whose
        # projections numba runs (int8, or bf16 through the vdpbf16ps kernel; the run always builds a `--dtype`
        # engine) takes oneTBB's pool, so in this run every in-process engine does (the table's CPU line says so)
        from apiary.kernels import numba_threads

        numba_threads.prepare()
    if int8_systems:
        from apiary.cloud.engine import int8

        choice = int8.gemm_choice()
        if choice.backend is None:  # the engine refuses int8 weights here: say so, run the rest
            typer.echo(f"skipping {', '.join(int8_systems)}: no fast int8 GEMM on this CPU ({choice.reason})")
            chosen = [s for s in chosen if s not in int8_systems]
            if not chosen:
                raise typer.BadParameter("no system left to run")
    if quick:
        requests, prompt_tokens, output_tokens = 12, "32-128", "16-48"
    p_lo, p_hi = (int(x) for x in prompt_tokens.split("-"))
    o_lo, o_hi = (int(x) for x in output_tokens.split("-"))
    path = Path(model) if model else assets.ensure("smollm2-135m-q4")
    threads = threads or engine_threads.STATE.cpus
    torch.set_num_threads(threads)

    def engine_for(engine_dtype: str, cpu_attention: str = "numba", weights: str = "auto",
                   kv_cache_dtype: str = "auto", speculative: Any = None) -> Any:
        return LLMEngine(EngineConfig(model_path=path, dtype=engine_dtype, kv_cache_bytes=2 << 30,
                                      max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                      num_threads=threads, cpu_attention=cpu_attention, weights=weights,
                                      kv_cache_dtype=kv_cache_dtype, speculative=speculative))

    def kv_tokens(name: str) -> str:
        runner = engines[name].runner
        return f"{runner.num_blocks * runner.block_size:,}"

    engines: dict[str, Any] = {}
    tokenizer = (engines.setdefault(dtype, engine_for(dtype))).tokenizer

    def resolved(name: str) -> str:
        return str(engines[name].runner.dtype).removeprefix("torch.") + (" (auto)" if name == "auto" else "")

    work = make_workload(tokenizer, requests, (p_lo, p_hi), (o_lo, o_hi), seed)
    seq_work = work[:sequential_requests] if sequential_requests > 0 else work
    runs: dict[str, list[Result]] = {system: [] for system in chosen}
    loads: dict[str, list[tuple[float, float]]] = {system: [] for system in chosen}
    def run_system(system: str) -> Result:
        if system == "engine":
            res = run_engine(engines.setdefault(dtype, engine_for(dtype)), work, max_num_seqs)
            res.detail = f"continuous batching, {resolved(dtype)}, max_num_seqs={max_num_seqs}, budget={budget}"
        elif system == "engine-torch-attn":  # the A/B for the numba decode-attention kernel
            res = run_engine(engines.setdefault("torch-attn", engine_for(dtype, "torch")), work, max_num_seqs)
            res.detail = f"continuous batching, {resolved(dtype)}, decode attention through the torch reference"
        elif system == "engine-fp32":
            res = run_engine(engines.setdefault("float32", engine_for("float32")), work, max_num_seqs)
            res.detail = f"continuous batching, float32, max_num_seqs={max_num_seqs}, budget={budget}"
        elif system == "engine-bf16w":  # float32 with bf16-held weights: the speed path for CPUs without native bf16
            res = run_engine(engines.setdefault("bf16w", engine_for("float32", weights="bf16")), work, max_num_seqs)
            res.detail = ("continuous batching, float32, weights held in bf16 (kernels/cpu_bf16w_gemm.py), "
                          f"{engines['bf16w'].runner.kv_pool.dtype} KV rows".replace("torch.", ""))
        elif system == "engine-bf16w-kv32":  # the same with float32 KV rows: the A/B for its bf16 rows ("auto")
            res = run_engine(engines.setdefault("bf16w-kv32", engine_for("float32", weights="bf16",
                                                                         kv_cache_dtype="dtype")), work, max_num_seqs)
            res.detail = ("continuous batching, float32, weights held in bf16, float32 KV rows "
                          f"({kv_tokens('bf16w-kv32')} tokens in 2 GiB)")
        elif system == "engine-int8":  # W8A8 projections (cloud.engine.int8), activations in --dtype
            res = run_engine(engines.setdefault("int8", engine_for(dtype, weights="int8")), work, max_num_seqs)
            res.detail = f"continuous batching, int8 weights (W8A8), {resolved('int8')} activations"
        elif system == "engine-int8-fp32":  # the same with float32 activations: the path for CPUs without bf16
            res = run_engine(engines.setdefault("int8-fp32", engine_for("float32", weights="int8")), work,
                             max_num_seqs)
            res.detail = "continuous batching, int8 weights (W8A8), float32 activations"
        elif system == "engine-kv8":  # int8 KV cache rows (cloud.engine.kv_cache), weights in --dtype
            res = run_engine(engines.setdefault("kv8", engine_for(dtype, kv_cache_dtype="int8")), work, max_num_seqs)
            res.detail = (f"continuous batching, {resolved('kv8')}, int8 KV cache ({kv_tokens('kv8')} tokens in 2 GiB "
                          f"against {kv_tokens(dtype)} with {resolved(dtype)} rows)")
        elif system == "engine-ngram":  # n-gram speculation, left to the adaptive policy (cloud.engine.spec)
            from apiary.cloud.engine import SpeculativeConfig

            eng = engines.setdefault("ngram", engine_for(dtype, speculative=SpeculativeConfig(method="ngram")))
            res = run_engine(eng, work, max_num_seqs)
            m = eng.metrics()
            res.detail = (f"continuous batching, {resolved(dtype)}, n-gram speculation (acceptance "
                          f"{m['spec_ngram_acceptance_rate'] or 0:.2f}, {m['spec_ngram_tokens_per_verification'] or 0:.2f} "
                          f"tokens per verification)")
        elif system == "engine-bs1":
            # Batch size 1 in float32: bf16 gains nothing at batch 1 on this CPU (measured), so the
            # sequential baseline gets its fastest precision.
            res = run_engine(engines.setdefault("float32", engine_for("float32")), seq_work, 1)
            res.detail = "one request at a time (max_num_seqs=1), float32"
        elif system == "hf":
            res = run_hf(path, seq_work)
            res.detail = "transformers generate, one request at a time, float32"
        elif system in HTTP_SYSTEMS:
            from apiary.bench.http_serving import run_server_system

            res = run_server_system(system, path, work, threads=threads, clients=clients, dtype=dtype,
                                    max_num_seqs=max_num_seqs, budget=budget,
                                    drop_env=engine_threads.STATE.set_by_engine,
                                    llama_server_binary=llama_server_binary)
            typer.echo(f"  {system} warm-up: first request's TTFT {res.extra['warmup_ttfts'][0]:.2f} s, tenth's "
                       f"{res.extra['warmup_ttfts'][-1]:.2f} s")
        else:
            own_env = {k: v for k, v in os.environ.items() if k not in engine_threads.STATE.set_by_engine}
            res = run_llama_cpp_process(path, seq_work, threads, own_env)
            res.detail = f"llama-cpp-python, one request at a time, {threads} threads, GGUF Q4_1, own process"
        return res

    for system in [s for r in range(rounds) for s in (chosen if r % 2 == 0 else chosen[::-1])]:
        load_before = os.getloadavg()[0]
        n = len(work) if system.startswith("engine") and system != "engine-bs1" or system in HTTP_SYSTEMS else len(seq_work)
        typer.echo(f"running {system} on {n} requests (load average {load_before:.1f}"
                   f"{f', {background} busy processes beside it' if background else ''}) ...")
        with busy_processes(background):
            res = run_system(system)
        res.system = system
        runs[system].append(res)
        loads[system].append((load_before, os.getloadavg()[0]))
        typer.echo(f"  {system} ({res.detail}): {res.output_tokens} tokens in {res.wall:.1f}s = {res.tok_s:.1f} tok/s, "
                   f"CPU {100 * res.cpu_s / res.wall:.0f}%")

    # Each system's median round; ratios are medians of the per-round ratios (round r of one system
    # against round r of the other, run minutes apart), so a slow phase of the machine cancels out.
    results = {system: sorted(rs, key=lambda r: r.tok_s)[(len(rs) - 1) // 2] for system, rs in runs.items()}

    def ratio(system: str, base: str) -> float | str:
        if base not in runs:
            return "-"
        per_round = sorted(a.tok_s / b.tok_s for a, b in zip(runs[system], runs[base]))
        n = len(per_round)
        return per_round[n // 2] if n % 2 else (per_round[n // 2 - 1] + per_round[n // 2]) / 2

    floors = matmul_floors(results, engines, dtype, work, seq_work)
    columns = ["system", "output tok", "wall s", "output tok/s", "CPU %", "x HF seq", "x llama.cpp seq",
               "TTFT p50 s", "TTFT p99 s", "x llama-server", "peak RSS MB", "matmul floor s", "% of floor",
               "prompt steps % of floor", "decode steps % of floor (roofline)"]
    rows = []
    for system, res in results.items():
        ttft = [t for t in res.ttfts if t is not None]
        floor = floors.get(system)
        prompt, decode = (floor or {}).get("prompt_steps"), (floor or {}).get("decode_steps")
        rows.append([system, res.output_tokens, round(res.wall, 1), round(res.tok_s, 1),
                     round(100 * res.cpu_s / res.wall), ratio(system, "hf"), ratio(system, "llama-cpp"),
                     percentile(ttft, 50) if ttft else "-", percentile(ttft, 99) if ttft else "-",
                     ratio(system, "llama-server"), round(res.extra.get("peak_rss_mb", 0)) or "-",
                     round(floor["seconds"], 1) if floor else "-",
                     f"{floor['seconds'] / res.wall:.0%}" if floor else "-",
                     f"{prompt['fraction']:.0%}" if prompt else "-",
                     "-" if not decode else f"{decode['fraction']:.0%}" + (
                         f" ({decode['roofline_fraction']:.0%})" if "roofline_fraction" in decode else "")])
    reference = results.get("engine-fp32") or results.get("engine-bs1")
    agreements = {s: agreement(reference.extra["tokens"][:len(r.extra["tokens"])], r.extra["tokens"])
                  for s, r in results.items() if reference is not None and r is not reference and "tokens" in r.extra}
    kv: dict[str, Any] = {}
    if "engine" in results:
        m = engines[dtype].metrics()
        kv = {"kv_slot_waste_paged": m["kv_slot_waste"],
              "kv_waste_contiguous_prompt_plus_max_tokens": m["kv_waste_contiguous_request"],
              "kv_waste_contiguous_max_model_len": m["kv_waste_contiguous_max_len"],
              "max_model_len": engines[dtype].max_model_len, "block_size": engines[dtype].config.block_size}
        typer.echo(f"KV slots allocated but unused (paged, block 16): {100 * kv['kv_slot_waste_paged']:.2f}%; "
                   f"contiguous prompt+max_tokens would waste {100 * kv['kv_waste_contiguous_prompt_plus_max_tokens']:.1f}%, "
                   f"contiguous max_model_len ({kv['max_model_len']}) {100 * kv['kv_waste_contiguous_max_model_len']:.1f}%")
    # Requests in flight per system: a batched engine run at more than the HTTP systems' clients is a bigger
    # batch, not a cheaper door (2026-12-05: at equal concurrency HTTP cost 1-3 %, at 64 against 16 it looked 37 %).
    concurrency = {s: clients if s in HTTP_SYSTEMS else max_num_seqs if s.startswith("engine") and s != "engine-bs1"
                   else 1 for s in results}
    batched = {s: n for s, n in concurrency.items() if s not in HTTP_SYSTEMS and n > 1}
    if any(s in HTTP_SYSTEMS for s in results) and any(n != clients for n in batched.values()):
        typer.echo(f"note: {', '.join(batched)} ran up to {max_num_seqs} requests at a time, the HTTP systems "
                   f"{clients} clients; to compare the engine with its HTTP door, add --max-num-seqs {clients}")
    if any(s in HTTP_SYSTEMS for s in results):
        typer.echo("note: the CPU line names this process's numba pool; each HTTP server chooses its own (oneTBB's "
                   "where numba runs the projections: int8, or bf16 through the vdpbf16ps kernel; libgomp otherwise: "
                   "kernels/numba_threads.py) and logs it")
    beside = f", {background} busy processes beside each run" if background else ""
    report("engine", f"Engine throughput: {len(work)} requests, prompts {p_lo}-{p_hi} tok, outputs {o_lo}-{o_hi} tok"
           f"{beside}",
           columns, rows, {
               "workload": {"requests": len(work), "prompt_tokens": sum(len(r.prompt) for r in work),
                            "output_tokens": sum(r.max_tokens for r in work), "seed": seed,
                            "prompt_range": [p_lo, p_hi], "output_range": [o_lo, o_hi],
                            "sequential_systems_requests": len(seq_work),
                            "sequential_output_tokens": sum(r.max_tokens for r in seq_work)},
               "systems": {s: r.detail for s, r in results.items()}, "requests_in_flight": concurrency,
               "threads": threads, "engine_threads": engine_threads.report(), "background_processes": background,
               "cpu_percent_per_round": {s: [round(100 * r.cpu_s / r.wall) for r in rs] for s, rs in runs.items()},
               "load_average_before_after": loads, "kv_cache": kv,
               "rounds": rounds, "tok_s_per_round": {s: [round(r.tok_s, 2) for r in rs] for s, rs in runs.items()},
               "ratios_median_of_rounds": {s: {"x_hf": ratio(s, "hf"), "x_llama_cpp": ratio(s, "llama-cpp"),
                                               "x_llama_server": ratio(s, "llama-server")} for s in runs},
               "http": {s: {"clients": clients, "peak_rss_mb_per_round": [r.extra["peak_rss_mb"] for r in rs],
                            "warmup_ttfts_per_round": [r.extra["warmup_ttfts"] for r in rs]}
                        for s, rs in runs.items() if s in HTTP_SYSTEMS},
               "first16_token_agreement_vs_fp32_engine": agreements,
               "matmul_floor": floors,
               "engine_steps": {s: r.extra.get("steps") for s, r in results.items() if "steps" in r.extra},
               "note": "one run, systems in sequence (interleaved over rounds) on a shared 2-core machine; "
                       "compare rows of this run only",
           })


if __name__ == "__main__":  # the llama-cpp system's child process (run_llama_cpp_process)
    _llama_cpp_child()
