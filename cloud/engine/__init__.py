"""Apiary's own PyTorch inference engine: paged KV cache, prefix caching, priority-preemptive batching.

Knows nothing of MQTT or HTTP and takes model paths (GGUF file or Hugging Face folder), not
registry names. Attention, norms, rotary and KV writes go through ``apiary.kernels.ops``.
"""
# First, before anything below imports torch or numba: the OpenMP wait policy and thread counts
# are read once, when each OpenMP runtime loads (cloud/engine/threads.py says why).
from apiary.cloud.engine import threads as _threads

_threads.install()

from apiary.cloud.engine.async_engine import AsyncEngine
from apiary.cloud.engine.config import EngineConfig, ModelConfig
from apiary.cloud.engine.errors import EngineError, EngineOverloaded, RequestRejected
from apiary.cloud.engine.llm_engine import LLMEngine
from apiary.cloud.engine.outputs import RequestMetrics, RequestOutput
from apiary.cloud.engine.sampling_params import SamplingParams
from apiary.cloud.engine.spec.config import SpeculativeConfig

__all__ = ["AsyncEngine", "EngineConfig", "EngineError", "EngineOverloaded", "LLMEngine", "ModelConfig",
           "RequestMetrics", "RequestOutput", "RequestRejected", "SamplingParams", "SpeculativeConfig"]
