"""The kernels on real SmolLM2-135M activations: layer 0's norm, projections, RoPE and paged attention.

Layer 0's weights come from the real GGUF. Two checks that could each fail:
- RoPE convention: llama.cpp stores q/k rows permuted and rotates interleaved pairs; un-permuting the
  weights (what the engine does at load) and using ``apply_rotary``'s rotate-half must give the same
  rotated vectors, with the model's own rope base (1e5).
- Paged attention as the engine drives it (a prompt prefilled in two chunks into shuffled cache blocks,
  then single-token decode steps) must equal dense causal attention over the whole sequence.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from apiary.kernels import ops, reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORDS = ("the hive temperature rose sharply after noon while the colony stayed quiet and the bees "
         "gathered near the entrance because the air outside was hot and dry").split()


@pytest.fixture(scope="module")
def layer0(gguf_path):
    """Token embeddings for a real sentence plus layer 0's attention weights, dequantized to fp32."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    field = reader.fields
    tokens = [bytes(field["tokenizer.ggml.tokens"].parts[i]).decode() for i in field["tokenizer.ggml.tokens"].data]
    ids = [tokens.index("Ġ" + w) for w in WORDS if "Ġ" + w in tokens]
    assert len(ids) >= 20, "the sentence should tokenize to real vocabulary entries"
    emb = tensors["token_embd.weight"]
    rows = dequantize(np.asarray(emb.data)[ids], emb.tensor_type)

    def weight(name: str) -> torch.Tensor:
        t = tensors[name]
        return torch.from_numpy(np.array(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32))

    def scalar(key: str) -> float:
        return float(field[key].parts[-1][0])

    return dict(x=torch.from_numpy(np.array(rows, dtype=np.float32)), norm=weight("blk.0.attn_norm.weight"),
                wq=weight("blk.0.attn_q.weight"), wk=weight("blk.0.attn_k.weight"), wv=weight("blk.0.attn_v.weight"),
                heads=int(scalar("llama.attention.head_count")), kv_heads=int(scalar("llama.attention.head_count_kv")),
                base=scalar("llama.rope.freq_base"), eps=scalar("llama.attention.layer_norm_rms_epsilon"))


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (GGUF interleaved pairs -> Hugging Face rotate-half halves)."""
    out_dim, in_dim = w.shape
    return w.view(heads, out_dim // heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _rope_interleaved(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """llama.cpp's native RoPE on GGUF-layout heads: rotate pairs (x[2i], x[2i+1]) by pos * base^(-2i/D)."""
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions[:, None, None].double() * theta
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angle), angle)).reshape(x.shape)


def _interleaved_to_halves(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    return x.reshape(*x.shape[:-1], d // 2, 2).transpose(-1, -2).reshape(x.shape)


@pytest.fixture(params=["torch", "triton"])
def backend(request, device):
    """Each backend on each device it can run on (``device`` comes from conftest and skips as needed)."""
    if request.param == "torch" and device == "cuda":
        pytest.skip("the torch path on CUDA is covered by the Triton comparison tests")
    previous = ops._backend
    ops.set_backend(request.param)
    yield request.param, device
    ops._backend = previous


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer0_attention_on_real_weights(layer0, backend, dtype):
    _, device = backend
    heads, kv_heads = layer0["heads"], layer0["kv_heads"]
    hidden = layer0["x"].shape[1]
    head_dim = hidden // heads
    seq = layer0["x"].shape[0]
    positions = torch.arange(seq)

    # RoPE convention with real weights: llama.cpp layout + interleaved == un-permuted + rotate-half.
    x = ops.rms_norm(layer0["x"].to(device), layer0["norm"].to(device), layer0["eps"])
    q_gguf = (x.cpu() @ layer0["wq"].T).view(seq, heads, head_dim)
    k_gguf = (x.cpu() @ layer0["wk"].T).view(seq, kv_heads, head_dim)
    wq, wk = _unpermute(layer0["wq"], heads), _unpermute(layer0["wk"], kv_heads)
    q = (x @ wq.T.to(device)).view(seq, heads, head_dim)
    k = (x @ wk.T.to(device)).view(seq, kv_heads, head_dim)
    v = (x @ layer0["wv"].T.to(device)).view(seq, kv_heads, head_dim)
    cos_sin = reference.rotary_cos_sin_cache(256, head_dim, layer0["base"], device=device)
    q, k = ops.apply_rotary(q, k, positions.to(device), cos_sin)
    for ours, gguf_layout in ((q, q_gguf), (k, k_gguf)):
        llama_cpp = _interleaved_to_halves(_rope_interleaved(gguf_layout, positions, layer0["base"]))
        torch.testing.assert_close(ours.double().cpu(), llama_cpp, atol=1e-4, rtol=1e-4)

    # Dense causal attention over the whole sequence, float64.
    rep = heads // kv_heads
    qd, kd, vd = q.double().cpu(), k.double().cpu(), v.double().cpu()
    dense = F.scaled_dot_product_attention(qd.transpose(0, 1), kd.repeat_interleave(rep, 1).transpose(0, 1),
                                           vd.repeat_interleave(rep, 1).transpose(0, 1), is_causal=True,
                                           scale=1 / math.sqrt(head_dim)).transpose(0, 1)

    # The engine's way: prefill in two chunks into shuffled 16-token blocks, then decode one token at a time.
    block_size, decode_steps = 16, 3
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    num_blocks = math.ceil(seq / block_size) + 2
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))[: math.ceil(seq / block_size)]
    table = torch.full((1, num_blocks), -1, dtype=torch.int32)
    table[0, : len(blocks)] = blocks.int()
    table = table.to(device)
    slots = (blocks.repeat_interleave(block_size) * block_size + torch.arange(block_size).repeat(len(blocks)))[:seq]
    slots = slots.to(device)
    prefill_end = seq - decode_steps
    chunks = [(0, 17), (17, prefill_end)] + [(t, t + 1) for t in range(prefill_end, seq)]
    outputs = []
    for start, end in chunks:
        ops.write_kv(k[start:end], v[start:end], k_cache, v_cache, slots[start:end])
        ctx = torch.tensor([end], dtype=torch.int32, device=device)
        if end - start == 1:
            outputs.append(ops.paged_decode_attention(q[start:end], k_cache, v_cache, table, ctx,
                                                      1 / math.sqrt(head_dim)))
        else:
            cu = torch.tensor([0, end - start], dtype=torch.int32, device=device)
            outputs.append(ops.paged_prefill_attention(q[start:end], k_cache, v_cache, table, cu, ctx,
                                                       1 / math.sqrt(head_dim)))
    paged = torch.cat(outputs).double().cpu()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(paged, dense, **tol)
