"""W8A8 int8 weights (cloud.engine.int8): the quantizers, the GEMM, SmoothQuant's folding, and the real-model gate."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from apiary.cloud.engine import EngineConfig, LLMEngine, SamplingParams, int8
from apiary.cloud.engine.errors import EngineError
from apiary.cloud.engine.linear import Linear
from apiary.cloud.engine.sampling_params import StructuredOutput
from apiary.kernels import cpu_head, ops
from tests.cloud.engine.conftest import decodes_through_the_run, prompt_logits
from tests.cloud.engine.tiny import make_checkpoint


def test_weights_quantize_per_output_channel() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=g) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different size
    w[5] = 0.0
    q, scale = int8.quantize_weight(w)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    assert q.abs().amax(dim=1)[torch.arange(48) != 5].eq(127).all()  # every row uses its full range
    assert torch.equal(q[5], torch.zeros(40, dtype=torch.int8))
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()
    q7, scale7 = int8.quantize_weight(w, qmax=63)  # 7-bit weights, for int8 kernels without VNNI
    assert q7.abs().amax(dim=1)[torch.arange(48) != 5].eq(63).all()
    torch.testing.assert_close(scale7, scale * 127 / 63)


def test_activations_quantize_per_token() -> None:
    x = torch.tensor([[0.5, -2.0, 1.0], [0.0, 0.0, 0.0], [300.0, 1.0, -1.0]])
    q, scale = int8.quantize_rows(x)
    assert scale.shape == (3, 1)
    assert q[0].tolist() == [32, -127, 64] and q[1].tolist() == [0, 0, 0] and q[2, 0] == 127
    assert ((q.float() * scale - x).abs() <= scale / 2 + 1e-6).all()


def backends(layer: int8.Int8Linear) -> list[int8.Int8Linear]:
    """``layer`` on every int8 GEMM this torch has, fast on this host or not: both must be exact with the
    weights' probed width."""
    plain = int8.Int8Linear(layer.qweight, layer.scale, layer.bias, None)  # torch._int_mm
    if not hasattr(torch.ops.onednn, "qlinear_pointwise"):
        return [plain]
    return [plain, int8.Int8Linear(layer.qweight, layer.scale, layer.bias, int8._prepack(layer.qweight))]


@pytest.fixture(scope="module")
def per_token_choice() -> int8.GemmChoice:
    """What the probe finds for the per-token path (``int8.per_token_choice``): where the grouped kernel runs,
    ``gemm_choice()`` says nothing about oneDNN's weight width (8-bit pair sums saturate without VNNI)."""
    return int8.per_token_choice()


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_computes_the_quantized_product(rows: int, dtype: torch.dtype,
                                                    per_token_choice: int8.GemmChoice) -> None:
    """Both GEMMs (oneDNN with u8 activations, torch._int_mm) compute q(x) @ q(W).T exactly up to float
    rounding, and the result stays close to the float layer."""
    g = torch.Generator().manual_seed(rows)
    w, bias = torch.randn(96, 80, generator=g) * 0.05, torch.randn(96, generator=g)
    x = torch.randn(rows, 80, generator=g).to(dtype)
    before = x.clone()
    q, scale = int8.quantize_weight(w, per_token_choice.weight_qmax)  # 7-bit where 8-bit pair sums saturate
    layer = int8.Int8Linear(q, scale, bias.to(dtype))
    xq, s = int8.quantize_rows(x)
    exact = (xq.float() * s) @ layer.dequantized().t() + bias.to(dtype).float()
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    for lin in backends(layer):
        with torch.inference_mode():
            y = lin(x)
        assert y.dtype == dtype and y.shape == (rows, 96)
        torch.testing.assert_close(y.float(), exact, **tol)
        ref = F.linear(x.float(), w, bias)
        assert ((y.float() - ref).norm() / ref.norm()).item() < 0.03
        assert lin(x[:0]).shape == (0, 96)
        assert lin(x.reshape(1, rows, 80)).shape == (1, rows, 96)
    assert torch.equal(x, before)  # oneDNN's u8 activations overwrite the quantized copy, never the input


