"""W8A8 linear layers: int8 weights and activations, SmoothQuant scaling; scales per 64 inputs where AVX2 or VNNI is.

Two schemes, chosen once per process by ``gemm_choice``. Where numba compiles for AVX-512 VNNI or AVX2,
``GroupedInt8Linear``: weights and activations with one scale per 64 inputs, through our own kernel
(``apiary.kernels.cpu_int8_gemm``: ``vpdpbusd``, or ``vpmaddubsw`` on AVX2 with the same numbers,
activations quantized inside the call, one call per
projection, and the SwiGLU's ``silu(gate) * up`` folded into the down projection's quantization). It
measured 98.1% teacher-forced agreement with the fp32 engine (the gate is 97%) and, with numba on oneTBB's
pool (``threads.apply(numba_on_tbb=True)``), ~1.4x the bf16 engine's speed on a Zen 4 host (docs/engine.md
"int8 weights"). Elsewhere, ``Int8Linear``: weights per
output channel, activations per token, through oneDNN or ``torch._int_mm``, as described below.

Why: int8 halves the weight bytes of bf16 (a quarter of fp32) and int8 dot products (VNNI on
AVX-512 and AVX2 hosts, AMX tiles on Sapphire Rapids) compute 2x the bf16 rate, so a CPU without
native bf16 gets a path past its float32 floor, as llama.cpp's quantized dot products do.
``EngineConfig(weights="int8")`` selects it; it is not the default (see "Where it pays" below).

The GEMM is oneDNN's int8 linear through torch (``torch.ops.onednn.qlinear_pointwise`` on a weight
prepacked once by ``qlinear_prepack``: what inductor's x86 int8 lowering calls, so it is
maintained with torch), fed u8 activations (``q + 128`` with zero point 128: for signed int8 ones
oneDNN ran its reference kernel on a Zen 4 host, 243 ms where ``brg_matmul:avx512_core_vnni``
takes 0.08), with ``torch._int_mm`` (int8 x int8 -> int32) as the fallback. Which one runs is
decided once per process by ``gemm_choice``, a probe that times each against float32 and checks it
is exact: hosts differ from day to day, and without VNNI (the Zen 4 host with oneDNN held to AVX2,
``ONEDNN_MAX_CPU_ISA=AVX2``) both came out inexact with 8-bit weights (u8 x s8 pairs through
``vpmaddubsw`` saturate int16) and oneDNN's bf16 output took its reference kernel, so the probe
falls back to 7-bit weights there (exact; 91.8% teacher-forced agreement instead of 95.8%), and
where nothing passes int8 weights are refused with its findings instead of computing wrong numbers.
``Int8Linear`` itself reads ``per_token_choice``, the same probe without the grouped kernel: where that
kernel wins, ``gemm_choice`` never measures oneDNN's weight width, and a per-token layer built there
directly (not by the engine) would have taken 8-bit weights that AVX2's pair sums saturate.
Measured on the 2-core Sapphire Rapids dev machine (AVX-512 VNNI, AMX), one thread, this model's
four projections summed, GEMM alone (ms):
rows 1: oneDNN 0.38, ``_int_mm`` 0.65, fp32 0.62, bf16 prepacked 0.46; rows 64: 0.53, 0.64,
5.9, 0.76; rows 1,024: 10.7, 11.2, 70.7, 8.6. ``torch.ops.quantized.linear_dynamic``
(fbgemm) quantizes activations per tensor, not per token, and was slower (1.4 ms at one row
for a single projection). oneDNN applies the per-channel weight scales itself; its activation
scale must be one number, so activations go in with scale 1 and each output row is multiplied
by its token's scale afterwards (one elementwise op), bias after that.

Activations: per-token symmetric int8 (``absmax / 127``), computed at run time. SmoothQuant
moves activation outliers into the weights: input channel ``j`` is divided by
``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`` (alpha 0.6) and the weight's column multiplied by it, with the
activation maxima from a short calibration over fixed prompts at load (``calibrate``: ~230
tokens, seconds). The division costs nothing at run time: it is folded into the RMSNorm
weight before q/k/v and before gate/up, into the up projection's rows before down (its input is
``silu(gate) * up``), and into the v projection's rows before o (attention output is a convex
mix of v rows; channels sharing a KV head share one factor). The first and the last decoder layers
stay in the engine's dtype (``DTYPE_EDGE_LAYERS``, ``dtype_layers``): of the 30, those two cost the most
accuracy. The LM head (the tied embedding) ranks in int8 and computes in the engine's dtype only the
logits that can win (``RefinedHead``): int8 logits alone cost 1.4 points of agreement.

Activation quantization runs in one numba pass per call (``apiary.kernels.ops.quantize_rows``,
identical results to the five torch ops it replaced and ~2x faster: 41 vs 81 us at 64 x 576).

Where it pays: on a host with AMX bf16, the prepacked bf16 GEMM is already within ~1.4x of the
int8 one, and quantizing activations eats most of the difference. ``apiary bench engine`` (32
requests, 2 threads; docs/benchmarks.md): with the torch quantizer int8 served 128.6 output tok/s
against 161.6 in bf16 (0.80x) and, with float32 activations, 126.2 against 109.8 in float32
(1.15x); with the numba quantizer, on the then busier machine, 0.91-1.02x bf16 and 1.51-1.64x
float32 (the comparison for CPUs without native bf16). Accuracy: teacher-forced top-1 agreement
with the fp32 engine 95.3-96.0%, under the issue's 97% gate (bf16: 97.7%). So it is selectable,
not the default (docs/engine.md "int8 weights").
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from apiary.cloud.engine.errors import EngineError
from apiary.kernels import ops

if TYPE_CHECKING:
    from apiary.cloud.engine.model import LlamaModel
    from apiary.kernels.cpu_int8_gemm import GroupedWeight

DEFAULT_ALPHA = 0.6  # SmoothQuant migration strength; measured best of 0.3-0.8 here (docs/engine.md "int8 weights")
# Decoder layers at each end of the stack that keep the engine's dtype: the first and the last cost the most
# (SmolLM2, one layer at a time left in float: KL to fp32 0.00242 -> 0.00220 for the first, 0.00205 for the last,
# 0.0022-0.0024 for the other 28), and with both in dtype the cloud's answers on bench/edge.py's 255 labelled
# situations equal bf16's (two differed with every layer int8); no speed cost measured. Only where the model has
# more than 4x as many layers (tiny test models stay all int8).
DTYPE_EDGE_LAYERS = 1
MIN_SCALE = 1e-8  # floor for scales of all-zero rows/columns (they quantize to zeros)

# Calibration text: the cloud's traffic (chat-formatted sensor questions) and plain prose.
CALIBRATION_PROMPTS = (
    "<|im_start|>system\nYou are the cloud tier of a beehive sensor network. Answer with one JSON action."
    "<|im_end|>\n<|im_start|>user\nHive hive-0007 at site orchard: brood temperature 38.9 C (rising 1.2 C/h), "
    "humidity 71%, weight 41.3 kg (-0.9 kg in 24 h), acoustic 410 Hz, battery 3.61 V. Severity: warning."
    "<|im_end|>\n<|im_start|>assistant\n{\"assessment\": \"heat_stress\", \"action\": \"shade\"",
    "<|im_start|>user\nWhy do bees fan at the entrance in the evening, and is a sudden weight drop of "
    "two kilograms overnight a sign of swarming or of robbing?<|im_end|>\n<|im_start|>assistant\n",
    "The colony winters as a tight cluster. Worker bees shiver their flight muscles to keep the core "
    "near 35 degrees, rotating between the cold outside and the warm centre, while the queen stays "
    "in the middle. A hive scale shows the stores being eaten: 12 3.5 2024 kg, 61 percent.",
)


# ---------------------------------------------------------------- quantization


def quantize_weight(weight: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``(q [N, K] int8, scale [N] float32)``, ``weight ~= q * scale[:, None]``,
    ``|q| <= qmax`` (63: 7-bit weights, for int8 kernels without VNNI)."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=MIN_SCALE) / qmax
    q = torch.round(w / scale[:, None]).clamp(-qmax, qmax).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row (per-token) int8 of ``x [M, K]``: ``(q int8, scale [M, 1] float32)``
    (``apiary.kernels.ops.quantize_rows``: numba on CPU, the torch reference elsewhere)."""
    return ops.quantize_rows(x)


