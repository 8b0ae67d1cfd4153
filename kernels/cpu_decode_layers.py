"""A run of decoder layers at decode, as one compiled call: what ``CpuStep``'s per-layer calls compute.

Why: a decode step of SmolLM2 makes ~10 kernel calls per layer (two RMSNorms, four projections, rotary with
the KV write, attention), ~280 a step, and each paid Python around it: numpy views, the GEMM's checks,
numba's dispatch of five to eleven arguments, ``torch.from_numpy``, the query's widening and the output's
rounding as torch ops. A 14-row int8 projection's call measured 43.5 us against 35.7 us for its kernel
alone, an RMSNorm of 14 rows 15 us for ~3 us of work. Here a run of layers is one call of a numba function
that calls the same compiled kernels in the same order on buffers it allocates once, so its results are
the per-layer path's bit for bit (``tests/kernels/test_cpu_decode_layers.py``) and only the glue goes.

Three kinds of run, one per GEMM: grouped int8 weights (``apiary.kernels.cpu_int8_gemm``, an int8 engine's
middle layers), bf16 weights through the ``vdpbf16ps`` kernel (``apiary.kernels.cpu_bf16_gemm``, the
bf16 engine's every layer), and float32 rows through bf16-held weights (``apiary.kernels.cpu_bf16w_gemm``, every
layer of a float32 engine with ``weights`` ``bf16``, the default where the CPU has no native bf16). What a run needs (``stackable``; the engine takes the per-layer path
otherwise): one kind for the four projections of every layer, output widths that are whole 16-output
tiles and (bf16) input widths that are whole 32-input chunks, so nothing is padded between one kernel's
output and the next one's input; int8 projections without biases (the int8 kernel adds none; the bf16 one
adds its own); and a KV pool whose layers are one array: float rows, or int8 ones with their scales' pool
(each new row quantized as ``cpu_quant.write_kv_int8`` does it, then attended over with its scale). Decode rows
only: prompt chunks take milliseconds a layer, where the glue does not show, and their attention kernels are chosen
by run length.

The weights are stacked once (``[layers, ...]`` per projection) and each layer's weight becomes a view of
its slice (``LayerStack.views``), so the model holds them once. The function is compiled per GEMM kernel and
attention kernel (``_layers_of``) and cached on disk under a name that carries a digest of the kernels' sources:
numba checks a cached function against its own source file only, and a copy found by its name alone would go on
calling the kernels it was compiled with after they change.
"""
from __future__ import annotations

import functools
import hashlib
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from numba import njit, types as nb_types
from numba.extending import overload

from apiary.kernels import cpu_attention, cpu_bf16_gemm, cpu_bf16w_gemm, cpu_int8_gemm, cpu_quant, huge_pages
from apiary.kernels.cpu_attention import _as_f32
from apiary.kernels.cpu_bf16_gemm import CHUNK, PackedBF16
from apiary.kernels.cpu_bf16w_gemm import HeldBF16
from apiary.kernels.cpu_int8_gemm import TILE, GroupedWeight
from apiary.kernels.cpu_layers import (PARALLEL_ROWS, _np, _rms_norm, _rms_norm_rows, _rotary_write_kv,
                                       _rotary_write_kv_rows, _store)
from apiary.kernels.cpu_quant import _write_kv_int8, _write_row_int8
from apiary.kernels.errors import KernelError

PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")  # a layer's projections, in the order they run
BF16 = "bf16"  # ``LayerStack.gemm`` of a run through the bf16 kernel (an int8 run names its grouped kernel)
BF16W = "bf16w"  # ... of a run of float32 rows through bf16-held weights (``cpu_bf16w_gemm``)
StackWeight = GroupedWeight | PackedBF16 | HeldBF16
PACKED = {BF16: PackedBF16, BF16W: HeldBF16}  # the weight kind of each bf16-layout run


