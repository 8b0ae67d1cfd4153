"""Engine and model configuration: what the operator chooses, and what the checkpoint dictates."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from apiary.cloud.engine.errors import EngineError
from apiary.cloud.engine.spec.config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHTS = ("auto", "dtype", "int8", "bf16")
HEADS = ("auto", "dtype")
KV_CACHE_DTYPES = ("auto", "dtype", "bf16", "int8")


@dataclass(slots=True)
class EngineConfig:
    model_path: str | Path
    adapter_path: str | Path | None = None  # a LoRA adapter folder (cloud.engine.adapter), merged at load
    device: str = "cpu"
    dtype: str = "auto"  # auto: float32 on CPU (the correctness reference), bfloat16 on CUDA
    # decoder projections' weights: "auto" (bf16 where ``dtype="auto"`` resolved to float32 on a CPU without native
    # bf16 and the bf16-weight kernel runs, else "dtype": model_runner.resolve_weights), in ``dtype``, or "int8"
    # (W8A8 with SmoothQuant, scales per 64 inputs where AVX-512 VNNI or AVX2 is, CPU only: cloud.engine.int8), or
    # "bf16": a float32 engine's projection weights held in bf16, float32 rows, products and sums (AVX2 + FMA, CPU
    # only: kernels/cpu_bf16w_gemm.py; a bf16 engine's weights are bf16 already)
    weights: str = "auto"
    # the LM head: "auto" ranks in int8 and computes the logits that can win exactly (int8.RefinedHead) on CPU
    # where the grouped int8 kernel runs, for bf16 engines and int8 weights (faster, and closer to float32 than
    # bf16's rounded logits), and float32 engines with weights="bf16"; float32 engines, the reference, keep theirs.
    # "dtype": the head in ``dtype``
    head: str = "auto"
    # the KV cache: "dtype" stores rows in ``dtype``; "bf16" stores a float32 engine's rows in bf16 (CPU only: half
    # the bytes decode attention reads, twice the tokens); "int8" stores int8 rows with per-token, per-head scales
    # (CPU only: cloud.engine.kv_cache), about 2x the tokens of bf16 and 4x those of float32 per byte. "auto": bf16
    # where the weights are held in bf16 for float32 rows (``weights`` resolved to "bf16", a speed path), else
    # ``dtype`` (model_runner.resolve_kv_cache)
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int | None = None  # KV pool budget; None: 1 GiB on CPU, 90% of free memory on CUDA
    max_num_batched_tokens: int = 1024  # token budget per step (chunked prefill keeps decodes flowing)
    max_num_seqs: int = 64  # running sequences per step
    max_waiting: int = 4096  # queue depth before add_request raises EngineOverloaded
    max_model_len: int | None = None  # default: the model's context length
    enable_prefix_caching: bool = True
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    swap_space_bytes: int = 1 << 30  # host memory for swapped-out KV; when full, preemption recomputes
    aging_steps: int = 256  # a waiting request gains one priority level per this many engine steps
    num_threads: int | None = None  # torch intra-op threads on CPU; None leaves torch's default
    cpu_attention: Literal["numba", "torch"] = "numba"  # CPU decode attention: numba kernel or torch reference
    cuda_graphs: bool = True  # CUDA + Triton: decode steps replay captured graphs (cloud.engine.cuda_graphs)
    seed: int = 0  # for requests that sample without their own seed
    speculative: SpeculativeConfig | None = None  # None: plain decoding (see docs/speculative.md)

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_waiting", "aging_steps")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise EngineError(f"EngineConfig.{name} must be an int >= 1, got {value!r}")
        if self.dtype not in DTYPES:
            raise EngineError(f"EngineConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.weights not in WEIGHTS:
            raise EngineError(f"EngineConfig.weights must be one of {WEIGHTS}, got {self.weights!r}")
        if self.head not in HEADS:
            raise EngineError(f"EngineConfig.head must be one of {HEADS}, got {self.head!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineError(f"EngineConfig.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise EngineError(f"EngineConfig.preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.cpu_attention not in ("numba", "torch"):
            raise EngineError(f"EngineConfig.cpu_attention must be 'numba' or 'torch', got {self.cpu_attention!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise EngineError(f"EngineConfig.cuda_graphs must be a bool, got {self.cuda_graphs!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise EngineError(f"EngineConfig.kv_cache_bytes must be > 0, got {self.kv_cache_bytes!r}")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise EngineError(f"EngineConfig.speculative must be a SpeculativeConfig, got {self.speculative!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise EngineError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len!r}")


@dataclass(slots=True)
class ModelConfig:
    """Architecture hyper-parameters of a Llama-family decoder (Llama, SmolLM2, Qwen2, Mistral)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # only {"rope_type": "llama3", ...} is understood
    max_position: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    sliding_window: int | None = None
    architecture: str = "llama"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise EngineError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise EngineError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
