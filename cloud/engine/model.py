"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache.

Covers Llama 2/3, SmolLM2, Mistral and Qwen2 (q/k/v biases). q/k/v and gate/up are fused into
one matmul each. Attention, norms, rotary and the KV write go through ``apiary.kernels.ops``, so the
Triton kernels replace the torch references on CUDA without touching this file, and on CPU decode
attention runs ``apiary.kernels``' numba kernel unless the config asks for the torch reference.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from apiary.cloud.engine.config import ModelConfig
from apiary.cloud.engine import host_memory
from apiary.cloud.engine.errors import EngineError, StepInterrupted
from apiary.cloud.engine.int8 import GroupedInt8Linear, Int8Linear, RefinedHead
from apiary.cloud.engine.kv_cache import LayerKV
from apiary.cloud.engine.linear import Linear
from apiary.kernels import huge_pages, ops

if TYPE_CHECKING:
    from apiary.kernels.cpu_decode_layers import LayerStack, StackWeight
    from apiary.kernels.cpu_layers import CpuStep


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step batch layout, built once per step and shared by every layer.

    The first ``num_decode_tokens`` tokens are single-token queries (decodes) served by
    ``paged_decode_attention``; the rest are variable-length chunks served by
    ``paged_prefill_attention`` (prefill chunks, prefix-cache tails, k+1 verification queries).
    """

    slot_mapping: torch.Tensor  # [T] int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [Bd, M] int32
    decode_context_lens: torch.Tensor  # [Bd] int32
    prefill_block_tables: torch.Tensor  # [Bp, M] int32
    prefill_cu_seqlens_q: torch.Tensor  # [Bp + 1] int32
    prefill_context_lens: torch.Tensor  # [Bp] int32
    # Consecutive decode rows served by one attention call each. The torch reference pads every
    # row to the longest context of its call, so on CPU the runner sorts decodes by context
    # length and cuts them into a few groups (measured ~30% less decode attention time at
    # batch 64 with mixed lengths); None = one call (the CUDA and numba kernels handle ragged lengths).
    decode_groups: list[tuple[int, int]] | None = None


def paged_layout(starts: np.ndarray, counts: np.ndarray, block_tables: list[list[int]], block_size: int,
                 num_decodes: int, device: torch.device,
                 decode_groups: list[tuple[int, int]] | None = None) -> tuple[torch.Tensor, AttentionMetadata, np.ndarray]:
    """Positions and attention metadata for entries of ``counts[i]`` new tokens starting at position ``starts[i]``
    over ``block_tables[i]`` (single-token entries first); also the cumulative token offsets ``cu``."""
    cu = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=cu[1:])
    owner = np.repeat(np.arange(len(counts)), counts)
    positions = starts[owner] + np.arange(cu[-1]) - cu[:-1][owner]
    tables = np.zeros((len(block_tables), max(len(b) for b in block_tables)), dtype=np.int32)
    for i, table in enumerate(block_tables):
        tables[i, :len(table)] = table
    slots = tables[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    context = (starts + counts).astype(np.int32)
    nd = num_decodes

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    meta = AttentionMetadata(
        slot_mapping=t(slots), num_decode_tokens=nd,
        decode_block_tables=t(tables[:nd]), decode_context_lens=t(context[:nd]),
        prefill_block_tables=t(tables[nd:]), prefill_cu_seqlens_q=t((cu[nd:] - cu[nd]).astype(np.int32)),
        prefill_context_lens=t(context[nd:]), decode_groups=decode_groups)
    return t(positions), meta, cu


Projection = Linear | Int8Linear | GroupedInt8Linear


def swiglu_down(down: Projection, gate_up: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate) * up)`` for ``gate_up = [gate | up]``; the grouped int8 layer does the elementwise part
    in its quantization pass (``GroupedInt8Linear.gated``), the bf16 kernel before its products (``Linear.gated``)."""
    if isinstance(down, (GroupedInt8Linear, Linear)):
        return down.gated(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return down(F.silu(gate) * up)


@dataclass(slots=True)
class DecoderLayer:
    input_norm: torch.Tensor
    qkv: Projection  # an int8 layer with EngineConfig(weights="int8")
    o_proj: Projection
    post_norm: torch.Tensor
    gate_up: Projection
    down: Projection

    def tensors(self) -> list[torch.Tensor]:
        return [self.input_norm, self.post_norm] + [t for lin in (self.qkv, self.o_proj, self.gate_up, self.down)
                                                    for t in lin.tensors()]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies, with Llama 3 scaling (config dict or GGUF frequency factors)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    factors = config.extra.get("rope_freq_factors")
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if factors is not None:
        inv_freq = inv_freq / factors.to(torch.float64)
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    elif kind not in (None, "default"):
        raise EngineError(f"rope scaling {kind!r} is not supported")
    return inv_freq


def rope_cos_sin_cache(config: ModelConfig, max_positions: int, device: torch.device) -> torch.Tensor:
    """``[max_positions, head_dim]``: first half cos, second half sin (the ``apiary.kernels.ops`` layout), fp32."""
    freqs = torch.arange(max_positions, dtype=torch.float64)[:, None] * rope_inv_freq(config)[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(torch.float32).to(device)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, max_positions: int, cpu_attention_backend: str = "numba") -> None:
        self.config = config
        self.device, self.dtype = device, dtype
        # Decode attention: kernels.ops chooses (Triton on CUDA, numba on CPU); cpu_attention="torch"
        # asks for the torch reference, which pads each call's rows to its longest context.
        self.decode_backend = "torch" if cpu_attention_backend == "torch" and device.type == "cpu" else None
        self.ragged_decode = ops.decode_backend(device, dtype, self.decode_backend) != "torch"
        self.scale = config.head_dim ** -0.5

        pages = host_memory.FilePages(list(weights.values()))  # a mapped checkpoint's pages, dropped once copied

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise EngineError(f"checkpoint lacks tensor {name}")
            source = weights[name]
            out = source.to(device=device, dtype=dtype).contiguous()
            if out.data_ptr() != source.data_ptr():
                pages.release(source)
            return out

        def maybe(name: str) -> torch.Tensor | None:
            return w(name) if name in weights else None

        def cat(*names: str) -> torch.Tensor:
            return torch.cat([w(n) for n in names], dim=0).contiguous()

        self.embed = w("model.embed_tokens.weight")
        if tuple(self.embed.shape) != (config.vocab_size, config.hidden_size):
            raise EngineError(f"embedding is {tuple(self.embed.shape)}, expected ({config.vocab_size}, {config.hidden_size})")
        self.lm_head = self.embed if config.tie_word_embeddings or "lm_head.weight" not in weights else w("lm_head.weight")
        self.head: Linear | RefinedHead = Linear.of(self.lm_head)  # int8.quantize_head may refine it
        self.norm = w("model.norm.weight")
        self.layers: list[DecoderLayer] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            biases = [maybe(attn + f"{x}_proj.bias") for x in "qkv"]
            self.layers.append(DecoderLayer(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=Linear.of(cat(attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
                              torch.cat(biases).contiguous() if all(b is not None for b in biases) else None),
                o_proj=Linear.of(w(attn + "o_proj.weight"), maybe(attn + "o_proj.bias")),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=Linear.of(cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
                down=Linear.of(w(p + "mlp.down_proj.weight")),
            ))
        self.cos_sin = rope_cos_sin_cache(config, max_positions, device)
        c = config
        self.qkv_split = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        self.layer_stack: LayerStack | None = None  # stack_layers: decode steps' run of layers in one call

    def stack_layers(self, kernel: str | None = None) -> str:
        """Stack the longest run of consecutive layers that ``ops.layer_stackable`` accepts (grouped int8 projections,
        bf16 ones through our bf16 kernel, or bf16-held ones of a float32 engine), for decode steps to run in one compiled call
        (``CpuStep.stacked_layers``); the layers then hold views of the stack. Returns what it did, for the
        engine's log. ``kernel``: int8 weights' grouped GEMM (default: the best here)."""
        from apiary.cloud.engine.int8 import PROJECTIONS

        def weight(lin: object) -> StackWeight | None:
            if isinstance(lin, GroupedInt8Linear):
                return lin.weight
            return lin.kernel.weight if isinstance(lin, Linear) and lin.kernel is not None else None

        def why_not(layer: DecoderLayer) -> str | None:
            lins = [getattr(layer, name) for name in PROJECTIONS]
            if any(weight(lin) is None for lin in lins):
                return "not all projections are grouped int8, through the bf16 kernel or bf16-held"
            return ops.layer_stackable({n: weight(lin) for n, lin in zip(PROJECTIONS, lins)},
                                       {n: lin.bias if isinstance(lin, GroupedInt8Linear) else None
                                        for n, lin in zip(PROJECTIONS, lins)})

        self.layer_stack = None
        if self.device.type != "cpu":
            return "no run of layers in one call (not on the CPU)"
        reasons = [why_not(layer) for layer in self.layers]
        kinds = [type(weight(layer.qkv)) for layer in self.layers]
        best, start = (0, 0), None
        for i, reason in enumerate([*reasons, "end"]):
            if start is not None and (reason is not None or kinds[i] != kinds[start]):  # a run is of one kind
                best, start = max(best, (i - start, -start)), None
            if reason is None and start is None:
                start = i
        count, first = best[0], -best[1]
        if not count:
            return f"no run of layers in one call ({next((r for r in reasons if r), 'no layers')})"
        layers = self.layers[first:first + count]
        self.layer_stack = ops.stack_layers(
            first, [{n: weight(getattr(layer, n)) for n in PROJECTIONS} for layer in layers],  # type: ignore[misc]
            [layer.input_norm for layer in layers], [layer.post_norm for layer in layers], kernel)
        for layer, views in zip(layers, self.layer_stack.views()):
            for name, view in views.items():
                lin = getattr(layer, name)
                if isinstance(lin, GroupedInt8Linear):
                    setattr(layer, name, GroupedInt8Linear(view))  # type: ignore[arg-type]
                    continue
                held = lin.takes != lin.dtype  # float32 rows through bf16-held weights
                bind = ops.bind_held_bf16 if held else ops.bind_packed_bf16
                setattr(layer, name, Linear(None, lin.bias, None, bind(view), lin.takes))  # type: ignore[arg-type]
        in_huge_pages = all(huge_pages.eligible(packed) for packed in self.layer_stack.packed)
        return (f"decode steps run layers {first}-{first + count - 1} in one compiled call "
                f"({self.layer_stack.gemm} GEMM; weights in "
                f"{'2 MiB' if in_huge_pages else '4 KiB'} pages, transparent huge pages {huge_pages.thp_mode()})")

    def _attention(self, q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata,
                   step: CpuStep | None = None) -> torch.Tensor:
        nd, window = meta.num_decode_tokens, self.config.sliding_window
        if step is not None and step.attends_all:  # every row through the step's prepared kernels, one buffer
            return step.attention(q, kv.k, kv.v, kv.k_scale, kv.v_scale)
        if step is not None:
            parts = [step.decode_attention(q[:nd], kv.k, kv.v, kv.k_scale, kv.v_scale)] if nd else []
        else:
            parts = [ops.paged_decode_attention(q[a:b], kv.k, kv.v, meta.decode_block_tables[a:b],
                                                meta.decode_context_lens[a:b], self.scale, window, self.decode_backend,
                                                kv.k_scale, kv.v_scale)
                     for a, b in (meta.decode_groups or ([(0, nd)] if nd else []))]
        if nd < q.shape[0]:
            parts.append(ops.paged_prefill_attention(q[nd:], kv.k, kv.v, meta.prefill_block_tables,
                                                     meta.prefill_cu_seqlens_q, meta.prefill_context_lens,
                                                     self.scale, window, kv.k_scale, kv.v_scale, self.decode_backend))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[LayerKV],
                should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of the new tokens; their K/V land in ``kv_caches``.

        ``should_stop`` is asked before every layer after the first; if it says yes, the pass raises
        ``StepInterrupted`` (the K/V already written are rewritten when the tokens run again). A decode step's
        run of layers (``stack_layers``) is one call, not asked inside: it takes milliseconds.
        """
        c = self.config
        t = input_ids.shape[0]
        x = F.embedding(input_ids, self.embed)
        residual: torch.Tensor | None = None
        step = self._cpu_step(t, positions, meta, kv_caches)
        stack = self._stack_for(step, meta, t, kv_caches)
        skip_to = 0
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            if i < skip_to:
                continue
            if residual is not None and should_stop is not None and should_stop():
                raise StepInterrupted
            if stack is not None and step is not None and i == stack.first:  # _stack_for checked kv.pool
                # the run of layers in one call: a decode step takes milliseconds, not worth interrupting
                x, residual = step.stacked_layers(x, residual, stack, kv.pool, kv.scales)  # type: ignore[arg-type]
                skip_to = i + stack.count
                continue
            if step is not None:  # the same layer on CPU, its small ops checked once per pass (CpuStep)
                h, residual = step.rms_norm(x, layer.input_norm, residual)
                q = step.rotary_write_kv(layer.qkv(h), kv.k, kv.v, kv.k_scale, kv.v_scale)
                attn = self._attention(q, kv, meta, step)
                h, residual = step.rms_norm(layer.o_proj(attn.reshape(t, -1)), layer.post_norm, residual)
                x = swiglu_down(layer.down, layer.gate_up(h))
                continue
            if residual is None:
                residual, h = x, ops.rms_norm(x, layer.input_norm, c.rms_norm_eps)
            else:
                h, residual = ops.rms_norm(x, layer.input_norm, c.rms_norm_eps, residual)
            q, k, v = layer.qkv(h).split(self.qkv_split, dim=-1)
            q, k = ops.apply_rotary(q.view(t, c.num_heads, c.head_dim), k.view(t, c.num_kv_heads, c.head_dim),
                                    positions, self.cos_sin)
            ops.write_kv(k, v.view(t, c.num_kv_heads, c.head_dim), kv.k, kv.v, meta.slot_mapping, kv.k_scale, kv.v_scale)
            attn = self._attention(q, kv, meta)
            x = layer.o_proj(attn.reshape(t, -1))
            h, residual = ops.rms_norm(x, layer.post_norm, c.rms_norm_eps, residual)
            x = swiglu_down(layer.down, layer.gate_up(h))
        out, _ = ops.rms_norm(x, self.norm, c.rms_norm_eps, residual)
        return out

    def _stack_for(self, step: CpuStep | None, meta: AttentionMetadata, t: int,
                   kv_caches: list[LayerKV]) -> LayerStack | None:
        """The run of layers where this pass can take it: a CPU step of decode rows only over the layers' one pool
        (float rows, or int8 ones with their scales' pool); prompt chunks take the per-layer path."""
        stack = self.layer_stack
        if stack is None or step is None or meta.num_decode_tokens != t or not t:
            return None
        kv = kv_caches[stack.first]
        return stack if kv.pool is not None and (kv.k_scale is None or kv.scales is not None) else None

    def _cpu_step(self, t: int, positions: torch.Tensor, meta: AttentionMetadata,
                  kv_caches: list[LayerKV]) -> CpuStep | None:
        """``kernels.ops.cpu_step`` for this pass (None off the CPU path: CUDA, forced backends, the torch attention
        reference); its kernels compute what the per-call ops compute."""
        if self.device.type != "cpu" or not kv_caches:
            return None
        c = self.config
        return ops.cpu_step(t, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, self.dtype, c.rms_norm_eps,
                            positions, meta.slot_mapping, self.cos_sin, kv_caches[0].k, kv_caches[0].v,
                            meta.num_decode_tokens, meta.decode_block_tables, meta.decode_context_lens, self.scale,
                            c.sliding_window, self.decode_backend, kv_caches[0].k_scale, kv_caches[0].v_scale,
                            meta.prefill_block_tables, meta.prefill_cu_seqlens_q, meta.prefill_context_lens)

    def logits(self, hidden: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits of ``hidden`` rows. ``allowed``: the rows' grammar bitmask, for a head that computes
        exactly only the logits that can win (``int8.RefinedHead``: it must know which tokens a grammar allows);
        the plain head ignores it."""
        if isinstance(self.head, RefinedHead):
            return self.head(hidden, allowed)
        return self.head(hidden).float()
