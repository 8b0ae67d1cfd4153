"""The model against independent references: transformers (same weights) and llama.cpp (same GGUF)."""
from __future__ import annotations

import importlib
import logging
import platform
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from apiary.cloud.engine import EngineConfig, LLMEngine, SamplingParams, int8
from apiary.cloud.engine.errors import EngineError
from apiary.kernels import cpu, huge_pages, ops
from tests.cloud.engine.conftest import attention_calls, decodes_through_the_run, prompt_logits
from tests.cloud.engine.tiny import make_checkpoint

PROMPT = ("<|im_start|>user\nThe hive scale reads 41.3 kg, up 0.8 kg since yesterday; humidity 61%. "
          "Is the colony healthy?<|im_end|>\n<|im_start|>assistant\nA steady weight gain")


def hf_logits(folder: Path, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen2", "tiny_llama3_rope"])
def test_tiny_checkpoint_logits_match_transformers(name: str, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(name)
    engine = LLMEngine(EngineConfig(model_path=folder, dtype="float32", kv_cache_bytes=4 << 20, block_size=8))
    ids = engine.tokenizer.encode("Queen present, brood pattern solid. Sensor 7 reports humidity 62% " * 3)[:90]
    assert len(ids) == 90  # long enough to pass the llama3 rope's original context (64)
    expected = hf_logits(folder, ids)
    cached, full = prompt_logits(engine, ids)
    assert cached == 0
    torch.testing.assert_close(full, expected, atol=2e-4, rtol=1e-4)
    # Chunked prefill (odd chunk size crossing block boundaries) gives the same logits...
    plain = LLMEngine(EngineConfig(model_path=folder, dtype="float32", kv_cache_bytes=4 << 20, block_size=8,
                                   enable_prefix_caching=False))
    cached, chunked = prompt_logits(plain, ids, chunk=13)
    assert cached == 0
    torch.testing.assert_close(chunked, expected, atol=2e-4, rtol=1e-4)
    # ...and so does a prefix-cache hit that computes only the tail.
    cached, tail = prompt_logits(engine, ids)
    assert cached == 88  # 11 full blocks of 8 come from the cache; the rest is computed
    torch.testing.assert_close(tail, expected[cached:], atol=2e-4, rtol=1e-4)


def _hf_llama_from_engine(engine: LLMEngine):  # -> transformers LlamaForCausalLM with the engine's weights
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    c = engine.model_config
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                      num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                      rope_theta=c.rope_theta, max_position_embeddings=c.max_position, tie_word_embeddings=True)
    with no_init_weights():  # every weight is overwritten below; skip the slow random init
        model = LlamaForCausalLM(cfg).float().eval()
    m = engine.runner.model
    q, k = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    state = {"model.embed_tokens.weight": m.embed, "model.norm.weight": m.norm, "lm_head.weight": m.lm_head}
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}."
        wq, wk, wv = layer.qkv.weight.split([q, k, k])
        gate, up = layer.gate_up.weight.chunk(2)
        state.update({p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk,
                      p + "self_attn.v_proj.weight": wv, p + "self_attn.o_proj.weight": layer.o_proj.weight,
                      p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                      p + "mlp.down_proj.weight": layer.down.weight, p + "input_layernorm.weight": layer.input_norm,
                      p + "post_attention_layernorm.weight": layer.post_norm})
    model.load_state_dict(state, strict=True)
    return model


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_model_logits_match_transformers(real_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2 through the paged engine == transformers' Llama on the same weights, to fp32 tolerance; its
    24-token prompt chunks' attention came from the numba kernel for runs longer than 16 queries."""
    served = attention_calls(monkeypatch, "_runs")
    ids = real_engine.tokenizer.encode(PROMPT)
    model = _hf_llama_from_engine(real_engine)
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    _, ours = prompt_logits(real_engine, ids, chunk=24, use_prefix_cache=False)  # all positions, whatever ran before
    assert len(served) >= real_engine.runner.model.config.num_layers  # every layer of the chunked passes
    assert (ours - expected).abs().max().item() < 2e-3, (ours - expected).abs().max().item()
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_model_agrees_with_llama_cpp(real_engine: LLMEngine, gguf_path: Path) -> None:
    """Independent check of GGUF loading (dequantization, q/k un-permutation, RoPE): llama.cpp on the same
    file picks the same next token almost everywhere; the differences are near-ties of our logits."""
    import llama_cpp

    ids = real_engine.tokenizer.encode(PROMPT)
    llm = llama_cpp.Llama(str(gguf_path), n_ctx=256, n_threads=2, logits_all=True, verbose=False)
    try:
        llm.eval(ids)
        theirs = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
    finally:
        llm.close()
    _, ours = prompt_logits(real_engine, ids, use_prefix_cache=False)
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree
    for pos in torch.nonzero(ours.argmax(-1) != theirs.argmax(-1)).flatten().tolist():
        mine, other = ours[pos].argmax().item(), theirs[pos].argmax().item()
        assert ours[pos, mine] - ours[pos, other] < 1.0, f"position {pos}: not a near-tie"
    corr = np.corrcoef(ours.flatten().numpy(), theirs.flatten().numpy())[0, 1]
    assert corr > 0.99, corr


@pytest.fixture(scope="module")
def real_bf16_engine(gguf_path: Path) -> LLMEngine:
    """One SmolLM2 engine in bf16 (``apiary cloud serve``'s default where bf16 is native) for this module's tests."""
    return LLMEngine(EngineConfig(model_path=gguf_path, dtype="bfloat16", kv_cache_bytes=64 << 20))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_model_bfloat16_tracks_float32(real_engine: LLMEngine, real_bf16_engine: LLMEngine,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmarks' serving dtype: bf16 (our vdpbf16ps kernel where numba compiles it, oneDNN-prepacked
    weights on other CPUs with native bf16, plain F.linear elsewhere) picks the fp32 engine's next token almost
    everywhere, the differences being near-ties, in one pass and in chunks. Where ``vdpbf16ps`` compiles, the
    whole prompt's attention came from the bf16-pair kernel (``kernels/cpu_attention_bf16.py``)."""
    from apiary.kernels import cpu_attention, cpu_attention_bf16

    bf16 = real_bf16_engine
    pair_kernel_calls: list[int] = []
    real_runs = cpu_attention_bf16.runs

    def spy(*args):  # type: ignore[no-untyped-def]
        pair_kernel_calls.append(len(args[9]))
        return real_runs(*args)

    monkeypatch.setattr(cpu_attention_bf16, "runs", spy)
    # The path this host takes is the one tested (AVX2 hosts: the F.linear fallback).
    native = cpu.native_bf16(cpu.host_flags()) is not None
    kernel = bf16_kernel_runs()
    packable = native and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    for layer in bf16.runner.model.layers:
        for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            assert (linear.kernel is not None, linear.packed is not None) == (kernel, packable and not kernel)
    # the head ranks in int8 where the grouped kernel runs, its candidates exact (int8.RefinedHead)
    assert isinstance(bf16.runner.model.head, int8.RefinedHead) == (int8.gemm_choice().backend == "grouped")
    ids = real_engine.tokenizer.encode(PROMPT)
    _, reference = prompt_logits(real_engine, ids, use_prefix_cache=False)
    _, whole = prompt_logits(bf16, ids, use_prefix_cache=False)
    assert len(pair_kernel_calls) == (bf16.runner.model.config.num_layers if cpu_attention.bf16_dots() else 0)
    _, chunked = prompt_logits(bf16, ids, chunk=16, use_prefix_cache=False)
    for ours in (whole, chunked):
        agree = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
        assert agree >= 0.9, agree
        for pos in torch.nonzero(ours.argmax(-1) != reference.argmax(-1)).flatten().tolist():
            mine, ref = ours[pos].argmax().item(), reference[pos].argmax().item()
            assert reference[pos, ref] - reference[pos, mine] < 1.0, f"position {pos}: not a near-tie"
    assert np.corrcoef(whole.flatten().numpy(), reference.flatten().numpy())[0, 1] > 0.99


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_model_bfloat16_head_ranks_in_int8_and_tracks_float32_closer(gguf_path: Path, real_bf16_engine: LLMEngine,
                                                                          gate_references: list) -> None:
    """A bf16 engine's LM head (``head="auto"``) ranks in int8 where the grouped kernel runs and computes the
    logits that can win as float32 sums (``int8.RefinedHead``): on the int8 gates' 428 teacher-forced positions
    it picks the fp32 engine's token at least as often as the bf16 head, whose logits are rounded to bf16
    (measured 99.1% against 98.4%). ``head="dtype"`` keeps the bf16 head."""
    from tests.cloud.engine.test_int8 import teacher_forced_agreement

    if int8.gemm_choice().backend != "grouped":
        pytest.skip("no grouped int8 kernel here: the head stays in the engine's dtype")
    refined = real_bf16_engine
    plain = LLMEngine(EngineConfig(model_path=gguf_path, dtype="bfloat16", head="dtype", kv_cache_bytes=64 << 20))
    assert isinstance(refined.runner.model.head, int8.RefinedHead)
    assert refined.runner.model.head.weight is refined.runner.model.lm_head
    assert not isinstance(plain.runner.model.head, int8.RefinedHead)
    ours, positions = teacher_forced_agreement(gate_references, refined)
    theirs, _ = teacher_forced_agreement(gate_references, plain)
    assert positions > 400 and ours >= max(theirs, 0.98), (ours, theirs)


def test_float32_engines_keep_their_head_and_bad_heads_are_refused(tmp_path: Path) -> None:
    folder = make_checkpoint(tmp_path / "tiny", "llama")
    engine = LLMEngine(EngineConfig(model_path=folder, dtype="float32", kv_cache_bytes=4 << 20, block_size=8))
    assert not isinstance(engine.runner.model.head, int8.RefinedHead)  # the reference keeps its float32 logits
    with pytest.raises(EngineError, match="head"):
        EngineConfig(model_path=folder, head="int4")


def bf16_kernel_runs() -> bool:
    """Whether this host's bf16 layers take our vdpbf16ps kernel (native bf16, and numba compiles it)."""
    return (cpu.native_bf16(cpu.host_flags()) is not None and ops.numba_available()
            and importlib.import_module("apiary.kernels.cpu_bf16_gemm").available())


def test_bf16_decode_steps_run_the_layers_in_one_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A bf16 engine whose projections take our bf16 kernel stacks all its layers (their weights then views of
    the stack), and decode steps take them in one compiled call with the per-layer path's tokens and logprobs
    exactly; elsewhere (AVX2, emulated bf16) nothing is stacked and the log says why. The log names the pages the
    stacked weights sit in (these tiny ones are under 2 MiB: 4 KiB pages unless the host's THP mode is always)."""
    folder = make_checkpoint(tmp_path / "four", "llama", layers=4, hidden=128, heads=4, kv_heads=2, intermediate=256)
    with caplog.at_level(logging.INFO, logger="apiary.cloud.engine.model_runner"):
        engine = LLMEngine(EngineConfig(model_path=folder, dtype="bfloat16", kv_cache_bytes=4 << 20, block_size=8))
    stack = engine.runner.model.layer_stack
    if not bf16_kernel_runs():
        assert stack is None
        assert "no run of layers in one call" in caplog.text
        return
    assert stack is not None and (stack.first, stack.count, stack.gemm) == (0, 4, "bf16")
    pages = "2 MiB" if all(huge_pages.eligible(packed) for packed in stack.packed) else "4 KiB"  # (THP always: 2)
    assert (f"decode steps run layers 0-3 in one compiled call (bf16 GEMM; weights in {pages} pages, transparent huge "
            f"pages {huge_pages.thp_mode()})") in caplog.text
    for i, layer in enumerate(engine.runner.model.layers):
        assert all(np.shares_memory(getattr(layer, name).kernel.weight.packed, stack.packed[j][i])
                   for j, name in enumerate(("qkv", "o_proj", "gate_up", "down")))
    prompts = ["Queen present", "Sensor 7 reports humidity 62% and a weight gain", "Hive 3"]
    fused, layered, calls = decodes_through_the_run(engine, prompts, 9, monkeypatch)
    assert calls >= 8  # every decode step after the prompts'
    assert [o.output_token_ids for o in fused] == [o.output_token_ids for o in layered]
    assert [o.logprobs for o in fused] == [o.logprobs for o in layered]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_int8_kv_rows_decode_through_the_run_of_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       dtype: str) -> None:
    """``kv_cache_dtype="int8"``: decode steps take the run of layers in one call over the int8 pool and its scales
    (bf16 weights through the vdpbf16ps kernel, or a float32 engine's bf16-held ones), the per-layer path's tokens
    and logprobs exactly, and the rows they write are int8 with a scale each."""
    available = bf16_kernel_runs() if dtype == "bfloat16" else ops.bf16w_gemm_available()
    if not available:
        pytest.skip(f"no run of layers for a {dtype} engine on this host (its GEMM kernel does not compile here)")
    folder = make_checkpoint(tmp_path / "four", "llama", layers=4, hidden=128, heads=4, kv_heads=2, intermediate=256)
    engine = LLMEngine(EngineConfig(model_path=folder, dtype=dtype, weights="auto" if dtype == "bfloat16" else "bf16",
                                    kv_cache_dtype="int8", kv_cache_bytes=4 << 20, block_size=8))
    assert engine.runner.kv_pool.dtype == torch.int8 and engine.runner.model.layer_stack is not None
    fused, layered, calls = decodes_through_the_run(engine, ["Queen present", "Hive 3 lost weight and 2 frames"], 9,
                                                    monkeypatch)
    assert calls >= 8
    assert [(o.output_token_ids, o.logprobs) for o in fused] == [(o.output_token_ids, o.logprobs) for o in layered]
    scales = engine.runner.kv_caches[0].scales
    assert scales is not None and scales.dtype == torch.float32 and bool((scales > 0).any())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_model_bfloat16_decodes_its_layers_in_one_call(real_bf16_engine: LLMEngine,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2 in bf16 (what ``apiary cloud serve`` runs where bf16 is native): all 30 layers stacked, and a
    batch's decode steps through the one call give the per-layer path's tokens and logprobs."""
    if not bf16_kernel_runs():
        pytest.skip("this host's bf16 layers do not take the vdpbf16ps kernel (no avx512_bf16 for numba)")
    engine = real_bf16_engine
    engine.reset_prefix_cache()
    stack = engine.runner.model.layer_stack
    assert stack is not None and (stack.first, stack.count, stack.gemm) == (0, 30, "bf16")
    if huge_pages.thp_mode() in ("always", "madvise"):  # what every decode step streams sits in 2 MiB pages
        assert all(huge_pages.eligible(packed) for packed in stack.packed)
        head = engine.runner.model.head
        assert not isinstance(head, int8.RefinedHead) or huge_pages.eligible(head.approx.weight.packed)
    # each projection's weight is held once, packed (the plain bf16 copy beside it was 212 MB)
    assert all(getattr(layer, name).plain is None for layer in engine.runner.model.layers for name in int8.PROJECTIONS)
    fused, layered, calls = decodes_through_the_run(engine, [PROMPT, "Queen present", "Hive 3 lost weight"], 24,
                                                    monkeypatch)
    assert calls >= 20
    assert [o.output_token_ids for o in fused] == [o.output_token_ids for o in layered]
    assert [o.logprobs for o in fused] == [o.logprobs for o in layered]


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="pages are dropped with glibc's madvise, counted from Linux's smaps")
def test_real_model_bf16_load_drops_the_mapped_checkpoints_pages(gguf_path: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The float32 checkpoint the cache maps (538 MB for SmolLM2) is resident only while each tensor is copied: it
    was the peak of an engine's load, and a bf16 model built from it holds its own weights. With the shipped teacher
    adapter merged first, as ``apiary cloud serve`` serves by default: merging writes no page of the mapping (a
    written page could not be dropped), and the model holds the merged weights."""
    from apiary.cloud.engine import adapter
    from apiary.cloud.engine.loader import load_checkpoint
    from apiary.cloud.engine.model import LlamaModel
    from apiary.shared import assets

    monkeypatch.setenv("APIARY_CHECKPOINT_CACHE", str(tmp_path))
    load_checkpoint(gguf_path)  # read and stored
    checkpoint = load_checkpoint(gguf_path)  # mapped from the entry
    probe = checkpoint.weights["model.layers.0.mlp.down_proj.weight"]
    mapping = huge_pages.mapping_of(probe.data_ptr())
    assert mapping, "the cached checkpoint is not a mapping of its own"
    mapped = dict(checkpoint.weights)
    lora = adapter.merge(checkpoint.weights, assets.shipped("sensor-teacher-lora"), gguf_path)
    target = lora.targets[0] + ".weight"
    assert checkpoint.weights[target] is not mapped[target]  # a merged copy; the mapped tensor is left as it was
    model = LlamaModel(checkpoint.config, checkpoint.weights, torch.device("cpu"), torch.bfloat16, max_positions=256)
    resident = int(huge_pages.mapping_of(probe.data_ptr())["Rss"].split()[0]) << 10
    size = sum(t.numel() * t.element_size() for t in mapped.values())
    assert resident < size // 50, (resident, size)  # a few edge pages and the small norms, not the tensors
    assert torch.equal(model.layers[0].down.weight, checkpoint.weights["model.layers.0.mlp.down_proj.weight"].bfloat16())
    layer, name = int(target.split(".")[2]), target.split(".")[-2]
    merged = checkpoint.weights[target].bfloat16()
    held = {"q_proj": model.layers[layer].qkv.weight[: merged.shape[0]], "o_proj": model.layers[layer].o_proj.weight,
            "down_proj": model.layers[layer].down.weight}.get(name)
    assert held is None or torch.equal(held, merged)  # the model holds the merged weight
    assert not torch.equal(mapped[target].bfloat16(), merged)  # which the adapter changed


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_model_bfloat16_answers_do_not_depend_on_the_batch(real_bf16_engine: LLMEngine) -> None:
    """Where our bf16 kernel runs, every projection, the attention and the norms compute each row on its own, so
    a request answers the same, token for token and logprob for logprob, alone or batched with others. (The
    float32 engine does not: torch's sgemm sums a row differently by the step's row count.)"""
    if not bf16_kernel_runs():
        pytest.skip("this host's bf16 layers do not take the vdpbf16ps kernel (no avx512_bf16 for numba)")
    engine = real_bf16_engine
    engine.reset_prefix_cache()
    prompts = [PROMPT, "Queen present", "Hive 3 lost weight", "Sensor 7 reports humidity 62% and a weight gain"]
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)
    batched = engine.generate(prompts, params)
    for prompt, together in zip(prompts, batched):
        engine.reset_prefix_cache()
        alone = engine.generate([prompt], params)[0]
        assert (alone.output_token_ids, alone.logprobs) == (together.output_token_ids, together.logprobs), prompt


def test_bf16_weights_hold_a_float32_engines_projections_in_bf16(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``weights="bf16"``: a float32 engine's projections hold their weights rounded to bf16 and sum float32 rows in
    float32 (``kernels/cpu_bf16w_gemm.py``), its logits those of the same engine with the rounded weights through
    ``F.linear``; its layers are stacked, and decode steps through the run in one call give the per-layer path's
    tokens and logprobs exactly, over float32 KV rows and over the bf16 ones ``kv_cache_dtype="auto"`` keeps for it.
    A bf16 engine's weights are bf16 already: the setting changes nothing there."""
    from apiary.cloud.engine.int8 import PROJECTIONS
    from apiary.cloud.engine.linear import Linear

    if not ops.bf16w_gemm_available():
        pytest.skip("numba does not compile for AVX2 and FMA here: the bf16-weight kernel does not run")
    folder = make_checkpoint(tmp_path / "four", "llama", layers=4, hidden=128, heads=4, kv_heads=2, intermediate=256)
    held = LLMEngine(EngineConfig(model_path=folder, dtype="float32", weights="bf16", head="dtype",
                                  kv_cache_dtype="dtype", kv_cache_bytes=4 << 20, block_size=8))
    plain = LLMEngine(EngineConfig(model_path=folder, dtype="float32", head="dtype", kv_cache_bytes=4 << 20,
                                   block_size=8))
    for mine, theirs in zip(held.runner.model.layers, plain.runner.model.layers):
        for name in PROJECTIONS:
            lin = getattr(mine, name)
            assert isinstance(lin, Linear) and lin.weight.dtype == torch.bfloat16 and lin.takes == torch.float32
            assert torch.equal(lin.weight, getattr(theirs, name).weight.bfloat16())
            setattr(theirs, name, Linear(lin.weight.float(), lin.bias))  # the same rounded weights, through F.linear
    stack = held.runner.model.layer_stack
    assert stack is not None and (stack.first, stack.count, stack.gemm) == (0, 4, "bf16w")
    for i, layer in enumerate(held.runner.model.layers):
        assert all(np.shares_memory(getattr(layer, name).kernel.weight.packed, stack.packed[j][i])
                   for j, name in enumerate(PROJECTIONS))
    fused, layered, calls = decodes_through_the_run(held, ["Queen present", "Hive 3 lost weight and 2 frames"], 9,
                                                    monkeypatch)
    assert calls >= 8
    assert [(o.output_token_ids, o.logprobs) for o in fused] == [(o.output_token_ids, o.logprobs) for o in layered]
    ids = list(range(3, 40))
    _, ours = prompt_logits(held, ids, use_prefix_cache=False)
    _, theirs = prompt_logits(plain, ids, use_prefix_cache=False)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    # head="auto" (the default): a speed path, so the head ranks in int8 too where the grouped kernel runs
    auto = LLMEngine(EngineConfig(model_path=folder, dtype="float32", weights="bf16", kv_cache_bytes=4 << 20,
                                  block_size=8))
    assert isinstance(auto.runner.model.head, int8.RefinedHead) == (int8.gemm_choice().backend == "grouped")
    # kv_cache_dtype="auto": a speed path keeps bf16 rows, and the run of layers reads and writes them
    assert auto.runner.kv_pool.dtype == torch.bfloat16 and auto.runner.model.layer_stack is not None
    fused, layered, calls = decodes_through_the_run(auto, ["Queen present", "Hive 3 lost weight and 2 frames"], 9,
                                                    monkeypatch)
    assert calls >= 8
    assert [(o.output_token_ids, o.logprobs) for o in fused] == [(o.output_token_ids, o.logprobs) for o in layered]
    bf16 = LLMEngine(EngineConfig(model_path=folder, dtype="bfloat16", weights="bf16", kv_cache_bytes=4 << 20,
                                  block_size=8))
    assert all(getattr(layer, name).takes in (None, torch.bfloat16) for layer in bf16.runner.model.layers
               for name in PROJECTIONS if isinstance(getattr(layer, name), Linear))


def test_auto_weights_are_bf16_where_auto_is_float32_on_a_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``weights="auto"`` (the default): where ``dtype="auto"`` resolves to float32 on a CPU (no native bf16: here
    AVX-512 and AMX hidden, as ``.ci/avx2-rehearsal`` hides them), the projections hold bf16 weights and sum in
    float32; an engine asked for ``dtype="float32"``, the correctness reference, keeps float32 weights, and a bf16
    engine keeps its own."""
    from apiary.cloud.engine.model_runner import resolve_weights

    if not ops.bf16w_gemm_available():
        pytest.skip("numba does not compile for AVX2 and FMA here: the bf16-weight kernel does not run")
    cpu_device = torch.device("cpu")
    folder = make_checkpoint(tmp_path / "tiny", "llama")
    auto, reference = EngineConfig(model_path=folder), EngineConfig(model_path=folder, dtype="float32")
    assert auto.weights == "auto"
    assert resolve_weights(auto, cpu_device, torch.float32) == "bf16"
    assert resolve_weights(auto, cpu_device, torch.bfloat16) == "dtype"
    assert resolve_weights(reference, cpu_device, torch.float32) == "dtype"
    for chosen in ("dtype", "int8", "bf16"):
        assert resolve_weights(EngineConfig(model_path=folder, weights=chosen), cpu_device, torch.float32) == chosen
    monkeypatch.setenv(cpu.HIDE_ENV, "avx512*,amx*,avx_vnni")
    engine = LLMEngine(EngineConfig(model_path=folder, kv_cache_bytes=4 << 20, block_size=8))
    assert engine.runner.dtype == torch.float32 and engine.runner.weights == "bf16"
    assert engine.runner.model.layers[0].qkv.takes == torch.float32
    assert engine.runner.kv_pool.dtype == torch.bfloat16  # and its KV rows in bf16 (model_runner.resolve_kv_cache)
    kept = LLMEngine(EngineConfig(model_path=folder, dtype="float32", kv_cache_bytes=4 << 20, block_size=8))
    assert kept.runner.weights == "dtype" and kept.runner.model.layers[0].qkv.weight.dtype == torch.float32
    assert kept.runner.kv_pool.dtype == torch.float32


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_model_bf16_weights_track_float32_and_do_not_depend_on_the_batch(gguf_path: Path,
                                                                               gate_references: list) -> None:
    """SmolLM2 as a float32 engine with its projection weights held in bf16 (``weights="bf16"``, the speed path for
    CPUs without native bf16) and, as ``kv_cache_dtype="auto"`` keeps for it, its KV rows in bf16: on the int8
    gates' 428 teacher-forced positions it picks the fp32 engine's token at least 98% of the time (measured 99.5%,
    the same as with float32 rows; bf16 rows alone under float32 weights: 99.8%), and each row is summed on its
    own, so a request answers the same alone or batched, token for token and logprob for logprob (the float32
    engine through sgemm does not)."""
    from tests.cloud.engine.test_int8 import teacher_forced_agreement

    if not ops.bf16w_gemm_available():
        pytest.skip("numba does not compile for AVX2 and FMA here: the bf16-weight kernel does not run")
    engine = LLMEngine(EngineConfig(model_path=gguf_path, dtype="float32", weights="bf16", kv_cache_bytes=64 << 20))
    assert engine.runner.kv_pool.dtype == torch.bfloat16
    agreement, positions = teacher_forced_agreement(gate_references, engine)
    assert positions > 400 and agreement >= 0.98, agreement
    prompts = [PROMPT, "Queen present", "Hive 3 lost weight", "Sensor 7 reports humidity 62% and a weight gain"]
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)
    engine.reset_prefix_cache()
    batched = engine.generate(prompts, params)
    for prompt, together in zip(prompts, batched):
        engine.reset_prefix_cache()
        alone = engine.generate([prompt], params)[0]
        assert (alone.output_token_ids, alone.logprobs) == (together.output_token_ids, together.logprobs), prompt


def test_bad_checkpoints_raise_engine_error(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="neither a GGUF file"):
        LLMEngine(EngineConfig(model_path=tmp_path / "missing.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(EngineError, match="not a readable GGUF"):
        LLMEngine(EngineConfig(model_path=tmp_path / "junk.gguf"))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(EngineError, match="not supported"):
        LLMEngine(EngineConfig(model_path=tmp_path))
    with pytest.raises(EngineError, match="block_size"):
        EngineConfig(model_path=tmp_path, block_size=0)


def test_engine_config_names_the_backend():
    with pytest.raises(EngineError, match="cpu_attention"):
        EngineConfig(model_path="x.gguf", cpu_attention="fortran")  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_model_batched_tokens_match_the_torch_backend(real_engine, gguf_path):
    """16 mixed-length SmolLM2 requests decoded together: the numba kernel (the default on CPU) and
    the torch reference pick the same greedy tokens, or differ only at near-ties."""
    from apiary.cloud.engine import SamplingParams
    from tests.cloud.engine.test_real_batching import check_same_or_near_tie, generate_all, make_prompts

    assert real_engine.runner.model.ragged_decode
    torch_engine = LLMEngine(EngineConfig(model_path=gguf_path, dtype="float32", kv_cache_bytes=128 << 20,
                                          cpu_attention="torch"))
    assert not torch_engine.runner.model.ragged_decode
    prompts = make_prompts(real_engine)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    real_engine.reset_prefix_cache()
    ours = generate_all(real_engine, prompts, params)
    theirs = generate_all(torch_engine, prompts, params)
    for p, ref, got in zip(prompts, theirs, ours):
        check_same_or_near_tie(torch_engine, p, ref, got)
    assert sum(a == b for a, b in zip(ours, theirs)) >= 14


def _run_mixed_steps(engine: LLMEngine) -> list[tuple[list[int], list[float]]]:
    """Three requests arriving a step apart (so steps mix decode rows with prefill chunks): tokens and logprobs."""
    from apiary.cloud.engine import SamplingParams

    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3)
    texts = ["Queen present, brood pattern solid. " * 4, "Sensor 7 reports humidity 62%", "Swarm cells on frame 3, " * 7]
    ids, finals = [], {}
    for text in texts:
        ids.append(engine.add_request(engine.tokenizer.encode(text), params=params))
        for out in engine.step():
            finals[out.request_id] = out
    while engine.has_unfinished():
        for out in engine.step():
            finals[out.request_id] = out
    return [(finals[i].output_token_ids, [lp.logprob for lp in finals[i].logprobs]
             + [v for lp in finals[i].logprobs for _, v in lp.top]) for i in ids]


def _check_cpu_steps_match_per_call_ops(engine: Callable[[], LLMEngine], monkeypatch: pytest.MonkeyPatch) -> None:
    """``_run_mixed_steps`` on a fresh ``engine()`` whose every pass took ``kernels.ops.cpu_step``, then on one whose
    passes call ``kernels.ops`` per op: the same tokens and logprobs."""
    from apiary.kernels import ops

    real, taken = ops.cpu_step, []
    monkeypatch.setattr(ops, "cpu_step", lambda *a, **k: taken.append(real(*a, **k)) or taken[-1])
    fast = _run_mixed_steps(engine())
    assert taken and all(step is not None for step in taken)
    monkeypatch.setattr(ops, "cpu_step", lambda *a, **k: None)
    assert fast == _run_mixed_steps(engine())


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bf16", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen2"])
def test_cpu_steps_compute_what_the_per_call_ops_do(name: str, dtype: str, kv_cache_dtype: str,
                                                    request: pytest.FixtureRequest,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU forward with its small ops checked once per pass (``kernels.ops.cpu_step``) generates the very
    tokens and logprobs (float equality) of the forward that calls ``kernels.ops`` per op: Llama, and Qwen2's
    q/k/v biases, in float32 and bf16, KV rows in the engine's dtype, in bf16 (under float32 rows too) and in int8,
    over steps mixing decode rows, prefill chunks and chunked prefill."""
    folder = request.getfixturevalue(name)
    _check_cpu_steps_match_per_call_ops(lambda: LLMEngine(EngineConfig(
        model_path=folder, dtype=dtype, kv_cache_bytes=4 << 20, block_size=8, max_num_batched_tokens=24,
        kv_cache_dtype=kv_cache_dtype)), monkeypatch)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_real_model_cpu_steps_compute_what_the_per_call_ops_do(gguf_path: Path, kv_cache_dtype: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2 on its real weights in bf16 (the dtype ``auto`` serves on bf16 hosts; float32 elsewhere): the same
    tokens and logprobs with the per-pass CPU step as with the per-call ops, over mixed steps."""
    dtype = "bfloat16" if cpu.native_bf16(cpu.host_flags()) else "float32"
    _check_cpu_steps_match_per_call_ops(lambda: LLMEngine(EngineConfig(
        model_path=gguf_path, dtype=dtype, kv_cache_bytes=64 << 20, max_num_batched_tokens=48,
        kv_cache_dtype=kv_cache_dtype)), monkeypatch)