def smoothing(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float = DEFAULT_ALPHA) -> torch.Tensor:
    """SmoothQuant's per-input-channel divisor ``s [K]`` for activations with maxima ``act_absmax [K]`` and
    ``weight [N, K]``: ``s = a^alpha / w^(1 - alpha)``, 1 where a channel never fired or has no weight."""
    if not 0.0 <= alpha <= 1.0:
        raise EngineError(f"SmoothQuant alpha must be in [0, 1], got {alpha}")
    a = act_absmax.float()
    w = weight.float().abs().amax(dim=0)
    s = a.pow(alpha) / w.pow(1.0 - alpha)
    ok = (a > 0) & (w > 0) & torch.isfinite(s)
    return torch.where(ok, s, torch.ones_like(s)).clamp(min=1e-5, max=1e5)


# ---------------------------------------------------------------- the GEMM


# A probe GEMM big enough that a reference kernel shows (oneDNN's ``ref_int8`` took 243 ms for
# 64 x 256 x 512, its JIT kernel 0.08 ms) and small enough to cost milliseconds where the kernel is
# real; "fast" is within PROBE_SLOWDOWN of float32's F.linear on the same shape.
PROBE_SHAPE = (64, 256, 512)  # rows, in, out
PROBE_SLOWDOWN = 4.0  # measured: JIT int8 GEMMs 0.2-1.1x F.linear at this size; reference kernels > 100x
PROBE_ROUNDS = 5  # a candidate that looks slow is measured again beside float32, up to this many times
ACTIVATION_ZERO_POINT = 128  # oneDNN's fast x86 kernels take u8 activations: q + 128, a zero point it subtracts
WEIGHT_QMAX = (127, 63)  # tried in order: 8-bit weights, then 7-bit ones (u8 x s7 pairs fit int16)