def test_onednn_writes_bf16_through_float32_where_its_bf16_kernel_is_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    if not hasattr(torch.ops.onednn, "qlinear_pointwise"):
        pytest.skip("this torch build has no oneDNN int8 linear")
    w = torch.randn(32, 48) * 0.1
    q, scale = int8.quantize_weight(w, int8.per_token_choice().weight_qmax)  # 7-bit where 8-bit pair sums saturate
    layer = int8.Int8Linear(q, scale, None, int8._prepack(q))
    x = torch.randn(5, 48).bfloat16()
    direct = layer(x)
    monkeypatch.setattr(int8, "per_token_choice", lambda: int8.GemmChoice("onednn", (torch.float32,), "scripted"))
    via_float = layer(x)
    assert via_float.dtype == torch.bfloat16
    torch.testing.assert_close(via_float, direct, atol=0.02, rtol=0.02)


def test_the_probe_picks_an_exact_gemm_that_keeps_up_with_float32() -> None:
    choice = int8.gemm_choice()
    assert "float32 F.linear" in choice.reason
    assert choice.backend in ("grouped", "onednn", "int_mm", None)
    assert (choice.backend == "onednn") == (torch.float32 in choice.onednn_out)
    if choice.backend is not None:
        assert int8.int8_linear(torch.randn(16, 32)).backend == choice.backend


@pytest.fixture
def without_grouped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe as a host without numba or AVX2 runs it: no grouped kernel, so oneDNN and torch._int_mm are tried."""
    monkeypatch.setattr(int8.ops, "grouped_int8_available", lambda: False)


def test_the_probe_prefers_the_grouped_kernel_where_it_runs() -> None:
    if not ops.grouped_int8_available():
        pytest.skip("neither AVX-512 VNNI nor AVX2 here: the grouped int8 kernel does not run")
    choice = int8.gemm_choice.__wrapped__()
    assert choice.backend == "grouped" and f"grouped int8 kernel ({ops.grouped_int8_kernel()}): " in choice.reason, choice
    assert isinstance(int8.int8_linear(torch.randn(16, 32)), int8.GroupedInt8Linear)


def test_the_probe_passes_over_an_inexact_grouped_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    if not ops.grouped_int8_available():
        pytest.skip("neither AVX-512 VNNI nor AVX2 here: the grouped int8 kernel does not run")
    real = ops.grouped_int8_linear
    monkeypatch.setattr(ops, "grouped_int8_linear", lambda x, w: real(x, w).clamp(-1, 1))
    choice = int8.gemm_choice.__wrapped__()
    assert choice.backend != "grouped" and f"grouped int8 kernel ({ops.grouped_int8_kernel()}): inexact" in choice.reason, choice


def test_the_probe_says_why_there_is_no_grouped_kernel(without_grouped: None) -> None:
    choice = int8.gemm_choice.__wrapped__()
    assert choice.backend != "grouped" and "no grouped int8 kernel here (it needs numba and AVX2 or AVX-512 VNNI)" in choice.reason


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_int8_linear_computes_the_grouped_product(rows: int, dtype: torch.dtype) -> None:
    """Activations and weights quantized per 64 inputs: the layer gives its float64 reference up to the output's
    rounding, with the bias added, and stays close to the float layer."""
    if not ops.grouped_int8_available():
        pytest.skip("neither AVX-512 VNNI nor AVX2 here: the grouped int8 kernel does not run")
    g = torch.Generator().manual_seed(rows)
    w, bias = torch.randn(40, 150, generator=g) * 0.05, torch.randn(40, generator=g)  # neither 16 | N nor 64 | K
    x = torch.randn(rows, 150, generator=g).to(dtype)
    layer = int8.GroupedInt8Linear.of(w, bias.to(dtype))
    with torch.inference_mode():
        y = layer(x)
    assert y.dtype == dtype and y.shape == (rows, 40)
    exact = ops.grouped_int8_reference(x, layer.weight) + bias.to(dtype).double()
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.01}
    torch.testing.assert_close(y.double(), exact, **tol)
    ref = F.linear(x.float(), w, bias)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 0.02
    assert layer(x[:0]).shape == (0, 40)
    assert layer(x.reshape(1, rows, 150)).shape == (1, rows, 40)
    assert ((layer.dequantized() - w).abs() <= w.abs().amax() / 127).all()


def test_swiglu_down_hands_gate_and_up_to_the_grouped_kernel() -> None:
    """The model's MLP tail: a grouped int8 down projection takes ``[gate | up]`` as it is (silu and the product in
    the kernel's quantization pass); any other layer gets ``silu(gate) * up``. Both give the same numbers."""
    if not ops.grouped_int8_available():
        pytest.skip("neither AVX-512 VNNI nor AVX2 here: the grouped int8 kernel does not run")
    from apiary.cloud.engine.model import swiglu_down

    g = torch.Generator().manual_seed(5)
    w, gate_up = torch.randn(48, 96, generator=g) * 0.1, torch.randn(6, 192, generator=g) * 3
    layer = int8.GroupedInt8Linear.of(w)
    calls: list[bool] = []
    real = layer._linear  # the kernel bound to this weight (ops.bind_grouped_int8)
    layer._linear = lambda x, gated=False: calls.append(gated) or real(x, gated)
    fused = swiglu_down(layer, gate_up)
    assert calls == [True]
    gate, up = gate_up.chunk(2, dim=-1)
    unfused = layer(F.silu(gate) * up)
    assert ((fused - unfused).norm() / unfused.norm()).item() < 2e-3
    plain = swiglu_down(Linear.of(w), gate_up)
    torch.testing.assert_close(plain, F.linear(F.silu(gate) * up, w))