@dataclass(frozen=True, slots=True)
class LayerStack:
    """Decoder layers ``first .. first + count - 1``, stacked: per projection (``PROJECTIONS``' order) the packed
    weights with a leading ``[count]`` axis and, beside them, ``extras``: the int8 weights' scales ``[count, N / 16,
    Kp / 64, 16]`` float32, or the bf16 weights' biases ``[count, Np]`` float32 (zeros for none); each one's
    ``in_features``; RMSNorm weights ``[count, hidden]`` (bf16 as its int16 bits). ``gemm``: ``BF16``, or the grouped
    int8 GEMM's kernel the run calls (one of ``cpu_int8_gemm.runnable()``)."""

    first: int
    count: int
    gemm: str
    input_norms: np.ndarray
    post_norms: np.ndarray
    packed: tuple[np.ndarray, ...]
    extras: tuple[np.ndarray, ...]
    in_features: tuple[int, ...]

    def views(self) -> list[dict[str, StackWeight]]:
        """Each layer's projections as views of the stack (``GroupedWeight``, ``PackedBF16`` or ``HeldBF16``, as stacked), for
        the layers to hold instead of their own copies."""
        kind = PACKED.get(self.gemm, GroupedWeight)  # each: (packed, extra, out_features, in_features)
        return [{name: kind(packed[i], extra[i], packed.shape[1] * TILE, k)
                 for name, packed, extra, k in zip(PROJECTIONS, self.packed, self.extras, self.in_features)}
                for i in range(self.count)]


def stackable(weights: dict[str, object], biases: dict[str, object]) -> str | None:
    """Why one layer's projections (``PROJECTIONS`` -> weight, -> bias) cannot join a stack, or None. Weights are
    ``GroupedWeight`` (int8, no bias), ``PackedBF16`` (bf16, its bias packed with it) or ``HeldBF16`` (bf16-held for
    float32 rows, its float32 bias packed with it), all of one kind."""
    kinds = {type(weights.get(name)) for name in PROJECTIONS}
    bf16 = len(kinds) == 1 and kinds <= {PackedBF16, HeldBF16}  # bf16 rows, or float32 rows with bf16-held weights
    for name in PROJECTIONS:
        weight = weights.get(name)
        if not isinstance(weight, (next(iter(kinds)) if bf16 else GroupedWeight)):
            return ("the projections are not all grouped int8, all bf16-kernel or all bf16-held weights"
                    if kinds & {PackedBF16, HeldBF16} else f"{name} is not a grouped int8 weight")
        if not bf16 and biases.get(name) is not None:
            return f"{name} has a bias"
        if weight.out_features % TILE:
            return f"{name} has {weight.out_features} outputs, not whole tiles of {TILE}"
        if bf16 and weight.in_features % CHUNK:
            return f"{name} has {weight.in_features} inputs, not whole chunks of {CHUNK}"
    return None


def stack(first: int, layers: list[dict[str, StackWeight]], input_norms: list[torch.Tensor],
          post_norms: list[torch.Tensor], kernel: str | None = None) -> LayerStack:
    """Stack consecutive layers (from layer ``first``): their projections (``PROJECTIONS`` -> weight, each layer
    ``stackable``, all of one kind) and norms. ``kernel``: for int8 weights, one of ``cpu_int8_gemm.runnable()``
    (default: the best)."""
    if not layers or len(input_norms) != len(layers) or len(post_norms) != len(layers):
        raise KernelError("cpu_decode_layers.stack takes one or more layers, each with its two norms")
    for i, layer in enumerate(layers):
        why = stackable(layer, {})
        if why is not None:
            raise KernelError(f"cpu_decode_layers.stack: layer {first + i}: {why}")
    kind = type(layers[0]["qkv"])
    if any(type(layer["qkv"]) is not kind for layer in layers):
        raise KernelError("cpu_decode_layers.stack: the layers are not all of one kind (int8, bf16 or bf16-held)")
    held = kind is HeldBF16
    bf16 = kind is PackedBF16
    if bf16 and not cpu_bf16_gemm.available():
        raise KernelError(f"cpu_decode_layers.stack: this CPU lacks {', '.join(cpu_bf16_gemm.FEATURES)} for bf16 weights")
    if held and not cpu_bf16w_gemm.available():
        raise KernelError(f"cpu_decode_layers.stack: this CPU lacks {', '.join(cpu_bf16w_gemm.FEATURES)} for bf16-held "
                          "weights")
    gemm = BF16W if held else BF16 if bf16 else cpu_int8_gemm.compiled_kernel(kernel)[0]
    packed, extras, in_features = [], [], []
    for name in PROJECTIONS:
        weights = [layer[name] for layer in layers]
        extra = [w.bias if isinstance(w, PackedBF16) else w.scales for w in weights]  # (HeldBF16 is a PackedBF16)
        shapes = {(w.packed.shape, e.shape, w.in_features) for w, e in zip(weights, extra)}
        if len(shapes) != 1:
            raise KernelError(f"cpu_decode_layers.stack: the layers' {name} weights differ: {sorted(shapes)}")
        packed.append(huge_pages.stacked([w.packed for w in weights]))
        extras.append(np.stack(extra))
        in_features.append(weights[0].in_features)
    hidden = in_features[0]
    norms = []
    for group in (input_norms, post_norms):
        if any(n.dtype not in (torch.float32, torch.bfloat16) or tuple(n.shape) != (hidden,) for n in group):
            raise KernelError(f"cpu_decode_layers.stack: norms must be float32 or bfloat16 vectors of {hidden}")
        norms.append(_np(torch.stack([n.to(group[0].dtype) for n in group]).contiguous()))
    return LayerStack(first, len(layers), gemm, norms[0], norms[1], tuple(packed), tuple(extras), tuple(in_features))