@dataclass(frozen=True, slots=True)
class GemmChoice:
    """Which int8 GEMM this host runs fast, found once by probing: these machines differ from day to day.

    oneDNN picks its kernel per problem: for signed int8 activations it ran its reference kernel on an
    AVX-512 VNNI host (u8 activations there: ``brg_matmul:avx512_core_vnni``, 3,000x faster); held to
    AVX2 (no VNNI) its u8 x s8 products saturate int16 pair sums unless weights keep to 7 bits
    (fbgemm's ``reduce_range``), and only its reference kernel wrote bf16. ``backend`` is None where
    nothing exact beats a reference kernel.
    """

    backend: str | None  # "grouped" (apiary.kernels.cpu_int8_gemm), "onednn", "int_mm" or None
    onednn_out: tuple[torch.dtype, ...]  # oneDNN's output dtypes with a fast kernel
    reason: str  # what the probe measured, for the log and for tests that need a fast int8 GEMM
    weight_qmax: int = 127  # weights quantize to [-weight_qmax, weight_qmax]

    @property
    def weight_bits(self) -> int:
        return self.weight_qmax.bit_length() + 1  # 127: 8, 63: 7


def _best_ms(fn, repeats: int = 3) -> float:
    fn()  # the first call builds oneDNN's primitive
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def _keeps_up(fn, baseline, baseline_ms: float) -> tuple[bool, float]:  # type: ignore[no-untyped-def]
    """Whether ``fn`` runs within ``PROBE_SLOWDOWN`` of float32's ``baseline`` (which took ``baseline_ms``), and its
    best time.

    Why rounds: the verdict holds for the process's life, and a measurement taken while other processes held the CPU
    came out 100x slow (the test suite, once: every int8 kernel ~12 ms against float32's 0.12 ms, and the engine
    refused int8 weights). A candidate that looks slow is measured again right after the baseline, up to
    ``PROBE_ROUNDS`` times, and the best ratio of such pairs decides; a reference kernel stays > 100x in every round."""
    ms = _best_ms(fn)
    ratio = ms / baseline_ms
    for _ in range(PROBE_ROUNDS):
        if ratio <= PROBE_SLOWDOWN:
            break
        base, again = _best_ms(baseline), _best_ms(fn)
        ratio, ms = min(ratio, again / base), min(ms, again)
    return ratio <= PROBE_SLOWDOWN, ms


@functools.cache
def gemm_choice() -> GemmChoice:
    """The engine's int8 GEMM: the grouped kernel where it is exact and fast next to float32, else what
    ``per_token_choice`` finds."""
    g, x, xf, wf, float_ms, seen = _probe_inputs()
    if ops.grouped_int8_available():
        if _grouped_is_fast(xf, wf, float_ms, seen):
            return GemmChoice("grouped", (), "; ".join(seen))
    else:
        seen.append("no grouped int8 kernel here (it needs numba and AVX2 or AVX-512 VNNI)")
    return _probe_per_token(g, x, xf, wf, float_ms, seen)