def test_the_probe_passes_over_an_inexact_kernel(without_grouped: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saturating int16 pair sums (u8 x s8 without VNNI) give wrong products: such a kernel is never chosen."""
    real_linear = int8._onednn_linear
    monkeypatch.setattr(int8, "_onednn_linear", lambda *args: real_linear(*args).clamp(-30000, 30000))
    choice = int8.gemm_choice.__wrapped__()
    assert choice.backend != "onednn" and "oneDNN -> float32, 8-bit weights: inexact" in choice.reason


def _avx2_u8s8(xu: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """u8 x s8 as AVX2 without VNNI computes it (``vpmaddubsw``): adjacent products summed into a saturating int16."""
    m, (n, k) = xu.shape[0], w.shape
    pairs = (xu.long()[:, None, :] * w.long()[None, :, :]).view(m, n, k // 2, 2).sum(-1).clamp(-32768, 32767)
    return (pairs.sum(-1) - int8.ACTIVATION_ZERO_POINT * w.long().sum(-1)).float()


def test_the_probe_falls_back_to_7_bit_weights_where_int16_pair_sums_saturate(without_grouped: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU without VNNI, 8-bit weights overflow the kernel's int16 pair sums (255 * 127 * 2 > 32,767):
    the probe sees inexact products and takes 7-bit weights (255 * 63 * 2 fits), which layers then use."""
    monkeypatch.setattr(int8, "_prepack", lambda w: w)
    monkeypatch.setattr(int8, "PROBE_SLOWDOWN", 1e6)  # the emulation is slow; only exactness is in question here
    monkeypatch.setattr(int8, "_onednn_linear", lambda qu, w, scale, dtype: (_avx2_u8s8(qu, w) * scale).to(dtype))
    real_int_mm = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda x, wt: _avx2_u8s8(x.view(torch.uint8) ^ 128, wt.t()).int()
                        if wt.abs().amax() > 63 else real_int_mm(x, wt))
    assert _avx2_u8s8(torch.full((1, 2), 255, dtype=torch.uint8), torch.full((1, 2), 127, dtype=torch.int8)) != 255 * 127 * 2 - 128 * 254
    choice = int8.gemm_choice.__wrapped__()
    assert (choice.backend, choice.weight_qmax) == ("onednn", 63), choice
    assert "oneDNN -> float32, 8-bit weights: inexact" in choice.reason and "torch._int_mm, 8-bit weights: inexact" in choice.reason
    again = int8.per_token_choice.__wrapped__()  # the per-token path's own probe finds the same
    assert (again.backend, again.weight_qmax) == ("onednn", 63), again
    monkeypatch.setattr(int8, "per_token_choice", lambda: choice)
    layer = int8.Int8Linear.of(torch.randn(16, 32))
    assert layer.qweight.abs().amax() == 63
    x = torch.randn(3, 32)
    q, s = int8.quantize_rows(x)
    torch.testing.assert_close(layer(x), (q.float() * s) @ layer.dequantized().t(), atol=1e-4, rtol=1e-4)