@njit(inline="always")
def _norm(wide, x, residual, has_residual, weight, eps, out, summed):  # type: ignore[no-untyped-def]
    """``_rms_norm``, or its row-parallel twin for ``wide`` steps (as ``CpuStep.rms_norm`` chooses)."""
    if wide:
        _rms_norm_rows(x, residual, has_residual, weight, eps, out, summed)
    else:
        _rms_norm(x, residual, has_residual, weight, eps, out, summed)


def _write_new_rows(wide, qkv, num_heads, num_kv_heads, positions, cos_sin, q, k_rows, v_rows, k_scales, v_scales,
                    slots, keys, values, rows):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled by the overload
    raise NotImplementedError


@overload(_write_new_rows)
def _write_new_rows_impl(wide, qkv, num_heads, num_kv_heads, positions, cos_sin, q, k_rows, v_rows, k_scales, v_scales,
                         slots, keys, values, rows):  # type: ignore[no-untyped-def]
    """The rotated queries into ``q``, the step's rotated keys and its values into the cache rows ``[S, Hkv, D]`` at
    ``slots``, as ``CpuStep.rotary_write_kv`` writes them: float rows straight in; int8 rows (chosen by the cache's
    type, so each run compiles one branch) first into ``keys``/``values`` at ``rows`` (0..T-1), then quantized per
    token and KV head with their scales (``k_scales``/``v_scales`` ``[S, Hkv]``) as ``cpu_quant.write_kv_int8`` does,
    one row at a time (a parallel loop for a wide step's rows)."""
    if isinstance(k_rows, nb_types.Array) and k_rows.dtype == nb_types.int8:
        def quantized(wide, qkv, num_heads, num_kv_heads, positions, cos_sin, q, k_rows, v_rows, k_scales, v_scales,
                      slots, keys, values, rows):  # type: ignore[no-untyped-def]
            least = np.float32(cpu_quant.MIN_ABSMAX)
            if wide:
                _rotary_write_kv_rows(qkv, num_heads, num_kv_heads, positions, cos_sin, q, keys, values, rows)
                _write_kv_int8(keys, values, k_rows, v_rows, k_scales, v_scales, slots, least)
                return
            _rotary_write_kv(qkv, num_heads, num_kv_heads, positions, cos_sin, q, keys, values, rows)
            for t in range(slots.shape[0]):
                _write_row_int8(keys, values, k_rows, v_rows, k_scales, v_scales, slots, t, least)
        return quantized

    def floats(wide, qkv, num_heads, num_kv_heads, positions, cos_sin, q, k_rows, v_rows, k_scales, v_scales, slots,
               keys, values, rows):  # type: ignore[no-untyped-def]
        if wide:
            _rotary_write_kv_rows(qkv, num_heads, num_kv_heads, positions, cos_sin, q, k_rows, v_rows, slots)
        else:
            _rotary_write_kv(qkv, num_heads, num_kv_heads, positions, cos_sin, q, k_rows, v_rows, slots)
    return floats


