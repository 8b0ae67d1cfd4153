"""Apiary's own PyTorch inference engine: paged KV cache, prefix caching, priority-preemptive batching.

Knows nothing of MQTT or HTTP and takes model paths (GGUF file or Hugging Face folder), not
registry names. Attention, norms, rotary and KV writes go through ``kernels.ops``.
"""
# First, before anything below imports torch or numba: the OpenMP wait policy and thread counts
# are read once, when each OpenMP runtime loads (cloud/engine/threads.py says why).
from cloud.engine import threads as _threads

_threads.install()

from cloud.engine.async_engine import AsyncEngine
from cloud.engine.config import EngineConfig, ModelConfig
from cloud.engine.errors import EngineError, EngineOverloaded, RequestRejected
from cloud.engine.llm_engine import LLMEngine
from cloud.engine.outputs import RequestMetrics, RequestOutput
from cloud.engine.sampling_params import SamplingParams
from cloud.engine.spec.config import SpeculativeConfig

__all__ = ["AsyncEngine", "EngineConfig", "EngineError", "EngineOverloaded", "LLMEngine", "ModelConfig",
           "RequestMetrics", "RequestOutput", "RequestRejected", "SamplingParams", "SpeculativeConfig"]
