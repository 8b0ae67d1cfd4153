"""Runs a scheduled batch: builds the step's tensors once, calls the model, samples; owns the KV pool."""
from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from collections.abc import Callable, Iterable

import numpy as np
import torch

from apiary.cloud.engine.config import EngineConfig
from apiary.cloud.engine.errors import EngineError
from apiary.cloud.engine import host_memory, int8, threads
from apiary.cloud.engine.cuda_graphs import DecodeGraphs
from apiary.cloud.engine.kv_cache import KVPool, bytes_per_token
from apiary.cloud.engine.linear import Linear
from apiary.cloud.engine.loader import Checkpoint
from apiary.cloud.engine.model import AttentionMetadata, LlamaModel, paged_layout
from apiary.cloud.engine.sampling import Row
from apiary.cloud.engine.scheduler import ScheduledBatch
from apiary.cloud.engine.sequence import Sequence
from apiary.kernels import cpu, ops

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_BYTES = 1 << 30
WARM_UP_PROMPT = 64  # tokens of the warm-up's prompt chunk: past the short-run attention kernel's 16 queries
DECODE_GROUPS, DECODE_GROUP_MIN = 4, 8  # CPU: decode attention in up to 4 calls of >= 8 similar-length rows


def resolve_dtype(config: EngineConfig, device: torch.device, flags: Iterable[str] | None = None) -> torch.dtype:
    """The weights' and KV cache's dtype. ``auto``: bfloat16 on CUDA; on CPU bfloat16 only where the
    CPU computes it natively (``apiary.kernels.cpu.native_bf16`` of ``flags``, default this host's), else
    float32: emulated bf16 matmuls are slower than float32 (docs/benchmarks.md)."""
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu.native_bf16(cpu.host_flags() if flags is None else flags) else torch.float32