def test_a_per_token_layer_takes_its_own_probes_weight_width_where_the_grouped_kernel_was_chosen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``gemm_choice`` says "grouped" (8 bits) without looking at oneDNN; a per-token layer built beside it
    quantizes to what oneDNN needs here (7 bits on a CPU without VNNI, scripted)."""
    monkeypatch.setattr(int8, "gemm_choice", lambda: int8.GemmChoice("grouped", (), "scripted"))
    monkeypatch.setattr(int8, "per_token_choice", lambda: int8.GemmChoice("int_mm", (), "scripted", 63))
    layer = int8.Int8Linear.of(torch.randn(16, 32))
    assert layer.backend == "int_mm" and layer.qweight.abs().amax() == 63


def test_the_probe_passes_over_a_reference_speed_kernel(without_grouped: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that is exact but far slower than float32 (oneDNN's reference int8 matmul: 243 ms where its
    JIT kernel takes 0.08) is not chosen; with nothing fast left, int8 weights are refused, saying why."""
    real_linear, real_int_mm = int8._onednn_linear, torch._int_mm

    def slow(fn):
        def run(*args, **kwargs):
            time.sleep(0.05)
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(int8, "_onednn_linear", slow(real_linear))
    choice = int8.gemm_choice.__wrapped__()
    assert choice.backend != "onednn" and choice.onednn_out == ()
    monkeypatch.setattr(torch, "_int_mm", slow(real_int_mm))
    choice = int8.gemm_choice.__wrapped__()
    assert choice.backend is None and "torch._int_mm" in choice.reason
    monkeypatch.setattr(int8, "per_token_choice", lambda: choice)
    with pytest.raises(EngineError, match="fast int8 GEMM"):
        int8.Int8Linear.of(torch.randn(16, 32))