def _kernel_sources_digest() -> str:
    """A digest of every CPU kernel's source, for the compiled run's name: numba checks a cached function against
    its own file only, and the run has the kernels of five other files compiled into it."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("cpu_*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


_SOURCES = _kernel_sources_digest()
_gemm = _attend = None  # the run's GEMM and attention kernels: set in each compiled copy's globals by ``_layers_of``


def _layers(x, residual, has_residual, pool, scales, quantized, first, input_norms, post_norms, qkv_w, qkv_e, o_w, o_e,
            gu_w, gu_e, down_w, down_e, num_heads, positions, cos_sin, slots, tables, lens, scale, window, eps, yes,
            no):  # type: ignore[no-untyped-def]
    """``(x, residual)`` after the stack's layers, from the hidden rows ``x [T, H]`` and the residual stream
    (``has_residual`` False: none yet, as before a model's first layer). Each layer is ``LlamaModel.forward``'s
    CPU path: norm, qkv, rotary and the KV write into ``pool[first + l]``, decode attention, o_proj, norm,
    gate/up, down. ``scales``: an int8 pool's ``[layers, 2, blocks, block_size, Hkv]`` (``quantized`` True), else
    ``[layers, 2, 1, 1, 1]`` ones that nothing reads. ``yes``/``no``: True and False as run-time values, for the
    kernels' flags (``quantized`` is one of them): a constant is typed as a literal and compiles the kernels again,
    specialised, where the per-layer path calls the ones compiled for run-time flags, and LLVM may vectorise the two
    apart (seen once: a float32 run an ulp off)."""
    t = x.shape[0]
    num_kv_heads, head_dim = pool.shape[4], pool.shape[5]
    normed = np.empty_like(x)
    sum_a, sum_b = np.empty_like(x), np.empty_like(x)  # the residual stream, taking turns
    qkv = np.empty((t, qkv_w.shape[1] * TILE), x.dtype)
    q = np.empty((t, num_heads, head_dim), x.dtype)
    q32 = np.empty((t, num_heads, head_dim), np.float32)
    attn32 = np.empty((t, num_heads, head_dim), np.float32)
    attn = np.empty((t, num_heads * head_dim), x.dtype)
    o = np.empty((t, o_w.shape[1] * TILE), x.dtype)
    gate_up = np.empty((t, gu_w.shape[1] * TILE), x.dtype)
    out = np.empty((t, down_w.shape[1] * TILE), x.dtype)
    keys = np.empty((t, num_kv_heads, head_dim), x.dtype)  # int8 caches: the new rows before they are quantized
    values = np.empty((t, num_kv_heads, head_dim), x.dtype)
    rows = np.arange(t)
    hidden, res = x, residual
    turn = 0
    wide = t >= PARALLEL_ROWS  # the row-parallel norm and rotary, as ``CpuStep`` takes them
    for layer in range(input_norms.shape[0]):
        k_cache, v_cache = pool[first + layer, 0], pool[first + layer, 1]
        k_scale, v_scale = scales[first + layer, 0], scales[first + layer, 1]
        # the sum goes to the buffer the residual is not in (``CpuStep.rms_norm``: aliasing changes rounding)
        target = sum_a if turn == 0 else sum_b
        if has_residual or layer > 0:
            _norm(wide, hidden, res, yes, input_norms[layer], eps, normed, target)
            res, turn = target, 1 - turn
        else:  # no residual stream yet: it starts as the rows themselves
            _norm(wide, hidden, hidden, no, input_norms[layer], eps, normed, normed)
            res = hidden
        _gemm(normed, qkv_w[layer], qkv_e[layer], qkv, no)
        k_rows, v_rows = (k_cache.reshape((-1, num_kv_heads, head_dim)),
                          v_cache.reshape((-1, num_kv_heads, head_dim)))
        _write_new_rows(wide, qkv, num_heads, num_kv_heads, positions, cos_sin, q, k_rows, v_rows,
                        k_scale.reshape((-1, k_scale.shape[2])), v_scale.reshape((-1, v_scale.shape[2])), slots, keys,
                        values, rows)
        for i in range(t):
            for h in range(num_heads):
                for d in range(head_dim):
                    q32[i, h, d] = _as_f32(q[i, h, d])
        _attend(q32, k_cache, v_cache, k_scale, v_scale, quantized, tables, lens, scale, window, attn32)
        for i in range(t):
            for h in range(num_heads):
                for d in range(head_dim):
                    attn[i, h * head_dim + d] = _store(attn, attn32[i, h, d])
        _gemm(attn, o_w[layer], o_e[layer], o, no)
        target = sum_a if turn == 0 else sum_b
        _norm(wide, o, res, yes, post_norms[layer], eps, normed, target)
        res, turn = target, 1 - turn
        _gemm(normed, gu_w[layer], gu_e[layer], gate_up, no)
        _gemm(gate_up, down_w[layer], down_e[layer], out, yes)
        hidden = out
    return hidden, res


@functools.cache
def _layers_of(kernel: str, head_dim: int, group: int):  # type: ignore[no-untyped-def]
    """The compiled run for one GEMM kernel (``LayerStack.gemm``) and one attention kernel
    (``cpu_attention.decode_kernel_key``'s ``(head_dim, group)``; ``(0, 0)`` for the generic one). Both GEMMs are
    called as ``gemm(x, packed, extra, out, gated)``.

    Each is ``_layers`` under a name of its own, with the two kernels as its globals, read from numba's disk cache
    after its first compilation (~2.4 s a process, paid in every engine's warm-up before). Why globals and not a
    closure: numba keys a cached closure by its cells' pickles, and a pickled dispatcher carries a per-process id,
    so a closure would never be found again. Why the name: it says which kernels are compiled in, and carries
    the kernels' source digest, so a changed kernel is compiled afresh, not read stale; and numba merges linked
    code by name (``cpu_attention._decode_kernel``), so each compiled run has a name of its own."""
    gemm = (cpu_bf16_gemm._linear if kernel == BF16 else cpu_bf16w_gemm._linear if kernel == BF16W
            else cpu_int8_gemm.compiled_kernel(kernel)[1])
    name = f"layers_{kernel}_d{head_dim}_g{group}_{_SOURCES}"
    run_of = types.FunctionType(_layers.__code__, {**globals(), "_gemm": gemm,
                                                   "_attend": cpu_attention._decode_kernel(head_dim, group)}, name)
    run_of.__qualname__ = f"_layers_of.<locals>.{name}"
    run_of.__doc__ = _layers.__doc__
    return njit(nogil=True, boundscheck=False, cache=True)(run_of)



def run(stack: LayerStack, x: np.ndarray, residual: np.ndarray | None, pool: np.ndarray, num_heads: int,
        positions: np.ndarray, cos_sin: np.ndarray, slots: np.ndarray, tables: np.ndarray, lens: np.ndarray,
        scale: np.float32, window: int, eps: np.float32,
        scales: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The stack's layers over numpy views a caller checked (``cpu_layers.CpuStep.stacked_layers``):
    ``x``/``residual`` ``[T, H]`` (bf16 as int16 bits; no residual before a model's first layer), ``pool [layers, 2,
    blocks, block_size, Hkv, D]`` of ``x``'s dtype (or bf16 under float32 rows), or int8 with its ``scales [layers, 2,
    blocks, block_size, Hkv]`` float32, one decode row per token. Returns new ``(x, residual)`` arrays."""
    if stack.gemm == BF16 and x.dtype != np.int16:
        raise KernelError("cpu_decode_layers.run: a bf16 stack takes bf16 rows")
    if stack.gemm == BF16W and x.dtype != np.float32:
        raise KernelError("cpu_decode_layers.run: a stack of bf16-held weights takes float32 rows")
    quantized = pool.dtype == np.int8
    if quantized != (scales is not None):
        raise KernelError("cpu_decode_layers.run: an int8 pool takes its scales, a float pool none")
    if scales is None:
        scales = np.ones((pool.shape[0], 2, 1, 1, 1), np.float32)  # the attention's scale arguments, never read
    compiled = _layers_of(stack.gemm, *cpu_attention.decode_kernel_key(num_heads, pool.shape[4], pool.shape[5]))
    (qkv_w, o_w, gu_w, down_w), (qkv_e, o_e, gu_e, down_e) = stack.packed, stack.extras
    return compiled(x, x if residual is None else residual, residual is not None, pool, scales, quantized, stack.first,
                    stack.input_norms, stack.post_norms, qkv_w, qkv_e, o_w, o_e, gu_w, gu_e, down_w, down_e, num_heads,
                    positions, cos_sin, slots, tables, lens, scale, window, eps, True, False)
