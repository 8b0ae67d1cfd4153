"""CUDA graphs for decode steps: one captured forward per batch-size bucket, replayed with the step's inputs.

A small model's decode step on a GPU is bound by launches, not by the GPU: 30 layers of ~10 kernels each,
every one launched from Python. Replaying a captured graph launches them all in one call. Only pure-decode
steps are graphed (a prefill's shape changes with its token count). A step of ``n`` sequences replays the
smallest bucket ``>= n``; the padding rows write no KV (slot -1, which ``write_kv`` skips), attend to one
token of whatever block their stale table row names, and are dropped. Inputs are copied into static
buffers that every graph reads; the graphs share one memory pool and are captured largest first.
"""
from __future__ import annotations

import bisect
import logging
import math
import time

import torch

from apiary.cloud.engine.kv_cache import LayerKV
from apiary.cloud.engine.model import AttentionMetadata, LlamaModel

log = logging.getLogger(__name__)

# Batch sizes captured (capped at max_num_seqs, which is always captured): at most a third of a replay is
# padding, and ~15 graphs capture in seconds.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# Block-table width the graphs are captured with. Decode attention splits each row into partitions of the
# table's width, so a graph captured for the longest context would pay for it on every step; steps with a
# longer context (where attention, not launches, dominates) run eagerly.
MAX_GRAPH_CONTEXT = 4096


def buckets_for(max_num_seqs: int) -> list[int]:
    """The captured batch sizes: ``BUCKETS`` below ``max_num_seqs``, then ``max_num_seqs`` itself."""
    return sorted({b for b in BUCKETS if b < max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    """Static inputs, one captured graph per bucket, and the copy-in / replay of a decode step."""

    def __init__(self, model: LlamaModel, kv_caches: list[LayerKV], max_num_seqs: int, max_model_len: int,
                 block_size: int, device: torch.device) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.buckets = buckets_for(max_num_seqs)
        self.max_blocks = math.ceil(min(max_model_len, MAX_GRAPH_CONTEXT) / block_size)
        b = self.buckets[-1]
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(b, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(b, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(b, self.max_blocks, dtype=torch.int32, device=device)
        self._no_prefill = (torch.zeros(0, self.max_blocks, dtype=torch.int32, device=device),
                            torch.zeros(1, dtype=torch.int32, device=device),
                            torch.zeros(0, dtype=torch.int32, device=device))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # decode steps served by a graph (tests and benchmarks check the graphs were used)

    def bucket(self, meta: AttentionMetadata, num_tokens: int) -> int | None:
        """The bucket that serves this step, or None (not pure decode, too many rows, too long a context)."""
        if meta.num_decode_tokens != num_tokens or meta.decode_block_tables.shape[1] > self.max_blocks:
            return None
        i = bisect.bisect_left(self.buckets, num_tokens)
        return self.buckets[i] if i < len(self.buckets) else None

    def metadata(self, b: int) -> AttentionMetadata:
        """Metadata over the first ``b`` rows of the static buffers (what a graph of bucket ``b`` reads)."""
        tables, cu, ctx = self._no_prefill
        return AttentionMetadata(slot_mapping=self.slot_mapping[:b], num_decode_tokens=b,
                                 decode_block_tables=self.block_tables[:b], decode_context_lens=self.context_lens[:b],
                                 prefill_block_tables=tables, prefill_cu_seqlens_q=cu, prefill_context_lens=ctx)

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, b: int) -> None:
        """Copy a decode step of ``n <= b`` rows into the static buffers; rows ``n..b`` become inert padding."""
        n, width = input_ids.shape[0], meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:b].fill_(-1)  # a stale slot here would overwrite a live sequence's KV
        self.context_lens[:n].copy_(meta.decode_context_lens)
        self.context_lens[n:b].fill_(1)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables)  # columns past width are never read

    def forward(self, b: int) -> torch.Tensor:
        """The eager forward a graph of bucket ``b`` captures (also how padding is tested without a GPU)."""
        return self.model.forward(self.input_ids[:b], self.positions[:b], self.metadata(b), self.kv_caches)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm each bucket up eagerly (Triton compiles on first call), then capture it; largest first."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            self.forward(b)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self.forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        log.info("CUDA graphs: %d decode buckets (%s) captured in %.1f s", len(self.buckets),
                 ",".join(map(str, self.buckets)), time.perf_counter() - start)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, b: int) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of a decode step, by replaying bucket ``b``'s graph (valid until the next)."""
        self.load(input_ids, positions, meta, b)
        self.graphs[b].replay()
        self.replays += 1
        return self.outputs[b][:input_ids.shape[0]]
