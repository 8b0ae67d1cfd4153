"""A run of int8 decoder layers at decode, as one compiled call: what ``CpuStep``'s per-layer calls compute.

Why: a decode step of SmolLM2 with int8 weights makes ~10 kernel calls per layer (two RMSNorms, four
projections, rotary with the KV write, attention), ~280 a step, and each paid Python around it:
numpy views, ``cpu_int8_gemm.Bound``'s checks, numba's dispatch of five to eleven arguments,
``torch.from_numpy``, the query's widening and the output's rounding as torch ops. A 14-row projection's
call measured 43.5 us against 35.7 us for its kernel alone, an RMSNorm of 14 rows 15 us for ~3 us of
work. Here a run of layers is one call of a numba function that calls the same compiled kernels in the
same order on buffers it allocates once, so its results are the per-layer path's bit for bit
(``tests/kernels/test_cpu_int8_layers.py``) and only the glue goes.

What a run needs (``stackable``; the engine takes the per-layer path otherwise): grouped int8 weights for
the four projections of every layer (``apiary.kernels.cpu_int8_gemm``), no biases, output widths that are
whole 16-output tiles (nothing padded between one kernel's output and the next one's input), and a float
KV pool whose layers are one array. Decode rows only: prompt chunks take milliseconds a layer, where the
glue does not show, and their attention kernels are chosen by run length.

The weights are stacked once (``[layers, ...]`` per projection) and each layer's ``GroupedWeight`` becomes a
view of its slice (``Int8Stack.views``), so the model holds them once. The function is built per GEMM
kernel and attention kernel (``_layers_of``) and compiled once per process, not cached on disk: numba keys a cached
function by its own source file only, and a cached copy would go on calling the kernels it was compiled
with after they change.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from apiary.kernels import cpu_attention, cpu_int8_gemm
from apiary.kernels.cpu_attention import _NO_SCALES, _as_f32
from apiary.kernels.cpu_int8_gemm import TILE, GroupedWeight
from apiary.kernels.cpu_layers import (PARALLEL_ROWS, _np, _rms_norm, _rms_norm_rows, _rotary_write_kv,
                                       _rotary_write_kv_rows, _store)
from apiary.kernels.errors import KernelError

PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")  # a layer's projections, in the order they run


@dataclass(frozen=True, slots=True)
class Int8Stack:
    """Decoder layers ``first .. first + count - 1``, stacked: per projection (``PROJECTIONS``' order) ``packed
    [count, N / 16, Kp / 4, 16, 4]`` uint8 and ``scales [count, N / 16, Kp / 64, 16]`` float32, with each one's
    ``in_features``; RMSNorm weights ``[count, hidden]`` (bf16 as its int16 bits). ``kernel``: the grouped GEMM's
    kernel the run calls (one of ``cpu_int8_gemm.runnable()``)."""

    first: int
    count: int
    kernel: str
    input_norms: np.ndarray
    post_norms: np.ndarray
    packed: tuple[np.ndarray, ...]
    scales: tuple[np.ndarray, ...]
    in_features: tuple[int, ...]

    def views(self) -> list[dict[str, GroupedWeight]]:
        """Each layer's projections as ``GroupedWeight`` views of the stack, for the layers to hold instead of
        their own copies."""
        return [{name: GroupedWeight(packed[i], scales[i], packed.shape[1] * TILE, k)
                 for name, packed, scales, k in zip(PROJECTIONS, self.packed, self.scales, self.in_features)}
                for i in range(self.count)]


def stackable(weights: dict[str, object], biases: dict[str, object]) -> str | None:
    """Why one layer's projections (``PROJECTIONS`` -> weight, -> bias) cannot join a stack, or None."""
    for name in PROJECTIONS:
        weight = weights.get(name)
        if not isinstance(weight, GroupedWeight):
            return f"{name} is not a grouped int8 weight"
        if biases.get(name) is not None:
            return f"{name} has a bias"
        if weight.out_features % TILE:
            return f"{name} has {weight.out_features} outputs, not whole tiles of {TILE}"
    return None


def stack(first: int, layers: list[dict[str, GroupedWeight]], input_norms: list[torch.Tensor],
          post_norms: list[torch.Tensor], kernel: str | None = None) -> Int8Stack:
    """Stack consecutive layers (from layer ``first``): their projections (``PROJECTIONS`` -> ``GroupedWeight``,
    each ``stackable``) and norms. ``kernel``: one of ``cpu_int8_gemm.runnable()`` (default: the best)."""
    kernel = cpu_int8_gemm.compiled_kernel(kernel)[0]
    if not layers or len(input_norms) != len(layers) or len(post_norms) != len(layers):
        raise KernelError("cpu_int8_layers.stack takes one or more layers, each with its two norms")
    for i, layer in enumerate(layers):
        why = stackable(layer, {})
        if why is not None:
            raise KernelError(f"cpu_int8_layers.stack: layer {first + i}: {why}")
    packed, scales, in_features = [], [], []
    for name in PROJECTIONS:
        shapes = {(w.packed.shape, w.scales.shape, w.in_features) for w in (layer[name] for layer in layers)}
        if len(shapes) != 1:
            raise KernelError(f"cpu_int8_layers.stack: the layers' {name} weights differ: {sorted(shapes)}")
        packed.append(np.stack([layer[name].packed for layer in layers]))
        scales.append(np.stack([layer[name].scales for layer in layers]))
        in_features.append(layers[0][name].in_features)
    hidden = in_features[0]
    norms = []
    for group in (input_norms, post_norms):
        if any(n.dtype not in (torch.float32, torch.bfloat16) or tuple(n.shape) != (hidden,) for n in group):
            raise KernelError(f"cpu_int8_layers.stack: norms must be float32 or bfloat16 vectors of {hidden}")
        norms.append(_np(torch.stack([n.to(group[0].dtype) for n in group]).contiguous()))
    return Int8Stack(first, len(layers), kernel, norms[0], norms[1], tuple(packed), tuple(scales), tuple(in_features))


@njit(inline="always")
def _norm(wide, x, residual, has_residual, weight, eps, out, summed):  # type: ignore[no-untyped-def]
    """``_rms_norm``, or its row-parallel twin for ``wide`` steps (as ``CpuStep.rms_norm`` chooses)."""
    if wide:
        _rms_norm_rows(x, residual, has_residual, weight, eps, out, summed)
    else:
        _rms_norm(x, residual, has_residual, weight, eps, out, summed)


@functools.cache
def _layers_of(kernel: str, head_dim: int, group: int):  # type: ignore[no-untyped-def]
    """The compiled run for one GEMM kernel and one attention kernel (``cpu_attention.decode_kernel_key``'s
    ``(head_dim, group)``; ``(0, 0)`` for the generic one)."""
    gemm = cpu_int8_gemm.compiled_kernel(kernel)[1]
    attend = cpu_attention._decode_kernel(head_dim, group)

    @njit(nogil=True, boundscheck=False)
    def layers(x, residual, has_residual, pool, first, input_norms, post_norms, qkv_w, qkv_s, o_w, o_s, gu_w, gu_s,
               down_w, down_s, num_heads, positions, cos_sin, slots, tables, lens, scale, window, eps,
               no_scales, yes, no):  # type: ignore[no-untyped-def]
        """``(x, residual)`` after the stack's layers, from the hidden rows ``x [T, H]`` and the residual stream
        (``has_residual`` False: none yet, as before a model's first layer). Each layer is ``LlamaModel.forward``'s
        CPU path: norm, qkv, rotary and the KV write into ``pool[first + l]``, decode attention, o_proj, norm,
        gate/up, down. ``yes``/``no``: True and False as run-time values, for the kernels' flags: a constant is
        typed as a literal and compiles the kernels again, specialised, where the per-layer path calls the ones
        compiled for run-time flags, and LLVM may vectorise the two apart (seen once: a float32 run an ulp off)."""
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
        hidden, res = x, residual
        turn = 0
        wide = t >= PARALLEL_ROWS  # the row-parallel norm and rotary, as ``CpuStep`` takes them
        for layer in range(input_norms.shape[0]):
            k_cache, v_cache = pool[first + layer, 0], pool[first + layer, 1]
            # the sum goes to the buffer the residual is not in (``CpuStep.rms_norm``: aliasing changes rounding)
            target = sum_a if turn == 0 else sum_b
            if has_residual or layer > 0:
                _norm(wide, hidden, res, yes, input_norms[layer], eps, normed, target)
                res, turn = target, 1 - turn
            else:  # no residual stream yet: it starts as the rows themselves
                _norm(wide, hidden, hidden, no, input_norms[layer], eps, normed, normed)
                res = hidden
            gemm(normed, qkv_w[layer], qkv_s[layer], qkv, no)
            k_rows, v_rows = (k_cache.reshape((-1, num_kv_heads, head_dim)),
                              v_cache.reshape((-1, num_kv_heads, head_dim)))
            if wide:
                _rotary_write_kv_rows(qkv, num_heads, num_kv_heads, positions, cos_sin, q, k_rows, v_rows, slots)
            else:
                _rotary_write_kv(qkv, num_heads, num_kv_heads, positions, cos_sin, q, k_rows, v_rows, slots)
            for i in range(t):
                for h in range(num_heads):
                    for d in range(head_dim):
                        q32[i, h, d] = _as_f32(q[i, h, d])
            attend(q32, k_cache, v_cache, no_scales, no_scales, no, tables, lens, scale, window, attn32)
            for i in range(t):
                for h in range(num_heads):
                    for d in range(head_dim):
                        attn[i, h * head_dim + d] = _store(attn, attn32[i, h, d])
            gemm(attn, o_w[layer], o_s[layer], o, no)
            target = sum_a if turn == 0 else sum_b
            _norm(wide, o, res, yes, post_norms[layer], eps, normed, target)
            res, turn = target, 1 - turn
            gemm(normed, gu_w[layer], gu_s[layer], gate_up, no)
            gemm(gate_up, down_w[layer], down_s[layer], out, yes)
            hidden = out
        return hidden, res

    return layers



def run(stack: Int8Stack, x: np.ndarray, residual: np.ndarray | None, pool: np.ndarray, num_heads: int,
        positions: np.ndarray, cos_sin: np.ndarray, slots: np.ndarray, tables: np.ndarray, lens: np.ndarray,
        scale: np.float32, window: int, eps: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """The stack's layers over numpy views a caller checked (``cpu_layers.CpuStep.int8_layers``): ``x``/``residual``
    ``[T, H]`` (bf16 as int16 bits; no residual before a model's first layer), ``pool [layers, 2, blocks,
    block_size, Hkv, D]`` of ``x``'s dtype, one decode row per token. Returns new ``(x, residual)`` arrays."""
    compiled = _layers_of(stack.kernel, *cpu_attention.decode_kernel_key(num_heads, pool.shape[4], pool.shape[5]))
    (qkv_w, o_w, gu_w, down_w), (qkv_s, o_s, gu_s, down_s) = stack.packed, stack.scales
    return compiled(x, x if residual is None else residual, residual is not None, pool, stack.first, stack.input_norms,
                    stack.post_norms, qkv_w, qkv_s, o_w, o_s, gu_w, gu_s, down_w, down_s, num_heads, positions, cos_sin,
                    slots, tables, lens, scale, window, eps, _NO_SCALES, True, False)

