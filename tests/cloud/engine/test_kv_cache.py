"""The KV pool (``cloud.engine.kv_cache``): int8 rows with their scales, bf16 rows under a float32 engine, what a
budget holds, swap copies, and the int8 cache's accuracy gate on the real model."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from apiary.cloud.engine import EngineConfig, EngineError, LLMEngine, SamplingParams
from apiary.cloud.engine.kv_cache import KVPool, bytes_per_token
from tests.cloud.engine.test_int8 import teacher_forced_agreement


def test_an_int8_pool_keeps_rows_and_scales_and_swaps_both() -> None:
    pool = KVPool(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=3, head_dim=8, dtype=torch.float32,
                  device=torch.device("cpu"), quantized=True)
    assert pool.dtype == torch.int8 and len(pool.layers) == 2
    layer = pool.layers[1]
    assert layer.k.shape == (6, 4, 3, 8) and layer.k.dtype == torch.int8
    assert layer.k_scale.shape == layer.v_scale.shape == (6, 4, 3) and layer.v_scale.dtype == torch.float32
    layer.k[2].fill_(7)
    layer.v_scale[2].fill_(0.5)
    saved = pool.copy_out([2, 0])
    assert [t.device.type for t in saved] == ["cpu", "cpu"] and saved[0].shape[2] == 2
    layer.k[2].zero_()
    layer.v_scale[2].zero_()
    pool.copy_in([5, 4], saved)
    assert bool((layer.k[5] == 7).all()) and bool((layer.v_scale[5] == 0.5).all()) and not bool(layer.k[4].any())
    with pytest.raises(ValueError, match="cannot fill"):
        pool.copy_in([1], saved)
    floats = KVPool(2, 6, 4, 3, 8, torch.bfloat16, torch.device("cpu"))
    assert floats.dtype == torch.bfloat16 and floats.layers[0].k_scale is None
    with pytest.raises(ValueError, match="cannot fill"):
        floats.copy_in([2, 0], saved)  # an int8 copy (rows + scales) into a float pool


def test_a_budget_holds_nearly_four_times_the_float32_tokens_in_int8(tiny_llama: Path) -> None:
    """head_dim + 4 bytes per row (the scale) against 4 * head_dim: the engine sizes its pool from that."""
    engines = {kv: LLMEngine(EngineConfig(model_path=tiny_llama, dtype="float32", kv_cache_bytes=4 << 20,
                                          kv_cache_dtype=kv)) for kv in ("auto", "int8")}
    mc = engines["int8"].runner.model_config
    per_token = {kv: bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.float32, kv == "int8")
                 for kv in engines}
    assert per_token["int8"] == 2 * mc.num_layers * mc.num_kv_heads * (mc.head_dim + 4)
    for kv, engine in engines.items():
        assert engine.runner.bytes_per_block == engine.config.block_size * per_token[kv]
        assert engine.runner.num_blocks == (4 << 20) // engine.runner.bytes_per_block
        assert engine.block_manager.num_blocks == engine.runner.num_blocks
    assert engines["int8"].runner.kv_caches[0].k.dtype == torch.int8
    ratio = engines["int8"].runner.num_blocks / engines["auto"].runner.num_blocks
    assert ratio == pytest.approx(4 * mc.head_dim / (mc.head_dim + 4), rel=0.02)
    out = engines["int8"].generate(["Queen present", "Hive 7 humidity 62%"], SamplingParams(max_tokens=5,
                                                                                             ignore_eos=True))
    assert [len(o.output_token_ids) for o in out] == [5, 5]


def test_what_a_cached_row_is_stored_as() -> None:
    """``kv_cache_dtype``: ``auto`` keeps bf16 rows for a float32 engine whose weights are held in bf16 (the AVX2
    hosts' default, a speed path) and the engine's dtype otherwise (the float32 reference keeps float32 rows);
    ``dtype``, ``bf16`` and ``int8`` as asked."""
    from apiary.cloud.engine.model_runner import resolve_kv_cache

    cpu_device = torch.device("cpu")

    def stored(kv: str, dtype: torch.dtype, weights: str) -> torch.dtype:
        return resolve_kv_cache(EngineConfig(model_path="x.gguf", kv_cache_dtype=kv), cpu_device, dtype, weights)

    assert stored("auto", torch.float32, "bf16") == torch.bfloat16
    assert stored("auto", torch.float32, "dtype") == torch.float32
    assert stored("auto", torch.float32, "int8") == torch.float32
    assert stored("auto", torch.bfloat16, "dtype") == torch.bfloat16
    assert stored("dtype", torch.float32, "bf16") == torch.float32
    assert stored("bf16", torch.float32, "dtype") == torch.bfloat16
    assert stored("int8", torch.float32, "bf16") == torch.int8


def test_bf16_rows_are_refused_where_no_kernel_reads_them(tiny_llama: Path) -> None:
    """bf16 rows go with a bfloat16 engine, or a float32 one on CPU; a float16 engine's queries have no kernel over
    them: refused before the model loads, with what would take them."""
    with pytest.raises(EngineError, match="kv_cache_dtype='bf16' takes a bfloat16 engine, or a float32 one on CPU.*"
                                          "not float16 on cpu"):
        LLMEngine(EngineConfig(model_path=tiny_llama, dtype="float16", kv_cache_dtype="bf16"))


def test_a_float32_engine_stores_its_rows_in_bf16_where_asked(tiny_llama: Path) -> None:
    """``kv_cache_dtype="bf16"`` under a float32 engine: half the bytes a token takes in float32 rows, so twice the
    blocks in a budget; each K/V row is the float32 engine's row rounded to bf16 (compared at the first layer,
    whose rows the cache does not shape); attention widens the rows, so the numba kernels and the torch reference
    read the same values; and the logits stay near the float32 rows' ones."""
    from apiary.kernels import cpu_attention
    from tests.cloud.engine.conftest import prompt_logits

    def engine(**overrides: object) -> LLMEngine:
        return LLMEngine(EngineConfig(**{**dict(model_path=tiny_llama, dtype="float32", kv_cache_bytes=4 << 20,
                                                block_size=8, enable_prefix_caching=False), **overrides}))

    rows32, rows16, reference = engine(), engine(kv_cache_dtype="bf16"), engine(kv_cache_dtype="bf16",
                                                                                  cpu_attention="torch")
    assert rows16.runner.kv_caches[0].k.dtype == torch.bfloat16 == reference.runner.kv_caches[0].v.dtype
    assert rows16.runner.dtype == torch.float32 and rows16.runner.kv_caches[0].k.dtype == torch.bfloat16
    assert rows16.runner.bytes_per_block * 2 == rows32.runner.bytes_per_block
    assert rows16.runner.num_blocks == 2 * rows32.runner.num_blocks
    ids = list(range(3, 43))
    logits = {}
    for name, e in (("f32", rows32), ("bf16", rows16), ("reference", reference)):
        _, logits[name] = prompt_logits(e, ids, use_prefix_cache=False)
    first = [e.runner.kv_caches[0] for e in (rows32, rows16)]
    n = len(ids)  # a fresh engine's first request takes blocks 0, 1, ... (``BlockManager``'s free list, in order)
    for kind in ("k", "v"):
        theirs, ours = (getattr(kv, kind).flatten(0, 1)[:n] for kv in first)
        assert torch.equal(ours, theirs.bfloat16()), kind
    assert logits["bf16"].dtype == torch.float32
    top = float(logits["f32"].abs().max())
    if cpu_attention.bf16_dots():  # the numba kernels' products in bf16 (``vdpbf16ps``), the query rounded
        assert (logits["bf16"] - logits["reference"]).abs().max() < 0.01 * top
    else:  # the rows widened exactly, float32 products: the reference's numbers up to summation order
        torch.testing.assert_close(logits["bf16"], logits["reference"], rtol=1e-4, atol=1e-4)
    assert (logits["bf16"] - logits["f32"]).abs().max() < 0.05 * top
    assert not torch.equal(logits["bf16"], logits["f32"])  # the rounding reached the logits: the rows were bf16
    out = rows16.generate(["Queen present", "Hive 7 humidity 62%"], SamplingParams(max_tokens=5, ignore_eos=True))
    assert [len(o.output_token_ids) for o in out] == [5, 5]


