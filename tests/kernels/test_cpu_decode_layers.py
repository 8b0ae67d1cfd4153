"""A run of layers in one compiled call (int8 weights, bf16 ones through the vdpbf16ps kernel, or float32 rows through
bf16-held weights) against the
per-layer calls it replaces, and what a stack refuses."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from apiary.kernels import ops, reference
from apiary.kernels.errors import KernelError

gemm = pytest.importorskip("apiary.kernels.cpu_int8_gemm")
layers_mod = pytest.importorskip("apiary.kernels.cpu_decode_layers")
bf16_gemm = pytest.importorskip("apiary.kernels.cpu_bf16_gemm")
held_gemm = pytest.importorskip("apiary.kernels.cpu_bf16w_gemm")
if not gemm.runnable():
    pytest.skip("the grouped int8 GEMM does not run on this CPU (neither AVX-512 VNNI nor AVX2)", allow_module_level=True)
needs_bf16_kernel = pytest.mark.skipif(not bf16_gemm.available(),
                                       reason=f"numba does not compile for {', '.join(bf16_gemm.FEATURES)} here")

needs_held_kernel = pytest.mark.skipif(not held_gemm.available(),
                                       reason=f"numba does not compile for {', '.join(held_gemm.FEATURES)} here")

HIDDEN, HQ, HKV, INTER, BLOCK = 256, 4, 2, 384, 8


def _layer(g: torch.Generator, head_dim: int, bf16: bool | str = False) -> dict:
    """Random int8 projections (``bf16``: bf16 ones, packed for the bf16 kernel, the q/k/v ones with a bias; ``BF16W``:
    bf16-held ones for float32 rows)."""
    qkv_out = (HQ + 2 * HKV) * head_dim
    shapes = {"qkv": (qkv_out, HIDDEN), "o_proj": (HIDDEN, HQ * head_dim), "gate_up": (2 * INTER, HIDDEN),
              "down": (HIDDEN, INTER)}
    weights = {name: torch.randn(shape, generator=g) / shape[1] ** 0.5 for name, shape in shapes.items()}
    if bf16:
        pack = held_gemm.pack if bf16 == layers_mod.BF16W else bf16_gemm.pack
        return {name: pack(w, torch.randn(w.shape[0], generator=g) if name == "qkv" else None)
                for name, w in weights.items()}
    return {name: gemm.quantize_weight(w) for name, w in weights.items()}


def _setup(dtype: torch.dtype, head_dim: int, count: int = 3, rows: int = 5, seed: int = 0, bf16: bool | str = False):
    """``count`` random int8 layers (``bf16``: bf16-kernel ones), their norms, a pool of ``count + 2`` layers (the run
    starts at layer 1) with ``rows`` sequences' contexts in it, and the step decoding one token for each."""
    g = torch.Generator().manual_seed(seed)
    layers = [_layer(g, head_dim, bf16) for _ in range(count)]
    norms = [[(torch.rand(HIDDEN, generator=g) + 0.5).to(dtype) for _ in range(count)] for _ in range(2)]
    num_blocks = 40
    pool = torch.randn(count + 2, 2, num_blocks, BLOCK, HKV, head_dim, generator=g).to(dtype)
    blocks = torch.randperm(num_blocks, generator=g)
    lens = torch.tensor([3, 17, 9, 31, 1][:rows], dtype=torch.int32)
    tables = blocks[: rows * 4].view(rows, 4).to(torch.int32)  # up to 32 tokens each
    positions = lens.long() - 1  # each row decodes the last token of its context
    slots = tables.long().gather(1, (positions // BLOCK)[:, None])[:, 0] * BLOCK + positions % BLOCK
    table = reference.rotary_cos_sin_cache(64, head_dim, 10000.0)
    step = ops.cpu_step(rows, HIDDEN, HQ, HKV, head_dim, dtype, 1e-5, positions, slots, table, pool[1, 0], pool[1, 1],
                        rows, tables, lens, head_dim ** -0.5)
    x = torch.randn(rows, HIDDEN, generator=g).to(dtype)
    residual = torch.randn(rows, HIDDEN, generator=g).to(dtype)
    return layers, norms, pool, step, x, residual


def _quantized(pool: torch.Tensor, dtype: torch.dtype, rows: int = 5, seed: int = 0):
    """``pool``'s rows as an int8 KV pool with one float32 scale per token and KV head (``cpu_quant``'s rounding:
    ``round(x / (absmax / 127))``), and ``_setup``'s step over it: ``(int8 pool, scales [layers, 2, blocks, block,
    Hkv], step)``."""
    scales = pool.float().abs().amax(-1).clamp_min(1e-8) / 127
    cache = torch.round(pool.float() / scales[..., None]).to(torch.int8)
    g = torch.Generator().manual_seed(seed)
    num_blocks, head_dim = pool.shape[2], pool.shape[-1]
    torch.randn(pool.shape, generator=g)  # as _setup drew them, for the same tables and lens
    blocks = torch.randperm(num_blocks, generator=g)
    lens = torch.tensor([3, 17, 9, 31, 1][:rows], dtype=torch.int32)
    tables = blocks[: rows * 4].view(rows, 4).to(torch.int32)
    positions = lens.long() - 1
    slots = tables.long().gather(1, (positions // BLOCK)[:, None])[:, 0] * BLOCK + positions % BLOCK
    step = ops.cpu_step(rows, HIDDEN, HQ, HKV, head_dim, dtype, 1e-5, positions, slots,
                        reference.rotary_cos_sin_cache(64, head_dim, 10000.0), cache[1, 0], cache[1, 1], rows, tables,
                        lens, head_dim ** -0.5, k_scale=scales[1, 0], v_scale=scales[1, 1])
    return cache, scales, step


def _per_layer(step, layers, norms, pool, x, residual, kernel, first=1, scales=None):
    """What ``LlamaModel.forward``'s CPU path computes layer by layer (``kernel``: the int8 GEMM's, or ``"bf16"``;
    ``scales``: an int8 pool's)."""
    views = [(pool[first + i, 0], pool[first + i, 1]) for i in range(len(layers))]  # kept alive: CpuStep keys by id
    kv_scales = [(None, None) if scales is None else (scales[first + i, 0], scales[first + i, 1])
                 for i in range(len(layers))]
    bind = {layers_mod.BF16: bf16_gemm.Bound, layers_mod.BF16W: held_gemm.Bound}.get(
        kernel, lambda weight: gemm.Bound(weight, kernel))
    for layer, in_norm, post_norm, (k, v), (ks, vs) in zip(layers, *norms, views, kv_scales):
        h, residual = step.rms_norm(x, in_norm, residual)
        q = step.rotary_write_kv(bind(layer["qkv"])(h), k, v, ks, vs)
        attn = step.decode_attention(q, k, v, ks, vs)
        h, residual = step.rms_norm(bind(layer["o_proj"])(attn.reshape(x.shape[0], -1)), post_norm, residual)
        x = bind(layer["down"])(bind(layer["gate_up"])(h), True)
    return x, residual


# (activations, head dim: 64 has its own attention kernel, 32 takes the generic one, GEMM kernel); each compiles
# a run of its own (~3 s), so the other kernel (AVX2 on a VNNI host) once
# (bf16 weights: bf16 rows, both attention kernels)
CASES = [(torch.bfloat16, 64, gemm.isa()), (torch.float32, 64, gemm.isa()), (torch.bfloat16, 32, gemm.isa())] + [
    (torch.bfloat16, 64, kernel) for kernel in gemm.runnable()[1:]] + [
    pytest.param(torch.bfloat16, head_dim, layers_mod.BF16, marks=needs_bf16_kernel) for head_dim in (64, 32)] + [
    pytest.param(torch.float32, head_dim, layers_mod.BF16W, marks=needs_held_kernel) for head_dim in (64, 32)]


@pytest.mark.parametrize(("dtype", "head_dim", "kernel"), CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_a_run_is_the_per_layer_calls_bit_for_bit(dtype, head_dim, kernel):
    """Hidden rows, residual stream and every K/V row written: the per-layer path's exactly (same kernels, same
    order, the query widened and the attention rounded as the torch ops do)."""
    bf16 = kernel if kernel in (layers_mod.BF16, layers_mod.BF16W) else False
    layers, norms, pool, step, x, residual = _setup(dtype, head_dim, bf16=bf16)
    want_pool = pool.clone()
    want_x, want_residual = _per_layer(step, layers, norms, want_pool, x, residual, kernel)
    stack = ops.stack_layers(1, layers, *norms, kernel=None if bf16 else kernel)
    assert stack.gemm == kernel
    got_x, got_residual = step.stacked_layers(x, residual, stack, pool)
    assert got_x.dtype == dtype and torch.equal(got_x, want_x)
    assert torch.equal(got_residual, want_residual)
    assert torch.equal(pool, want_pool)
    assert not torch.equal(pool, _setup(dtype, head_dim, bf16=bf16)[2])  # the K/V rows were written


# int8 KV rows (``EngineConfig(kv_cache_dtype="int8")``) under each kind of run: bf16 rows through int8 and bf16 weights,
# float32 rows through bf16-held ones
KV8_CASES = [(torch.bfloat16, gemm.isa())] + [
    pytest.param(torch.bfloat16, layers_mod.BF16, marks=needs_bf16_kernel),
    pytest.param(torch.float32, layers_mod.BF16W, marks=needs_held_kernel)]


@pytest.mark.parametrize(("dtype", "kernel"), KV8_CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_a_run_over_int8_kv_rows_is_the_per_layer_calls_bit_for_bit(dtype, kernel):
    """int8 caches: each new key and value row quantized with its scale as the per-layer write does it, attention
    over the int8 rows and their scales; hidden rows, residual stream, every cached row and every scale exactly the
    per-layer path's."""
    bf16 = kernel if kernel in (layers_mod.BF16, layers_mod.BF16W) else False
    layers, norms, pool, _, x, residual = _setup(dtype, 64, bf16=bf16)
    cache, scales, step = _quantized(pool, dtype)
    want_cache, want_scales = cache.clone(), scales.clone()
    want_x, want_residual = _per_layer(step, layers, norms, want_cache, x, residual, kernel, scales=want_scales)
    stack = ops.stack_layers(1, layers, *norms, kernel=None if bf16 else kernel)
    got_x, got_residual = step.stacked_layers(x, residual, stack, cache, scales)
    assert torch.equal(got_x, want_x) and torch.equal(got_residual, want_residual)
    assert torch.equal(cache, want_cache) and torch.equal(scales, want_scales)
    fresh, fresh_scales, _ = _quantized(pool, dtype)
    assert not torch.equal(scales, fresh_scales)  # new rows were written, with their scales
    assert not torch.equal(got_x, step.stacked_layers(x, residual, stack, fresh, fresh_scales * 2)[0])  # scales are read
    with pytest.raises(KernelError, match="scales"):  # an int8 pool without its scales, or scales of another shape
        step.stacked_layers(x, residual, stack, fresh)
    with pytest.raises(KernelError, match="scales"):
        step.stacked_layers(x, residual, stack, fresh, fresh_scales[:, :, :-1])


def test_a_wide_decode_step_takes_the_row_parallel_norm_and_rotary_as_the_per_layer_path():
    """From ``PARALLEL_ROWS`` decode rows (a server's 64 in flight) the step's norms and rotary spread over the
    threads, in the run as in the per-layer calls: still bit for bit."""
    from apiary.kernels.cpu_layers import PARALLEL_ROWS

    layers, norms, pool, _, _, _ = _setup(torch.bfloat16, 64, count=2)
    rows = PARALLEL_ROWS + 3
    g = torch.Generator().manual_seed(4)
    tables = torch.randperm(pool.shape[2], generator=g)[:2].repeat(rows, 1).to(torch.int32)  # a shared prefix
    lens = torch.randint(1, 17, (rows,), generator=g, dtype=torch.int32)
    slots = torch.randperm(pool.shape[2] * BLOCK, generator=g)[:rows]  # distinct rows to write
    step = ops.cpu_step(rows, HIDDEN, HQ, HKV, 64, torch.bfloat16, 1e-5, lens.long() - 1, slots,
                        reference.rotary_cos_sin_cache(64, 64, 10000.0), pool[1, 0], pool[1, 1], rows, tables, lens,
                        0.125)
    x, residual = (torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16) for _ in range(2))
    want_pool = pool.clone()
    want = _per_layer(step, layers, norms, want_pool, x, residual, gemm.isa())
    got = step.stacked_layers(x, residual, ops.stack_layers(1, layers, *norms), pool)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(pool, want_pool)


def test_a_run_from_the_first_layer_starts_the_residual_stream():
    """No residual yet (a model whose every layer is int8): the first norm takes the rows as they are."""
    layers, norms, pool, step, x, _ = _setup(torch.bfloat16, 64)
    want_pool = pool.clone()
    want = _per_layer(step, layers, norms, want_pool, x, None, gemm.isa(), first=0)
    got = step.stacked_layers(x, None, ops.stack_layers(0, layers, *norms), pool)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(pool, want_pool)


def test_the_layers_hold_views_of_the_stack():
    layers, norms, *_ = _setup(torch.bfloat16, 64)
    stack = ops.stack_layers(1, layers, *norms)
    views = stack.views()
    assert (stack.first, stack.count, len(views)) == (1, 3, 3)
    for i, (view, layer) in enumerate(zip(views, layers)):
        for name, weight in view.items():
            assert np.shares_memory(weight.packed, stack.packed[layers_mod.PROJECTIONS.index(name)])
            assert (weight.out_features, weight.in_features) == (layer[name].out_features, layer[name].in_features)
            assert np.array_equal(weight.packed, layer[name].packed) and np.array_equal(weight.scales, layer[name].scales)
    x = torch.randn(3, HIDDEN).to(torch.bfloat16)
    assert torch.equal(gemm.linear(x, views[2]["qkv"]), gemm.linear(x, layers[2]["qkv"]))


@needs_bf16_kernel
def test_bf16_layers_hold_views_of_the_stack_with_their_biases():
    layers, norms, *_ = _setup(torch.bfloat16, 64, bf16=True)
    stack = ops.stack_layers(1, layers, *norms)
    for view, layer in zip(stack.views(), layers):
        for name, weight in view.items():
            assert np.shares_memory(weight.packed, stack.packed[layers_mod.PROJECTIONS.index(name)])
            assert np.shares_memory(weight.bias, stack.extras[layers_mod.PROJECTIONS.index(name)])
            assert (weight.out_features, weight.in_features) == (layer[name].out_features, layer[name].in_features)
            assert torch.equal(weight.unpacked(), layer[name].unpacked())
            assert np.array_equal(weight.bias, layer[name].bias)
    assert np.any(stack.extras[0][1])  # the q/k/v bias came along


def test_what_cannot_join_a_stack_is_named():
    layers, norms, *_ = _setup(torch.float32, 64, count=2)
    assert ops.layer_stackable(layers[0], {}) is None
    assert ops.layer_stackable(layers[0], {"qkv": torch.zeros(1)}) == "qkv has a bias"
    assert ops.layer_stackable({**layers[0], "down": torch.zeros(2, 2)}, {}) == "down is not a grouped int8 weight"
    odd = gemm.quantize_weight(torch.randn(HIDDEN - 8, INTER))
    assert "not whole tiles of 16" in ops.layer_stackable({**layers[0], "down": odd}, {})
    with pytest.raises(KernelError, match="layer 2: down has 248 outputs"):
        ops.stack_layers(1, [layers[0], {**layers[1], "down": odd}], *norms)
    with pytest.raises(KernelError, match="o_proj weights differ"):
        ops.stack_layers(1, [layers[0], {**layers[1], "o_proj": gemm.quantize_weight(torch.randn(HIDDEN, 512))}],
                              *norms)
    with pytest.raises(KernelError, match="norms must be"):
        ops.stack_layers(1, layers, norms[0], [torch.ones(HIDDEN + 1)] * 2)
    with pytest.raises(KernelError, match="kernel 'amx' does not run here"):
        ops.stack_layers(1, layers, *norms, kernel="amx")
    bf16 = _layer(torch.Generator().manual_seed(1), 64, bf16=True)
    assert ops.layer_stackable(bf16, {"qkv": torch.zeros(1)}) is None  # the bf16 kernel adds its own bias
    assert "not all grouped int8, all bf16" in ops.layer_stackable({**bf16, "down": layers[0]["down"]}, {})
    held = _layer(torch.Generator().manual_seed(1), 64, bf16=layers_mod.BF16W)  # float32 rows' weights: not bf16 rows'
    assert ops.layer_stackable(held, {}) is None
    assert "all bf16-held weights" in ops.layer_stackable({**held, "down": bf16["down"]}, {})
    ragged = bf16_gemm.pack(torch.randn(HIDDEN, INTER - 16))
    assert "384 inputs" not in ops.layer_stackable({**bf16, "down": ragged}, {})
    assert "368 inputs, not whole chunks of 32" in ops.layer_stackable({**bf16, "down": ragged}, {})
    with pytest.raises(KernelError, match="layer 2: the projections are not all"):
        ops.stack_layers(1, [bf16, {**bf16, "qkv": layers[0]["qkv"]}], *norms)


def test_a_run_refuses_a_step_it_cannot_serve():
    """Prompt rows, or a pool that is not the layers' one array: a clear error, nothing written."""
    layers, norms, pool, step, x, residual = _setup(torch.bfloat16, 64)
    stack = ops.stack_layers(1, layers, *norms)
    before = pool.clone()
    with pytest.raises(KernelError, match="contiguous"):
        step.stacked_layers(x, residual, stack, pool[:, 0])
    with pytest.raises(KernelError, match="contiguous"):
        step.stacked_layers(x, residual, stack, pool.float())
    g = torch.Generator().manual_seed(3)
    prompt = ops.cpu_step(6, HIDDEN, HQ, HKV, 64, torch.bfloat16, 1e-5, torch.arange(6), torch.arange(6),
                          reference.rotary_cos_sin_cache(64, 64, 10000.0), pool[1, 0], pool[1, 1], 0,
                          torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 0.125)
    with pytest.raises(KernelError, match="decode rows only"):
        prompt.stacked_layers(torch.randn(6, HIDDEN, generator=g).to(torch.bfloat16), None, stack, pool)
    assert torch.equal(pool, before)


_RUN_AND_COUNT = """
import importlib.util, sys
import torch
spec = importlib.util.spec_from_file_location("decode_layers_cases", sys.argv[1])
cases = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cases)
layers, norms, pool, step, x, residual = cases._setup(torch.bfloat16, 64)
stack = cases.ops.stack_layers(1, layers, *norms)
step.stacked_layers(x, residual, stack, pool)
compiled = cases.layers_mod._layers_of(stack.gemm, *cases.layers_mod.cpu_attention.decode_kernel_key(
    cases.HQ, cases.HKV, 64))
print(compiled.py_func.__qualname__, sum(compiled.stats.cache_hits.values()), sum(compiled.stats.cache_misses.values()))
"""


def test_a_run_loads_from_numbas_disk_cache_in_a_new_process_under_a_name_with_the_kernels_digest():
    """The compiled run is cached on disk: a second process loads it, not compiles it again (~2.4 s in every engine's
    warm-up before). Its name carries the digest of the kernels' sources, so a changed kernel is a new name."""
    import subprocess
    import sys

    runs = [subprocess.run([sys.executable, "-c", _RUN_AND_COUNT, __file__], capture_output=True, text=True,
                           check=True) for _ in range(2)]
    name, hits, misses = runs[1].stdout.split()[-3:]
    assert (int(hits), int(misses)) == (1, 0), runs[1].stdout + runs[1].stderr
    assert name == f"_layers_of.<locals>.layers_{gemm.isa()}_d64_g{HQ // HKV}_{layers_mod._SOURCES}"


def test_the_kernels_digest_follows_every_cpu_kernels_source(tmp_path, monkeypatch):
    """Any kernel file's change gives the run a new name (numba checks a cached function against its own file only)."""
    from pathlib import Path

    kernels = Path(layers_mod.__file__).parent
    for path in kernels.glob("cpu_*.py"):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(layers_mod, "__file__", str(tmp_path / "cpu_decode_layers.py"))
    assert layers_mod._kernel_sources_digest() == layers_mod._SOURCES
    with (tmp_path / "cpu_layers.py").open("a") as f:
        f.write("\n# a change\n")
    assert layers_mod._kernel_sources_digest() != layers_mod._SOURCES
