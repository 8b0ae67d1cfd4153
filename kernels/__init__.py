"""The cloud engine's kernels: Triton for GPUs, numba CPU decode attention, plain-torch references.

The engine calls ``apiary.kernels.ops`` only, which chooses: Triton kernels on CUDA; on CPU the
numba decode-attention kernel (``apiary.kernels.cpu_attention``) and the torch references
(``apiary.kernels.reference``). This package imports torch; triton only lazily when a Triton
kernel runs and numba only when a CPU decode runs, so CPU-only machines need no triton at all.
Before any kernel module loads, ``numba_cache.ensure`` makes sure numba has a writable place for
the compiled kernels.
"""
from apiary.kernels import numba_cache

numba_cache.ensure()