def test_the_engine_runs_its_kernels_once_before_it_serves(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh process loads each numba kernel on its first call (0.37 s for the int8 KV write, measured as
    the first request's TTFT through HTTP: 0.47-0.67 s against 0.21-0.26 s for the tenth): the runner makes
    one decode call and one prefill call when it is built, writing into free block 0, then a prompt chunk's
    pass (the long-run attention kernel) into free blocks (through the CPU step's kernels:
    ``kernels.ops.cpu_step``)."""
    from apiary.kernels import cpu_attention, cpu_quant

    calls: list[tuple[str, torch.dtype | None]] = []

    def spy(owner: object, name: str, dtype_of) -> None:  # type: ignore[no-untyped-def]
        original = getattr(owner, name)
        label = f"{getattr(owner, '__name__', owner).rsplit('.', 1)[-1]}.{name}"
        monkeypatch.setattr(owner, name, lambda *a, **k: (calls.append((label, dtype_of(a))), original(*a, **k))[1])

    spy(cpu_quant, "write_rows_int8", lambda a: torch.int8 if a[2].dtype == np.int8 else None)
    spy(cpu_attention.Prepared, "__call__", lambda a: torch.int8 if a[2].dtype == np.int8 and a[4] else None)
    spy(cpu_attention.PreparedPrefill, "__call__", lambda a: torch.int8 if a[2].dtype == np.int8 and a[4] else None)
    engine = LLMEngine(EngineConfig(model_path=tiny_llama, dtype="float32", kv_cache_bytes=1 << 20,
                                    kv_cache_dtype="int8"))
    layers = engine.runner.model_config.num_layers
    assert sorted(set(calls)) == [("Prepared.__call__", torch.int8), ("PreparedPrefill.__call__", torch.int8),
                                  ("cpu_quant.write_rows_int8", torch.int8)]
    assert len(calls) == (3 + 2) * layers and not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_bad_kv_cache_settings_are_refused() -> None:
    with pytest.raises(EngineError, match="kv_cache_dtype"):
        EngineConfig(model_path="x.gguf", kv_cache_dtype="fp8")


KV8_GATE = 0.97  # issue 21's gate; measured 0.981 on these 428 positions (float32 rows: 1.0 by definition)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_model_int8_kv_cache_meets_the_97_percent_gate(gate_references: list, gguf_path: Path) -> None:
    """SmolLM2 with float32 weights and int8 KV rows picks the float32 engine's next token on >= 97% of the
    teacher-forced positions of the int8 weights' gate (every prompt token attends over quantized rows)."""
    engine = LLMEngine(EngineConfig(model_path=gguf_path, dtype="float32", kv_cache_dtype="int8",
                                    kv_cache_bytes=32 << 20, max_num_batched_tokens=512))
    assert engine.runner.kv_caches[0].k.dtype == torch.int8
    agreement, positions = teacher_forced_agreement(gate_references, engine)
    assert positions > 400
    assert agreement >= KV8_GATE, agreement


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_model_int8_rows_decode_through_the_run_of_layers(gguf_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2 as `apiary cloud serve --kv-cache-dtype int8` runs it (the host's default dtype and weights): a batch's
    decode steps take the run of layers in one call over the int8 pool and its scales, and give the per-layer path's
    tokens and logprobs exactly."""
    from tests.cloud.engine.conftest import decodes_through_the_run
    from tests.cloud.engine.test_model import PROMPT

    engine = LLMEngine(EngineConfig(model_path=gguf_path, kv_cache_dtype="int8", kv_cache_bytes=32 << 20,
                                    max_num_seqs=4))
    if engine.runner.model.layer_stack is None:
        pytest.skip("this host's default engine has no run of layers in one call (neither GEMM kernel compiles here)")
    assert engine.runner.kv_pool.dtype == torch.int8 and engine.runner.kv_caches[0].scales is not None
    fused, layered, calls = decodes_through_the_run(engine, [PROMPT, "Queen present", "Hive 3 lost weight"], 16,
                                                    monkeypatch)
    assert calls >= 12
    assert [(o.output_token_ids, o.logprobs) for o in fused] == [(o.output_token_ids, o.logprobs) for o in layered]