@functools.cache
def per_token_choice() -> GemmChoice:
    """The GEMM and weight width of the per-token path (``Int8Linear``), probed on its own: where the grouped
    kernel runs, ``gemm_choice`` never looks at oneDNN, whose u8 x s8 pair sums need 7-bit weights without VNNI."""
    g, x, xf, wf, float_ms, seen = _probe_inputs()
    return _probe_per_token(g, x, xf, wf, float_ms, seen)


def _probe_inputs() -> tuple[torch.Generator, torch.Tensor, torch.Tensor, torch.Tensor, float, list[str]]:
    """The probe's int8 activations (and as float32), a float32 weight, and float32 ``F.linear``'s time."""
    rows, k, n = PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-127, 128, (rows, k), generator=g, dtype=torch.int8)
    xf, wf = x.float(), torch.randn(n, k, generator=g)
    float_ms = _best_ms(lambda: F.linear(xf, wf))
    return g, x, xf, wf, float_ms, [f"float32 F.linear {float_ms:.2f} ms at {rows}x{k}x{n}"]


def _probe_per_token(g: torch.Generator, x: torch.Tensor, xf: torch.Tensor, wf: torch.Tensor, float_ms: float,
                     seen: list[str]) -> GemmChoice:
    """oneDNN's int8 linear (per output dtype), then ``torch._int_mm``, with 8-bit weights and then 7-bit ones:
    the first exact one that keeps up with float32."""
    rows, k, n = PROBE_SHAPE
    has_onednn = (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")
                  and hasattr(torch.ops.onednn, "qlinear_pointwise"))
    if not has_onednn:
        seen.append("no oneDNN int8 linear in this torch")

    for qmax in WEIGHT_QMAX:
        w = torch.randint(-qmax, qmax + 1, (n, k), generator=g, dtype=torch.int8)
        exact = xf @ w.float().t()  # integers below 2^24: exact in float32
        bits = f"{qmax.bit_length() + 1}-bit weights"

        def fast(name: str, fn) -> bool:
            try:
                got = fn()
                # exact in float32; bf16 output rounds the products to its 8-bit mantissa
                ok = torch.equal(got, exact) if got.dtype == torch.float32 else torch.allclose(got.float(), exact, rtol=1e-2)
                if not ok:  # e.g. int16 saturation in a kernel without VNNI
                    seen.append(f"{name}, {bits}: inexact")
                    return False
                keeps_up, ms = _keeps_up(fn, lambda: F.linear(xf, wf), float_ms)
            except RuntimeError as e:  # a build or CPU the op refuses
                seen.append(f"{name}, {bits}: failed ({str(e).splitlines()[0][:80]})")
                return False
            seen.append(f"{name}, {bits}: {ms:.2f} ms")
            return keeps_up

        onednn_out: list[torch.dtype] = []
        if has_onednn:
            try:
                packed, ones, xu = _prepack(w), torch.ones(n), _as_u8(x.clone())
            except RuntimeError as e:
                seen.append(f"oneDNN prepack failed ({str(e).splitlines()[0][:80]})")
            else:
                for dtype in (torch.float32, torch.bfloat16):
                    if fast(f"oneDNN -> {str(dtype).removeprefix('torch.')}",
                            lambda d=dtype: _onednn_linear(xu, packed, ones, d)):
                        onednn_out.append(dtype)
        if torch.float32 in onednn_out:
            return GemmChoice("onednn", tuple(onednn_out), "; ".join(seen), qmax)
        if fast("torch._int_mm", lambda: torch._int_mm(x, w.t()).float()):
            return GemmChoice("int_mm", (), "; ".join(seen), qmax)
    return GemmChoice(None, (), "; ".join(seen))


def _grouped_is_fast(x: torch.Tensor, w: torch.Tensor, float_ms: float, seen: list[str]) -> bool:
    """The grouped kernel on the probe's product: its float64 reference's result, and fast next to float32."""
    try:
        packed = ops.pack_grouped_int8(w)
        got = ops.grouped_int8_linear(x, packed)
        exact = torch.allclose(got.double(), ops.grouped_int8_reference(x, packed), rtol=1e-5, atol=1e-3)
        keeps_up, ms = (_keeps_up(lambda: ops.grouped_int8_linear(x, packed), lambda: F.linear(x, w), float_ms)
                        if exact else (False, float("inf")))
    except Exception as e:  # noqa: BLE001 - a kernel that fails to compile or run here is simply not chosen
        seen.append(f"grouped int8 kernel failed ({str(e).splitlines()[0][:80]})")
        return False
    kernel = f"grouped int8 kernel ({ops.grouped_int8_kernel()})"
    seen.append(f"{kernel}: {ms:.2f} ms" if exact else f"{kernel}: inexact")
    return keeps_up


