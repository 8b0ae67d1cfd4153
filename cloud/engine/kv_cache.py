"""The paged KV pool: every layer's K and V blocks in one allocation, an int8 pool with its scales.

Why int8 (``EngineConfig(kv_cache_dtype="int8")``): decode attention reads every cached row of every
running sequence at every step, so its time is the cache's bytes; int8 rows with one float32 scale
per token and KV head cost ``head_dim + 4`` bytes instead of ``2 * head_dim`` (bf16) or
``4 * head_dim`` (float32): 1.9x and 3.8x as many tokens in the same budget, and that much less
memory traffic. Scales per token (not per block) because a block fills one decode at a time and
would otherwise need requantizing as it grows; symmetric because K and V rows are centred.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from apiary.cloud.engine import host_memory

SCALE_DTYPE = torch.float32


@dataclass(slots=True)
class LayerKV:
    """One layer's K and V ``[num_blocks, block_size, num_kv_heads, head_dim]``; int8 ones carry scales
    ``[num_blocks, block_size, num_kv_heads]`` (``apiary.kernels.ops`` takes them as ``k_scale``/``v_scale``).
    ``pool``: the ``[num_layers, 2, ...]`` array whose ``[layer, 0]`` and ``[layer, 1]`` these are, where they are
    views of one, and ``scales`` the same for an int8 pool's scales (a decode step's run of layers reads every
    layer's through them, ``CpuStep.stacked_layers``)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    pool: torch.Tensor | None = None
    scales: torch.Tensor | None = None


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, quantized: bool) -> int:
    """Cache bytes one token takes over all layers, K and V (scales included)."""
    row = head_dim + SCALE_DTYPE.itemsize if quantized else head_dim * dtype.itemsize
    return 2 * num_layers * num_kv_heads * row


class KVPool:
    """The pool of ``num_blocks`` blocks per layer, as ``layers`` (views), plus block copies for swapping."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, quantized: bool = False) -> None:
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        data = host_memory.zeros(shape, torch.int8 if quantized else dtype, device)
        # Scales start at zero: an unwritten int8 slot reads as 0.0, as an unwritten float slot does.
        self._parts = [data] + ([host_memory.zeros(shape[:-1], SCALE_DTYPE, device)] if quantized else [])
        self.quantized = quantized
        scales = self._parts[1] if quantized else None
        self.layers = [LayerKV(data[layer, 0], data[layer, 1],
                               *((scales[layer, 0], scales[layer, 1]) if scales is not None else (None, None)),
                               pool=data, scales=scales)
                       for layer in range(num_layers)]

    @property
    def dtype(self) -> torch.dtype:
        """What a cached row is stored as (int8, bf16 under a float32 engine, or the model's dtype)."""
        return self._parts[0].dtype

    def copy_out(self, blocks: list[int]) -> tuple[torch.Tensor, ...]:
        """A host copy of ``blocks`` in every layer (data, then scales), for swap-mode preemption."""
        index = torch.tensor(blocks, device=self._parts[0].device)
        return tuple(p[:, :, index].to("cpu") for p in self._parts)

    def copy_in(self, blocks: list[int], saved: tuple[torch.Tensor, ...]) -> None:
        """Write ``copy_out``'s copy back into ``blocks`` (the same count, any ids)."""
        if len(saved) != len(self._parts) or saved[0].shape[2] != len(blocks):
            raise ValueError(f"a copy of {saved[0].shape[2]} blocks in {len(saved)} parts cannot fill "
                             f"{len(blocks)} blocks of a {len(self._parts)}-part pool")
        index = torch.tensor(blocks, device=self._parts[0].device)
        for part, copy in zip(self._parts, saved):
            part[:, :, index] = copy.to(part.device)