def test_smoothing_moves_outliers_and_is_bounded() -> None:
    act = torch.tensor([100.0, 1.0, 0.0, 4.0])
    w = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.5, 0.25, 1.0, 0.0]])
    s = int8.smoothing(act, w, 0.5)
    torch.testing.assert_close(s[:2], torch.tensor([10.0, 1.0]))  # sqrt(100) / sqrt(1), sqrt(1) / sqrt(1)
    assert s[2] == 1.0 and s[3] == 1.0  # a channel that never fired, a channel without weight
    assert int8.smoothing(act, w, 1.0).tolist() == [100.0, 1.0, 1.0, 1.0]  # alpha 1: all of it into the weights
    with pytest.raises(EngineError, match="alpha"):
        int8.smoothing(act, w, 1.5)


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen2"])
def test_smoothquant_folding_leaves_the_float_model_unchanged(name: str, request: pytest.FixtureRequest,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The SmoothQuant factors folded into the norms, the up rows and the v rows (with q/k/v biases and GQA)
    change nothing in exact arithmetic: with float layers in place of int8 ones, the logits stay the same."""
    folder = request.getfixturevalue(name)
    engine = LLMEngine(EngineConfig(model_path=folder, dtype="float32", kv_cache_bytes=4 << 20, block_size=8))
    ids = engine.tokenizer.encode("Queen present, brood pattern solid. Sensor 7 reports humidity 62% " * 2)
    _, before = prompt_logits(engine, ids, use_prefix_cache=False)
    model = engine.runner.model
    stats = int8.calibrate(model, [ids[:40], ids[10:]], block_size=8)
    assert all(st["down"].shape == (model.config.intermediate_size,) for st in stats)
    monkeypatch.setattr(int8, "int8_linear", lambda w, b=None: Linear.of(w, b))
    int8.quantize_model(model, stats, alpha=0.5)
    assert model.layers[0].input_norm.ne(model.layers[0].input_norm.new_ones(1)).any()
    _, after = prompt_logits(engine, ids, use_prefix_cache=False)
    torch.testing.assert_close(after, before, atol=2e-4, rtol=1e-4)


def test_a_probe_that_looks_slow_is_measured_again_beside_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's verdict holds for the process: one measurement on a busy CPU (once ~12 ms against float32's
    0.12 ms) must not refuse a fast kernel, and a reference kernel must still be refused. Scripted times, not
    measured ones."""
    def candidate() -> None: ...

    def baseline() -> None: ...

    def script(candidate_ms: list[float], baseline_ms: list[float]) -> dict:
        return {candidate: iter(candidate_ms), baseline: iter(baseline_ms)}

    times = script([0.10], [])
    monkeypatch.setattr(int8, "_best_ms", lambda fn, repeats=3: next(times[fn]))
    assert int8._keeps_up(candidate, baseline, 0.12) == (True, 0.10)  # fast at once: measured once
    times = script([12.0, 11.9, 0.09], [0.12, 0.11])  # a busy moment, then the pair that shows the kernel
    assert int8._keeps_up(candidate, baseline, 0.12) == (True, 0.09)
    assert next(times[candidate], None) is None
    rounds = int8.PROBE_ROUNDS
    times = script([30.0] * (rounds + 1), [0.12] * rounds)  # a reference kernel: slow in every round
    assert int8._keeps_up(candidate, baseline, 0.12) == (False, 30.0)
    assert next(times[candidate], None) is None and next(times[baseline], None) is None


def needs_fast_int8() -> None:
    choice = int8.gemm_choice()
    if choice.backend is None:
        pytest.skip(f"no fast int8 GEMM on this host ({choice.reason})")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("gemm", ["probed", "per-token"])
def test_an_int8_engine_serves_batches(tiny_qwen2: Path, kv_cache_dtype: str, gemm: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """On the probed GEMM (the grouped kernel where AVX-512 VNNI is) and on the per-token path of hosts without
    it; also with int8 KV rows: the two int8 options compose (calibration runs on a float pool of its own)."""
    if gemm == "per-token":
        monkeypatch.setattr(int8.ops, "grouped_int8_available", lambda: False)
        choice = int8.gemm_choice.__wrapped__()
        monkeypatch.setattr(int8, "gemm_choice", lambda: choice)
    needs_fast_int8()
    engine = LLMEngine(EngineConfig(model_path=tiny_qwen2, dtype="float32", weights="int8", kv_cache_bytes=4 << 20,
                                    block_size=8, kv_cache_dtype=kv_cache_dtype))
    assert engine.runner.kv_pool.quantized == (kv_cache_dtype == "int8")
    kind = int8.GroupedInt8Linear if int8.gemm_choice().backend == "grouped" else int8.Int8Linear
    assert all(isinstance(layer.qkv, kind) and isinstance(layer.down, kind) for layer in engine.runner.model.layers)
    with pytest.raises(EngineError, match="already quantized"):
        int8.quantize_model(engine.runner.model, None)
    assert engine.runner.model.layer_stack is None  # Qwen2's q/k/v biases: decode keeps the per-layer path
    outs = engine.generate(["Queen present", "Sensor 7 reports humidity 62% and a weight gain"],
                           SamplingParams(max_tokens=6, ignore_eos=True))
    assert [len(o.output_token_ids) for o in outs] == [6, 6]


@pytest.mark.parametrize(("layers", "kept"), [(1, set()), (2, set()), (4, set()), (5, {0, 4}), (30, {0, 29})])
def test_the_layers_left_in_dtype_are_the_first_and_last_of_a_deep_enough_stack(layers: int, kept: set[int]) -> None:
    assert int8.dtype_layers(layers) == kept
    assert int8.dtype_layers(30, edge=2) == {0, 1, 28, 29} and int8.dtype_layers(30, edge=0) == set()


def test_an_int8_engine_keeps_its_first_and_last_layers_in_dtype(tmp_path: Path) -> None:
    """A six-layer model: layers 0 and 5 keep their float projections (and their unsmoothed norms), 1-4 go int8;
    the engine serves batches through the mix."""
    needs_fast_int8()
    folder = make_checkpoint(tmp_path / "six", "llama", layers=6)
    reference = LLMEngine(EngineConfig(model_path=folder, dtype="float32", kv_cache_bytes=4 << 20, block_size=8))
    engine = LLMEngine(EngineConfig(model_path=folder, dtype="float32", weights="int8", kv_cache_bytes=4 << 20,
                                    block_size=8))
    float_layers, layers = reference.runner.model.layers, engine.runner.model.layers
    for i, layer in enumerate(layers):
        if i in (0, 5):
            assert all(isinstance(getattr(layer, name), Linear) for name in int8.PROJECTIONS), i
            assert torch.equal(layer.input_norm, float_layers[i].input_norm)
            assert torch.equal(layer.qkv.weight, float_layers[i].qkv.weight)
        else:
            assert not any(isinstance(getattr(layer, name), Linear) for name in int8.PROJECTIONS), i
    prompts = ["Queen present", "Sensor 7 reports humidity 62% and a weight gain"]
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [len(o.output_token_ids) for o in outs] == [6, 6]


def refined_head_engine(tmp_path: Path) -> LLMEngine:
    """A six-layer int8 engine in float32 whose head is a ``RefinedHead`` (skips where the grouped kernel is not
    this host's int8)."""
    needs_fast_int8()
    if int8.gemm_choice().backend != "grouped":
        pytest.skip("the refined head takes the grouped int8 kernel; this host's int8 is per-token")
    folder = make_checkpoint(tmp_path / "six", "llama", layers=6)
    return LLMEngine(EngineConfig(model_path=folder, dtype="float32", weights="int8", kv_cache_bytes=4 << 20,
                                  block_size=8))


def test_an_int8_engines_head_ranks_in_int8_and_computes_the_winners_exactly(tmp_path: Path) -> None:
    """With the grouped kernel the LM head is a ``RefinedHead``: its logits at each row's top candidates are the
    float head's (float32 sums), so its top-1 is the float head's; elsewhere they are the int8 approximation."""
    engine = refined_head_engine(tmp_path)
    model = engine.runner.model
    assert isinstance(model.head, int8.RefinedHead) and model.head.weight is model.lm_head
    hidden = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    exact = Linear.of(model.lm_head)(hidden).float()
    approx = model.head.approx(hidden)
    refined = model.logits(hidden)
    top = approx.topk(cpu_head.CANDIDATES, dim=1).indices
    torch.testing.assert_close(refined.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(refined.argmax(1), exact.argmax(1))
    assert not torch.equal(approx, exact)  # the approximation is not the float head (else this tests nothing)


def test_the_head_stays_in_dtype_where_the_probe_passed_over_the_grouped_kernel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, per_token_choice: int8.GemmChoice) -> None:
    """Where the probe chose the per-token path (the grouped kernel inexact or slow on this host, though it can
    run), the head keeps the float weight: it takes the probe's word, as the layers do."""
    if per_token_choice.backend is None:
        pytest.skip(f"no per-token int8 GEMM on this host ({per_token_choice.reason})")
    monkeypatch.setattr(int8, "gemm_choice", lambda: per_token_choice)
    engine = LLMEngine(EngineConfig(model_path=make_checkpoint(tmp_path / "six", "llama", layers=6), dtype="float32",
                                    weights="int8", kv_cache_bytes=4 << 20, block_size=8))
    assert isinstance(engine.runner.model.layers[1].qkv, int8.Int8Linear)
    assert isinstance(engine.runner.model.head, Linear)

def test_a_grammar_rows_allowed_tokens_reach_the_refined_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine hands the head the grammar's bitmask of the rows it samples (a grammar's allowed tokens can all
    lie below the row's top candidates), and the constrained answers are the float head's, token for token."""
    engine = refined_head_engine(tmp_path)
    masks: list[torch.Tensor | None] = []
    refined_call = int8.RefinedHead.__call__
    monkeypatch.setattr(int8.RefinedHead, "__call__", lambda self, h, allowed=None: masks.append(allowed) or
                        refined_call(self, h, allowed))
    choices = StructuredOutput("choice", '["swarm", "robbing", "heat stress", "queenless"]')
    params = [SamplingParams(max_tokens=16, structured=choices), SamplingParams(max_tokens=8, ignore_eos=True)]
    prompts = ["Hive 3 lost 2 kg overnight", "Queen present"]
    outs = engine.generate(prompts, params)
    assert outs[0].text in ("swarm", "robbing", "heat stress", "queenless")
    seen = [m for m in masks if m is not None]
    assert seen and all(m.dtype == torch.int32 and m.shape[0] in (1, 2) for m in seen)
    engine.runner.model.head = Linear.of(engine.runner.model.lm_head)  # the float head, same int8 layers
    plain = engine.generate(prompts, params)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in plain]

def test_decode_steps_run_the_int8_layers_in_one_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Six layers, 1-4 int8: the engine stacks those (their projections then views of the stack), and decode steps
    take them in one compiled call with the per-layer path's tokens and logprobs exactly; prompt steps do not."""
    needs_fast_int8()
    if int8.gemm_choice().backend != "grouped":
        pytest.skip("the run takes grouped int8 weights; this host's int8 is per-token")
    import numba

    from apiary.kernels import cpu_decode_layers

    folder = make_checkpoint(tmp_path / "six", "llama", layers=6, hidden=128, heads=4, kv_heads=2, intermediate=256)
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine(EngineConfig(model_path=folder, dtype=dtype, weights="int8", kv_cache_bytes=4 << 20,
                                        block_size=8))
        stack = engine.runner.model.layer_stack
        assert stack is not None and (stack.first, stack.count) == (1, 4)
        compiled = cpu_decode_layers._layers_of(stack.gemm, 0, 0).signatures  # head dim 32: the generic attention
        bits = np.int16 if dtype == "bfloat16" else np.float32
        assert any(sig[0].dtype == numba.from_dtype(bits) for sig in compiled)  # by the warm-up, before serving
        for i, layer in enumerate(engine.runner.model.layers[1:5]):  # views of the stack, not copies
            assert all(np.shares_memory(getattr(layer, name).weight.packed, stack.packed[j][i])
                       for j, name in enumerate(int8.PROJECTIONS))
        prompts = ["Queen present", "Sensor 7 reports humidity 62% and a weight gain", "Hive 3"]
        fused, layered, calls = decodes_through_the_run(engine, prompts, 9, monkeypatch)
        assert calls >= 8  # every decode step after the prompts'
        assert [o.output_token_ids for o in fused] == [o.output_token_ids for o in layered]
        assert [o.logprobs for o in fused] == [o.logprobs for o in layered]


def test_an_int8_engine_is_refused_before_calibrating_where_int8_would_crawl(
        tiny_qwen2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int8, "gemm_choice", lambda: int8.GemmChoice(None, (), "oneDNN -> float32 243.28 ms"))
    monkeypatch.setattr(int8, "calibrate", lambda *a, **k: pytest.fail("calibrated anyway"))
    with pytest.raises(EngineError, match="fast int8 GEMM"):
        LLMEngine(EngineConfig(model_path=tiny_qwen2, dtype="float32", weights="int8", kv_cache_bytes=4 << 20))


def test_bad_weights_settings_are_refused() -> None:
    with pytest.raises(EngineError, match="weights"):
        EngineConfig(model_path="x.gguf", weights="int4")


# The engine's real-model prompts (test_model.PROMPT and more of the cloud's traffic, chat and plain text),
# each followed by the fp32 engine's own 40 greedy tokens: teacher-forced, both engines see the same text.
GATE_TEXTS = [
    "<|im_start|>user\nHive 3 lost 2 kg overnight and the entrance is busy with fighting bees. What is happening?"
    "<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nAnswer as a JSON object.<|im_end|>\n<|im_start|>user\nBrood temperature 31.2 C at dawn, "
    "battery 3.4 V, humidity 88%. Assess.<|im_end|>\n<|im_start|>assistant\n",
    "Honey bees regulate the temperature of their brood nest between 34 and 36 degrees Celsius. In hot weather, workers",
    "The varroa mite is an external parasite that attacks and feeds on honey bees. Beekeepers monitor mite loads by",
    "def moving_average(values, window):\n    \"\"\"Return the moving average of a list.\"\"\"\n",
]


def gate_positions(reference: LLMEngine) -> list[tuple[list[int], torch.Tensor]]:
    """GATE_TEXTS + test_model.PROMPT, each followed by ``reference``'s own 40 greedy tokens, with the
    reference's top-1 token at every position (the ``gate_references`` fixture computes them once)."""
    from tests.cloud.engine.test_model import PROMPT

    out = []
    for text in [PROMPT, *GATE_TEXTS]:
        ids = reference.tokenizer.encode(text)
        ids += reference.generate([ids], SamplingParams(max_tokens=40, ignore_eos=True))[0].output_token_ids
        _, ref = prompt_logits(reference, ids, use_prefix_cache=False)
        out.append((ids, ref.argmax(-1)))
    return out


def teacher_forced_agreement(references: list[tuple[list[int], torch.Tensor]], engine: LLMEngine) -> tuple[float, int]:
    """Top-1 agreement of ``engine`` with the reference's picks (``gate_positions``) on the same texts; also the
    number of positions compared."""
    agree = total = 0
    for ids, ref_top1 in references:
        _, ours = prompt_logits(engine, ids, use_prefix_cache=False)
        agree += int((ours.argmax(-1) == ref_top1).sum())
        total += len(ids)
    return agree / total, total


INT8_FLOOR = 0.94  # measured 0.953-0.960 on these 428 positions (docs/engine.md "int8 weights"); bf16: 0.977
INT7_FLOOR = 0.90  # 7-bit weights (hosts without VNNI): measured 0.918 (alpha 0.6; 0.4-0.75 were lower)


@pytest.fixture(scope="module")
def int8_agreement(gate_references: list, gguf_path: Path) -> float:
    needs_fast_int8()
    engine = LLMEngine(EngineConfig(model_path=gguf_path, dtype="float32", weights="int8", kv_cache_bytes=64 << 20))
    grouped = int8.gemm_choice().backend == "grouped"
    layers = engine.runner.model.layers
    assert int8.dtype_layers(len(layers)) == {0, len(layers) - 1}  # SmolLM2's 30: the first and last stay float32
    assert all(isinstance(layer.gate_up, Linear if i in (0, len(layers) - 1) else
                          int8.GroupedInt8Linear if grouped else int8.Int8Linear) for i, layer in enumerate(layers))
    assert isinstance(engine.runner.model.head, int8.RefinedHead) == grouped  # the gate covers the int8 head too
    agreement, positions = teacher_forced_agreement(gate_references, engine)
    assert positions > 400
    return agreement


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_model_int8_tracks_float32(int8_agreement: float) -> None:
    """SmolLM2 with W8A8 projections (float32 elsewhere) picks the fp32 engine's next token on >= 94% of
    teacher-forced positions with per-token activations (>= 90% with oneDNN's 7-bit weights without VNNI):
    a regression floor under what that scheme measured. The grouped kernel must meet the 97% gate (below)."""
    choice = int8.gemm_choice()
    floor = 0.97 if choice.backend == "grouped" else INT8_FLOOR if choice.weight_qmax == 127 else INT7_FLOOR
    assert int8_agreement >= floor, int8_agreement


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_model_int8_meets_the_97_percent_gate(int8_agreement: float) -> None:
    """Issue 21's gate: >= 97% teacher-forced top-1 agreement with the fp32 engine. Met by the grouped kernel
    (scales per 64 inputs: 98.1% measured; 98.6% with the first and last layers in float32, the same with the LM
    head ranking in int8, ``RefinedHead``, and 97.2% with its int8 logits as they are; AVX-512 VNNI and AVX2
    kernels alike); per-token W8A8, where the grouped kernel does not run (no numba, or neither AVX2 nor VNNI),
    measured 95.3-96.0% (alpha 0.3-0.8, asymmetric activations, down or qkv kept at float activations: all < 97%)."""
    if int8.gemm_choice().backend != "grouped":
        pytest.xfail("per-token W8A8 (no grouped int8 kernel here) misses the 97% gate; docs/engine.md 'int8 weights'")
    assert int8_agreement >= 0.97, int8_agreement


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_model_int8_decode_runs_its_layers_in_one_call(gguf_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2's int8 engine in bf16 (what ``apiary cloud serve --weights int8`` runs where bf16 is native): layers
    1-28 stacked, and a batch's decode steps through the one call give the per-layer path's tokens and logprobs."""
    needs_fast_int8()
    if int8.gemm_choice().backend != "grouped":
        pytest.skip("the run takes grouped int8 weights; this host's int8 is per-token")
    engine = LLMEngine(EngineConfig(model_path=gguf_path, weights="int8", kv_cache_bytes=64 << 20))
    stack = engine.runner.model.layer_stack
    assert stack is not None and (stack.first, stack.count) == (1, 28)
    fused, layered, calls = decodes_through_the_run(engine, [GATE_TEXTS[0], GATE_TEXTS[2], "Queen present"], 24,
                                                    monkeypatch)
    assert calls >= 20
    assert [o.output_token_ids for o in fused] == [o.output_token_ids for o in layered]
    assert [o.logprobs for o in fused] == [o.logprobs for o in layered]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_model_int8_logits_are_the_same_through_the_avx2_kernel(gguf_path: Path) -> None:
    """SmolLM2's int8 engine, one prompt of the gate: every projection through the AVX2 kernel (what an AVX2-only
    host runs) gives the VNNI kernel's logits exactly, so that host gets the accuracy measured here."""
    from apiary.kernels import cpu_int8_gemm as gemm

    if set(gemm.runnable()) != {"avx512_vnni", "avx2"}:
        pytest.skip(f"needs a CPU that runs both int8 kernels (this one runs: {gemm.runnable()})")
    engine = LLMEngine(EngineConfig(model_path=gguf_path, dtype="float32", weights="int8", kv_cache_bytes=64 << 20))
    ids = engine.tokenizer.encode(GATE_TEXTS[1])
    _, vnni = prompt_logits(engine, ids, use_prefix_cache=False)
    kernels: list[str] = []

    def on_avx2(weight):  # type: ignore[no-untyped-def]
        bound = gemm.Bound(weight, "avx2")

        def call(x: torch.Tensor, gated: bool = False) -> torch.Tensor:
            kernels.append("avx2")
            return bound(x, gated)
        return call

    grouped = [lin for layer in engine.runner.model.layers for lin in (getattr(layer, name) for name in int8.PROJECTIONS)
               if isinstance(lin, int8.GroupedInt8Linear)]
    for lin in grouped:
        lin._linear = on_avx2(lin.weight)  # what the layer bound at load, now the AVX2 kernel
    _, through_avx2 = prompt_logits(engine, ids, use_prefix_cache=False)
    assert len(kernels) == len(grouped) == 28 * len(int8.PROJECTIONS)  # 30 layers, the first and last in float32
    assert torch.equal(through_avx2, vnni)