def resolve_weights(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> str:
    """The projections' weights: ``"dtype"``, ``"int8"`` or ``"bf16"`` (held in bf16, float32 sums). ``auto``: bf16
    for an ``auto`` engine that resolved to float32 on a CPU (no native bf16) where the bf16-weight kernel runs
    (``kernels/cpu_bf16w_gemm.py``: AVX2 + FMA); ``dtype`` otherwise. An engine asked for ``dtype="float32"``, the
    correctness reference, keeps float32 weights."""
    if config.weights != "auto":
        return config.weights
    held = (device.type == "cpu" and config.dtype == "auto" and dtype == torch.float32
            and ops.bf16w_gemm_available())
    return "bf16" if held else "dtype"


def resolve_kv_cache(config: EngineConfig, device: torch.device, dtype: torch.dtype, weights: str) -> torch.dtype:
    """What a cached K/V row is stored as: ``torch.int8`` (with scales), bf16 or ``dtype``. ``auto``: bf16 for a float32
    engine whose weights are held in bf16 (``weights == "bf16"``, the AVX2 hosts' default), ``dtype`` otherwise. Why:
    such an engine's decode step spent ~14 ms of 41 reading float32 keys and values (30 layers, 14 rows, ~330
    tokens: 235 MB); from bf16 it reads half, and its rows were products of bf16 weights already. A float32 engine
    with float32 weights, the correctness reference, keeps float32 rows."""
    if config.kv_cache_dtype == "int8":
        return torch.int8
    if config.kv_cache_dtype == "bf16" or (config.kv_cache_dtype == "auto" and weights == "bf16"
                                           and dtype == torch.float32 and device.type == "cpu"):
        return torch.bfloat16
    return dtype


def numba_runs_projections(config: EngineConfig) -> bool:
    """Whether a CPU engine's projections run in numba's kernels (int8 weights, bf16-held ones, or bf16 ones through
    the vdpbf16ps kernel, decided as ``Linear.of`` decides): then numba's loops go to oneTBB's pool (``threads.apply``)."""
    cpu_device = torch.device("cpu")
    dtype = resolve_dtype(config, cpu_device)
    weights = resolve_weights(config, cpu_device, dtype)
    if weights == "int8":
        return True
    if weights == "bf16" and dtype == torch.float32:
        return ops.bf16w_gemm_available()
    return dtype == torch.bfloat16 and cpu.native_bf16(cpu.host_flags()) is not None and ops.bf16_gemm_available()


class ModelRunner:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, max_model_len: int) -> None:
        try:
            self.device = torch.device(config.device)
            if self.device.type == "cuda" and not torch.cuda.is_available():
                raise EngineError("device 'cuda' requested but CUDA is not available")
        except RuntimeError as e:
            raise EngineError(f"bad device {config.device!r}: {e}") from e
        self.governor: threads.ThreadGovernor | None = None
        self.throttle: threads.SpinThrottle | None = None
        if self.device.type == "cpu":
            host_memory.keep_freed_memory()
            # The configured count, else torch's current one capped at the CPUs available.
            n = threads.apply(config.num_threads, numba_on_tbb=numba_runs_projections(config))
            if threads.STATE.waits == "adaptive" and n > 1:
                # Spinning waits while the CPU is the engine's, sleeping ones while others use a core.
                throttle = self.throttle = threads.SpinThrottle(n)
                self.governor = threads.ThreadGovernor(n, lambda free: throttle.on() if free < n else throttle.off())
        if config.weights == "bf16" and self.device.type != "cpu":
            raise EngineError("weights='bf16' is a CPU path (a float32 engine's weights held in bf16); on CUDA use "
                              "dtype bfloat16")
        if config.weights == "int8" and self.device.type != "cpu":
            raise EngineError("weights='int8' is a CPU path (oneDNN int8 GEMM); on CUDA use dtype bfloat16")
        if config.kv_cache_dtype == "int8" and self.device.type != "cpu":
            raise EngineError("kv_cache_dtype='int8' is a CPU path (the numba and torch attention kernels read it, "
                              "Triton's do not); on CUDA leave it 'auto'")
        self.dtype = resolve_dtype(config, self.device)
        if config.kv_cache_dtype == "bf16" and self.dtype != torch.bfloat16 and (
                self.device.type != "cpu" or self.dtype != torch.float32):
            raise EngineError(f"kv_cache_dtype='bf16' takes a bfloat16 engine, or a float32 one on CPU (the numba and "
                              f"torch kernels widen bf16 rows under float32 queries; Triton's read caches of the "
                              f"queries' dtype), not {str(self.dtype).removeprefix('torch.')} on {self.device.type}")
        if self.device.type == "cpu":
            flags = cpu.host_flags()
            log.info("engine dtype %s (asked %s); CPU features: %s; bf16 %s", str(self.dtype).removeprefix("torch."),
                     config.dtype, cpu.describe(flags),
                     f"native ({cpu.native_bf16(flags)})" if cpu.native_bf16(flags) else "emulated")
        self.block_size = config.block_size
        mc = self.model_config = checkpoint.config
        self.model = LlamaModel(mc, checkpoint.weights, self.device, self.dtype, max_positions=max_model_len,
                                cpu_attention_backend=config.cpu_attention)
        if self.device.type == "cpu" and self.model.layers and isinstance(self.model.layers[0].qkv, Linear):
            log.info("%s projections: %s", str(self.dtype).removeprefix("torch."), self.model.layers[0].qkv.path)
        self.weights = resolve_weights(config, self.device, self.dtype)
        if self.weights == "int8":
            self._quantize(config, checkpoint)
        if self.weights == "bf16":
            self._bf16_weights()
        if self.device.type == "cpu":
            self._refine_head(config)
            log.info("%s", self.model.stack_layers())
        kv_dtype = resolve_kv_cache(config, self.device, self.dtype, self.weights)
        quantized_kv = kv_dtype == torch.int8
        self.bytes_per_block = config.block_size * bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                                                                   kv_dtype, quantized_kv)
        budget = config.kv_cache_bytes or self._default_kv_bytes()
        self.num_blocks = budget // self.bytes_per_block
        if self.num_blocks < 1:
            raise EngineError(f"kv_cache_bytes={budget} holds no {self.bytes_per_block}-byte block")
        # One allocation for the whole pool (on huge pages where the host allows): per layer, K and V are views.
        self.kv_pool = KVPool(mc.num_layers, self.num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim,
                              kv_dtype, self.device, quantized_kv)
        self.kv_caches = self.kv_pool.layers
        log.info("KV cache: %d blocks of %d tokens, %s rows (%d bytes per token)", self.num_blocks, config.block_size,
                 str(self.kv_pool.dtype).removeprefix("torch."), self.bytes_per_block // config.block_size)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.max_model_len = max_model_len
        self.warm_up()
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and config.cuda_graphs and ops.resolve_backend(self.device) == "triton":
            self.graphs = DecodeGraphs(self.model, self.kv_caches, config.max_num_seqs, max_model_len,
                                       config.block_size, self.device)
            self.graphs.capture()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One decode row and one prefill row through block 0, then a prompt chunk of up to ``WARM_UP_PROMPT``
        tokens, before the engine serves anything: the first call of each kernel in a process loads it (numba's,
        from its on-disk cache, took 0.37 s for the int8 KV write; compiling one where the cache is cold, as on a
        fresh install, seconds), and the first request should not pay for that. Short and long query runs take
        different attention kernels on CPU (``kernels.cpu_attention``): a first request's prompt waited 5.9 s for
        the long one's compilation when only the short one was warmed. The blocks are free now and whoever gets
        them rewrites their slots, so the garbage left there is never read."""
        positions, meta, _ = paged_layout(np.zeros(2, dtype=np.int64), np.ones(2, dtype=np.int64), [[0], [0]],
                                          self.block_size, 1, self.device)
        self.model.forward(torch.zeros(2, dtype=torch.int64, device=self.device), positions, meta, self.kv_caches)
        if self.model.layer_stack is not None:  # decode rows only: the run of layers in one call, compiled here (~3 s)
            positions, meta, _ = paged_layout(np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64), [[0]],
                                              self.block_size, 1, self.device)
            self.model.forward(torch.zeros(1, dtype=torch.int64, device=self.device), positions, meta, self.kv_caches)
        n = min(WARM_UP_PROMPT, self.num_blocks * self.block_size, self.max_model_len)
        blocks = list(range(-(-n // self.block_size)))
        positions, meta, _ = paged_layout(np.zeros(1, dtype=np.int64), np.array([n], dtype=np.int64), [blocks],
                                          self.block_size, 0, self.device)
        hidden = self.model.forward(torch.zeros(n, dtype=torch.int64, device=self.device), positions, meta,
                                    self.kv_caches)
        self.model.logits(hidden[-1:])  # the head's kernels (an int8 head's refinement: ~2 s where numba's cache is cold)

    def _quantize(self, config: EngineConfig, checkpoint: Checkpoint) -> None:
        """W8A8 projections, SmoothQuant factors from a calibration pass over fixed prompts (``int8``)."""
        from apiary.cloud.engine.tokenizer import load_tokenizer

        start = time.perf_counter()
        int8.require_fast_gemm()  # before seconds of calibration
        tokenizer = load_tokenizer(Path(config.model_path).expanduser(), checkpoint.metadata or None)
        prompts = [tokenizer.encode(p) for p in int8.CALIBRATION_PROMPTS]
        stats = int8.calibrate(self.model, prompts, config.block_size)
        int8.quantize_model(self.model, stats)
        choice = int8.gemm_choice()
        kept = sorted(int8.dtype_layers(len(self.model.layers)))
        log.info("int8 weights (W8A8, SmoothQuant alpha %.2f over %d calibration tokens, %s GEMM, %d-bit weights; "
                 "decoder layers %s stay in %s; probe: %s) in %.1f s", int8.DEFAULT_ALPHA,
                 sum(map(len, prompts)), choice.backend, choice.weight_bits, kept or "none",
                 str(self.dtype).removeprefix("torch."), choice.reason, time.perf_counter() - start)

    def _bf16_weights(self) -> None:
        """``weights="bf16"`` (and ``auto`` where the CPU has no native bf16, ``resolve_weights``): a float32 engine's
        decoder projections hold their weights in bf16 and compute in float32
        (``Linear.bf16_weights``). Why: on CPUs without native bf16, ``auto`` is float32, and a decode step streamed
        424 MB of float32 weights through torch's sgemm; from bf16 it is 212 MB, at 2.7-3.8x sgemm's speed at 1-16
        rows and 1.1-1.3x at 256 (docs/kernels.md). A bf16 engine's weights are bf16 already: nothing to do."""
        if self.dtype != torch.float32:
            log.info("weights='bf16' holds a float32 engine's weights; this %s engine keeps its own",
                     str(self.dtype).removeprefix("torch."))
            return
        from apiary.cloud.engine.int8 import PROJECTIONS

        # the float32 weights the model held are (o_proj, down) the mapped checkpoint's: dropped once packed
        pages = host_memory.FilePages([lin.plain for layer in self.model.layers for name in PROJECTIONS
                                       if isinstance(lin := getattr(layer, name), Linear) and lin.plain is not None])
        for i, layer in enumerate(self.model.layers):
            for name in PROJECTIONS:
                lin = getattr(layer, name)
                held = Linear.bf16_weights(lin.weight, lin.bias) if isinstance(lin, Linear) else None
                if held is None:
                    raise EngineError(f"weights='bf16' needs numba compiling for AVX2 and FMA and our kernels "
                                      f"(APIARY_KERNELS=auto); layer {i}'s {name} cannot take it here")
                setattr(layer, name, held)
                if lin.plain is not None:
                    pages.release(lin.plain)
        log.info("float32 engine, decoder weights held in bf16: %s", self.model.layers[0].qkv.path)

    def _refine_head(self, config: EngineConfig) -> None:
        """``head="auto"``: a bf16 engine's or int8 weights' LM head ranks in int8 and computes the logits that
        can win exactly (``int8.RefinedHead``), where the grouped int8 kernel runs. Why: SmolLM2's head at 14 rows
        took 3.4 ms in bf16 against 2.4 ms so, and bf16's output is rounded (a step of 0.016 at logits of 2-4)
        where the refined candidates are float32 sums. A float32 engine, the reference, keeps its head, unless its
        weights are held in bf16 (``weights="bf16"``, a speed path: the float32 head is 113 MB a decode step)."""
        dtype = str(self.dtype).removeprefix("torch.")
        wanted = config.head == "auto" and (self.weights in ("int8", "bf16") or self.dtype == torch.bfloat16)
        refined = wanted and int8.quantize_head(self.model)
        log.info("LM head: %s", "ranks in int8, the logits that can win exact (float32 sums)" if refined else
                 f"in {dtype}" + ("" if not wanted else " (no grouped int8 kernel here)"))

    def _default_kv_bytes(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.8)
        return DEFAULT_CPU_KV_BYTES

    # ------------------------------------------------------------ one step

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat input ids, positions and attention metadata for ``batch``; plus, per sequence that
        reaches its last known token this step, the row of that token (-1 for the others)."""
        seqs, counts = batch.seqs, np.asarray(batch.num_new_tokens, dtype=np.int64)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        input_ids: list[int] = []
        for s, st, n in zip(seqs, starts.tolist(), counts.tolist()):
            input_ids.extend(s.token_ids[st:st + n])
            if s in batch.spec_tokens:  # verification: the last real token, then the draft tokens
                input_ids.extend(batch.spec_tokens[s])
        context = starts + counts
        nd = batch.num_decodes
        groups = None
        padded = self.device.type == "cpu" and not self.model.ragged_decode  # the torch reference pads
        if padded and nd >= 2 * DECODE_GROUP_MIN and (np.diff(context[:nd]) >= 0).all():
            # The scheduler orders decodes by context length: cut them into equal-count groups.
            k = min(DECODE_GROUPS, nd // DECODE_GROUP_MIN)
            edges = [round(i * nd / k) for i in range(k + 1)]
            groups = list(zip(edges, edges[1:]))
        positions, meta, cu = paged_layout(starts, counts, [s.block_table for s in seqs], self.block_size, nd,
                                           self.device, groups)
        last_rows = [int(cu[i + 1]) - 1 if context[i] == s.num_tokens else -1 for i, s in enumerate(seqs)]
        input_tensor = torch.from_numpy(np.asarray(input_ids, dtype=np.int64)).to(self.device)
        return input_tensor, positions, meta, last_rows

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, verify: list[Sequence] = (),
                should_stop: Callable[[], bool] | None = None,
                allowed: Callable[[list[Row]], torch.Tensor | None] | None = None
                ) -> tuple[list[Sequence], torch.Tensor | None, torch.Tensor | None]:
        """Run ``batch``; return the sequences whose known tokens are now all computed (they sample their
        next token) with their next-token logits ``[n, vocab]``, and for the speculating sequences
        ``verify`` (in that order) the logits of all their positions, last real token and draft tokens
        (``[sum(k_i + 1), vocab]``; None if there are none).
        ``should_stop``: see ``LlamaModel.forward`` (raises ``StepInterrupted``; nothing is sampled).
        ``allowed``: the grammar bitmask of sampling positions (``Row``s: a sequence and the drafts before the
        position), asked for only where the head computes exactly just the logits that can win
        (``int8.RefinedHead``): for verifications too, so that speculation keeps its tokens the plain step's."""
        for seq, blocks in batch.swap_out:
            self.swap_out(seq, blocks)
        for seq, blocks in batch.swap_in:
            self.swap_in(seq, blocks)
        if not batch.seqs:
            return [], None, None
        input_ids, positions, meta, last_rows = self.prepare(batch)
        hidden = self._forward(input_ids, positions, meta, should_stop)
        sampled = [s for s, row in zip(batch.seqs, last_rows) if row >= 0]
        spec_logits = None
        masks = allowed if allowed is not None and isinstance(self.model.head, int8.RefinedHead) else None
        if verify:
            end = {s: row for s, row in zip(batch.seqs, itertools.accumulate(batch.num_new_tokens))}
            rows = [r for s in verify for r in range(end[s] - 1 - len(batch.spec_tokens[s]), end[s])]
            positions = [Row(s, tuple(batch.spec_tokens[s][:j])) for s in verify
                         for j in range(len(batch.spec_tokens[s]) + 1)]  # as spec.verify's rows
            spec_logits = self.model.logits(hidden[rows], masks(positions) if masks else None)
        if not sampled:
            return [], None, spec_logits
        mask = masks([Row(s) for s in sampled]) if masks else None
        return sampled, self.model.logits(hidden[[row for row in last_rows if row >= 0]], mask), spec_logits

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 should_stop: Callable[[], bool] | None) -> torch.Tensor:
        """A graph replay for decode steps a captured bucket serves (while Triton is the backend the graphs
        were captured with), the eager forward otherwise. A replay is not interruptible: it takes milliseconds."""
        graphs = self.graphs
        if graphs is not None and ops.resolve_backend(self.device) == "triton":
            bucket = graphs.bucket(meta, input_ids.shape[0])
            if bucket is not None:
                return graphs.run(input_ids, positions, meta, bucket)
        return self.model.forward(input_ids, positions, meta, self.kv_caches, should_stop)

    @torch.inference_mode()
    def forward_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits ``[T, vocab]`` for every scheduled token (tests and speculative verification use this)."""
        input_ids, positions, meta, _ = self.prepare(batch)
        return self.model.logits(self.model.forward(input_ids, positions, meta, self.kv_caches))

    # ------------------------------------------------------------ swap

    def swap_out(self, seq: Sequence, blocks: list[int]) -> None:
        seq.swapped_kv = self.kv_pool.copy_out(blocks)

    def swap_in(self, seq: Sequence, blocks: list[int]) -> None:
        assert seq.swapped_kv is not None
        self.kv_pool.copy_in(blocks, seq.swapped_kv)
        seq.swapped_kv = None
