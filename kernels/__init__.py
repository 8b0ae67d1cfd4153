"""GPU kernels for the cloud engine, each beside a plain-torch reference.

The engine calls ``apiary.kernels.ops`` only: Triton kernels on CUDA, the torch references
(``apiary.kernels.reference``) on CPU, one interface. This package imports nothing but torch and
(lazily, only when a Triton kernel runs) triton, so CPU-only machines need no triton at all.
"""
