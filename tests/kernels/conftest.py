"""Kernel tests run every Triton kernel on CPU in the Triton interpreter, and compiled on CUDA when present.

Triton decides interpreted vs compiled when a kernel module is imported, so the switch is set
here, before any test imports one. On a CUDA machine nothing is set: the CUDA variants run the
compiled kernels and the CPU variants skip (run ``TRITON_INTERPRET=1 pytest tests/kernels`` there
to exercise the interpreter instead).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from apiary.kernels import ops  # noqa: E402


def _triton_runs_on(device: str) -> str | None:
    """Why Triton cannot run on ``device`` in this process, or None if it can."""
    if not ops.triton_available():
        return "triton is not installed"
    from apiary.kernels import triton_support

    if device == "cuda":
        if not torch.cuda.is_available():
            return "no CUDA device"
        if triton_support.INTERPRETED:
            return "TRITON_INTERPRET=1: the CUDA variant would only re-run the interpreter"
        return None
    if not triton_support.INTERPRETED:
        return "Triton on CPU needs TRITON_INTERPRET=1 before the kernels are imported"
    return None


@pytest.fixture(params=["cpu", "cuda"])
def device(request) -> str:
    """The device a Triton-kernel test runs on, skipped where Triton cannot run there."""
    reason = _triton_runs_on(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


@pytest.fixture
def triton_backend():
    """Force the Triton kernels through the public interface, restoring the previous choice after."""
    previous = ops._backend
    ops.set_backend("triton")
    yield
    ops._backend = previous