def require_fast_gemm(choice: GemmChoice | None = None) -> str:
    """The probed backend (of ``gemm_choice``, or of ``choice``), or a clear refusal where int8 would run at
    reference-kernel speed."""
    choice = gemm_choice() if choice is None else choice
    if choice.backend is None:
        raise EngineError("int8 weights need a fast int8 GEMM and this CPU has none (no exact oneDNN or torch._int_mm "
                          f"kernel here keeps up with float32: {choice.reason}); use weights='dtype'")
    return choice.backend


def _prepack(qweight: torch.Tensor) -> torch.Tensor:
    return torch.ops.onednn.qlinear_prepack(qweight, None)


def _as_u8(q: torch.Tensor) -> torch.Tensor:
    """int8 ``q`` as u8 ``q + 128``, in place (flipping the sign bit is adding 128 modulo 256)."""
    u = q.view(torch.uint8)
    return u.bitwise_xor_(ACTIVATION_ZERO_POINT)


def _onednn_linear(qu: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """oneDNN's int8 linear: u8 ``qu`` at scale 1 and zero point 128, the prepacked weight with per-channel
    ``scale``, no bias."""
    return torch.ops.onednn.qlinear_pointwise.tensor(
        qu, _ONE, _ZP, packed, scale, _zero_points(scale.shape[0]), None, 1.0, 0, out_dtype, "none", [], "")


@dataclass(slots=True)
class Int8Linear:
    """``y = (q(x) @ qweight.T) * x_scale * scale + bias`` with per-token ``q(x)``: a drop-in for ``linear.Linear``."""

    qweight: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N] float32, per output channel
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None  # oneDNN's prepacked weight; None: torch._int_mm

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        if weight.device.type != "cpu":
            raise EngineError("int8 weights are a CPU path (oneDNN / torch._int_mm); use dtype bfloat16 on CUDA")
        choice = per_token_choice()
        backend = require_fast_gemm(choice)
        q, scale = quantize_weight(weight, choice.weight_qmax)
        return cls(q, scale, bias, _prepack(q) if backend == "onednn" else None)

    @property
    def backend(self) -> str:
        return "onednn" if self.packed is not None else "int_mm"

    def _gemm(self, q: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``q @ qweight.T`` times the weight scales, in ``out_dtype`` (oneDNN's path overwrites ``q``)."""
        if self.packed is not None:
            # where oneDNN writes bf16 only with its reference kernel (AVX2 without VNNI), go through float32
            direct = out_dtype == torch.float32 or out_dtype in per_token_choice().onednn_out
            y = _onednn_linear(_as_u8(q), self.packed, self.scale, out_dtype if direct else torch.float32)
            return y if direct else y.to(out_dtype)
        return torch._int_mm(q, self.qweight.t()).to(out_dtype).mul_(self.scale.to(out_dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        if x.shape[0] == 0:
            return x.new_empty((0, self.qweight.shape[0]))
        q, row_scale = quantize_rows(x)
        y = self._gemm(q, x.dtype).mul_(row_scale.to(x.dtype))
        return y if self.bias is None else y.add_(self.bias)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer computes with (tests, error analysis)."""
        return self.qweight.float() * self.scale[:, None]

    def tensors(self) -> list[torch.Tensor]:
        return [self.qweight, self.scale] + ([] if self.bias is None else [self.bias])


@dataclass(slots=True)
class GroupedInt8Linear:
    """``y = x @ W.T + bias`` with int8 weights and activations, each with one scale per 64 inputs
    (``apiary.kernels.cpu_int8_gemm``: AVX-512 VNNI or AVX2, activations quantized inside the call).

    Why groups: per-token activation scales cost accuracy (95.3-96.0% teacher-forced agreement with the
    fp32 engine); one scale per 64 inputs on both sides measured 98.4% (docs/engine.md "int8 weights").
    """

    weight: GroupedWeight
    bias: torch.Tensor | None = None
    backend = "grouped"
    _linear: Callable[..., torch.Tensor] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._linear = ops.bind_grouped_int8(self.weight)  # the kernel chosen once, not per call

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> GroupedInt8Linear:
        if weight.device.type != "cpu":
            raise EngineError("int8 weights are a CPU path; use dtype bfloat16 on CUDA")
        return cls(ops.pack_grouped_int8(weight), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        y = self._linear(x)
        return y if self.bias is None else y.add_(self.bias)

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``self(silu(gate) * up)`` for ``gate_up = [gate | up]`` (a SwiGLU's two projections side by side), the
        elementwise part done in the kernel's quantization pass: two torch ops and a tensor fewer per layer."""
        y = self._linear(gate_up, True)
        return y if self.bias is None else y.add_(self.bias)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer computes with (tests, error analysis)."""
        return self.weight.dequantized()

    def tensors(self) -> list[torch.Tensor]:
        return self.weight.tensors() + ([] if self.bias is None else [self.bias])


@dataclass(slots=True)
class RefinedHead:
    """The LM head as int8 for ranking, exact where a logit can win: ``approx`` (the head's weight through the
    grouped int8 kernel, float32 activations) gives every logit, then ``ops.refine_logits`` computes each row's
    top candidates again from ``weight`` in float32, and with a grammar the top of the tokens it allows.

    Why: the head is the largest matmul of a decode step. For SmolLM2 (49,152 x 576) at 14 rows, oneDNN's
    bf16 GEMM took 3.2-3.7 ms against 1.2-1.5 ms for the int8 kernel plus ~0.3 ms for the refinement. The int8
    logits alone moved the teacher-forced agreement with float32 from 98.6% to 97.2% (docs/engine.md); every
    token that can be chosen or reported now has an exact logit."""

    approx: GroupedInt8Linear
    weight: torch.Tensor  # [V, H] in the engine's dtype (the tied embedding, usually)

    @classmethod
    def of(cls, weight: torch.Tensor) -> RefinedHead:
        return cls(GroupedInt8Linear.of(weight), weight)  # quantized in slabs: no float32 copy of the whole head

    def __call__(self, hidden: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[rows, V]`` (float32) of ``hidden [rows, H]``; ``allowed``: the grammar's packed bitmask
        ``[rows, W]`` (int32), or None."""
        logits = self.approx(hidden.float())
        return ops.refine_logits(hidden, self.weight, logits, allowed)

    def tensors(self) -> list[torch.Tensor]:
        """What the head adds to the model (its weight is the embedding's, counted there)."""
        return self.approx.tensors()


def quantize_head(model: LlamaModel) -> bool:
    """Give ``model`` a ``RefinedHead`` where this host's probed int8 GEMM is the grouped kernel (on CPU; the
    probe passes over a grouped kernel that is inexact or slow here); True if it did."""
    if model.device.type != "cpu" or gemm_choice().backend != "grouped":
        return False
    model.head = RefinedHead.of(model.lm_head)
    return True


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear | GroupedInt8Linear:
    """The int8 layer for ``weight`` on this host's probed GEMM (``gemm_choice``)."""
    if require_fast_gemm() == "grouped":
        return GroupedInt8Linear.of(weight, bias)
    return Int8Linear.of(weight, bias)


_ONE, _ZP = torch.tensor(1.0), torch.tensor(ACTIVATION_ZERO_POINT, dtype=torch.long)


@functools.cache
def _zero_points(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.long)


# ---------------------------------------------------------------- calibration and conversion


@dataclass(slots=True)
class _Observer:
    """Stands in for a linear during calibration: records each input channel's largest |activation|."""

    inner: object
    absmax: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.detach().abs().amax(dim=0).float()
        self.absmax = m if self.absmax is None else torch.maximum(self.absmax, m)
        return self.inner(x)  # type: ignore[operator]


PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")


@torch.inference_mode()
def calibrate(model: LlamaModel, prompts: Iterable[list[int]], block_size: int = 16) -> list[dict[str, torch.Tensor]]:
    """Per layer, per projection: the largest |input| of each input channel over ``prompts`` (token ids),
    run through ``model`` in its current (floating-point) weights on a scratch KV cache."""
    from apiary.cloud.engine.kv_cache import KVPool
    from apiary.cloud.engine.model import paged_layout

    c = model.config
    observers = [{name: _Observer(getattr(layer, name)) for name in PROJECTIONS} for layer in model.layers]
    for layer, obs in zip(model.layers, observers):
        for name, o in obs.items():
            setattr(layer, name, o)
    try:
        for ids in prompts:
            if len(ids) < 2:
                raise EngineError("calibration prompts need at least 2 tokens")
            blocks = -(-len(ids) // block_size)
            pool = KVPool(c.num_layers, blocks, block_size, c.num_kv_heads, c.head_dim, model.dtype, model.device)
            positions, meta, _ = paged_layout(np.array([0]), np.array([len(ids)]), [list(range(blocks))],
                                              block_size, 0, model.device)
            model.forward(torch.tensor(ids, device=model.device), positions, meta, pool.layers)
    finally:
        for layer, obs in zip(model.layers, observers):
            for name, o in obs.items():
                setattr(layer, name, o.inner)
    stats = []
    for obs in observers:
        if any(o.absmax is None for o in obs.values()):
            raise EngineError("calibration saw no tokens")
        stats.append({name: o.absmax for name, o in obs.items()})  # type: ignore[misc]
    return stats


def dtype_layers(num_layers: int, edge: int = DTYPE_EDGE_LAYERS) -> set[int]:
    """The decoder layers ``quantize_model`` leaves in the engine's dtype: ``edge`` at each end of the stack,
    where the model has more than ``4 * edge`` layers."""
    if edge <= 0 or num_layers <= 4 * edge:
        return set()
    return set(range(edge)) | set(range(num_layers - edge, num_layers))


@torch.inference_mode()
def quantize_model(model: LlamaModel, stats: list[dict[str, torch.Tensor]] | None, alpha: float = DEFAULT_ALPHA,
                   keep: set[int] | None = None) -> None:
    """Replace the decoder layers' projections by int8 ones (``int8_linear``), in place, all but the layers in
    ``keep`` (default: ``dtype_layers``), which stay as they are.

    With ``stats`` (from ``calibrate``), SmoothQuant factors are folded into the preceding weights
    (RMSNorm weights, the up rows, the v rows); without, weights are quantized as they are.
    """
    from apiary.cloud.engine.linear import Linear

    c = model.config
    group = c.num_heads // c.num_kv_heads
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    keep = dtype_layers(len(model.layers)) if keep is None else keep
    for i, layer in enumerate(model.layers):
        lins = {name: getattr(layer, name) for name in PROJECTIONS}
        if not all(isinstance(lin, Linear) for lin in lins.values()):
            raise EngineError(f"layer {i} is already quantized")
        if i in keep:
            continue
        w = {name: lin.weight.float().clone() for name, lin in lins.items()}
        b = {name: None if lin.bias is None else lin.bias.float().clone() for name, lin in lins.items()}
        if stats is not None:
            st = stats[i]
            # down's input is silu(gate) * up: dividing channel j of up divides down's input channel j.
            s = smoothing(st["down"], w["down"], alpha)
            w["down"] *= s[None, :]
            w["gate_up"][c.intermediate_size:] /= s[:, None]
            # o's input is the attention output, per query head a mix of its KV head's v rows: one factor
            # per (KV head, dim), from the maxima over the query heads sharing it.
            a = st["o_proj"].view(c.num_kv_heads, group, c.head_dim).amax(dim=1)
            wo = w["o_proj"].view(-1, c.num_kv_heads, group, c.head_dim).abs().amax(dim=(0, 2))
            s_kv = smoothing(a.flatten(), wo.flatten()[None, :], alpha).view(c.num_kv_heads, c.head_dim)
            w["o_proj"] *= s_kv[:, None, :].expand(c.num_kv_heads, group, c.head_dim).reshape(1, -1)
            w["qkv"][q_rows + kv_rows:] /= s_kv.reshape(-1, 1)
            if b["qkv"] is not None:
                b["qkv"][q_rows + kv_rows:] /= s_kv.reshape(-1)
            # qkv and gate/up read RMSNorm outputs: fold the divisor into the norm weights.
            for name, norm in (("qkv", "input_norm"), ("gate_up", "post_norm")):
                s = smoothing(st[name], w[name], alpha)
                w[name] *= s[None, :]
                setattr(layer, norm, (getattr(layer, norm).float() / s).to(model.dtype))
        for name, lin in lins.items():
            setattr(layer, name, int8_linear(w[name], None if b[name] is None else b[name].to(model.dtype)))
