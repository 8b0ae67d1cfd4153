"""Quantization-aware training: the student's forward sees the INT4 weights its GGUF export will carry.

``fake_quant(w, qtype)`` rounds a weight matrix exactly as the export does (``gguf.quants``,
the reference of llama.cpp's own quantizers: blocks of 32 along each row, the block scale
stored as float16) and dequantizes it again. The rounding is invisible to the gradient
(straight-through estimator: ``w + (q(w) - w).detach()``), so the optimizer still moves the
float32 master weights, but the loss it minimises is the quantized model's. A few dozen
such steps at the end of distillation pull the weights to where rounding costs the answers
least; the saved folder holds the master weights, which the export then rounds to what the
training saw.
"""
from __future__ import annotations

import torch

BLOCK = 32
QTYPES = ("q4_0", "q4_1")


def _round_half_up(x: torch.Tensor) -> torch.Tensor:
    # gguf/ggml: trunc(x + 0.5) with x + 0.5 >= 0 here, i.e. floor
    return torch.floor(x)


def quantize_dequantize(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """``w`` [out, in] rounded to ``qtype`` blocks and back, bit for bit as ``gguf.quants`` exports it."""
    if qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")
    if w.shape[-1] % BLOCK:
        raise ValueError(f"rows of {w.shape[-1]} values do not split into blocks of {BLOCK}")
    blocks = w.detach().float().reshape(-1, BLOCK)
    if qtype == "q4_0":
        imax = blocks.abs().argmax(dim=-1, keepdim=True)
        d = blocks.gather(-1, imax) / -8
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = _round_half_up(blocks * inv + 8.5).clamp(0, 15)
        out = (q - 8) * d.half().float()
    else:
        lo, hi = blocks.min(dim=-1, keepdim=True).values, blocks.max(dim=-1, keepdim=True).values
        d = (hi - lo) / 15
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = _round_half_up((blocks - lo) * inv + 0.5).clamp(0, 15)
        out = q * d.half().float() + lo.half().float()
    return out.reshape(w.shape).to(w.dtype)


def fake_quant(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """The quantized weight in the forward, the identity in the backward (straight-through)."""
    return w + (quantize_dequantize(w, qtype) - w).detach()
