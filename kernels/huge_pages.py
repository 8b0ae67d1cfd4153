"""Weights and the KV pool in 2 MiB pages: arrays the CPU kernels stream every step, in memory that asks Linux for
huge pages.

Why: a decode step reads every projection's weight once (SmolLM2-135M: ~212 MB in bf16). Packed weights came
from ``torch``/``numpy`` allocations on glibc's heap in 4 KiB pages, so streaming them walked ~52,000 pages a
step, past what the TLBs hold. Collapsing the engine's memory into 2 MiB pages in place (``MADV_COLLAPSE``)
took a 14-row decode step of the bf16 engine from 17-20 ms to 15.6 ms on the Zen 4 host (docs/benchmarks.md).

How: ``empty`` maps fresh private anonymous memory, aligned to 2 MiB, and advises ``MADV_HUGEPAGE`` before
anything touches it, so the first writes fault in huge pages where transparent huge pages are ``always`` or
``madvise`` (most distributions' default). Where they are ``never``, or off Linux, or for arrays under 2 MiB,
it is an ordinary ``np.empty``: the kernels read the same bytes either way. ``zeros`` maps such memory too (the
KV pool, through ``cloud.engine.host_memory``), never writing it: it reads as zeros and becomes resident as the
cache fills.
"""
from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

import numpy as np
import torch

HUGE_PAGE = 2 << 20
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_ENABLED) -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), or ``unknown``."""
    try:
        text = path.read_text()
    except OSError:
        return "unknown"
    chosen = [word[1:-1] for word in text.split() if word.startswith("[") and word.endswith("]")]
    return chosen[0] if chosen else "unknown"


def _advisable() -> bool:
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always",
                                                                                                    "madvise")


def _mapped(dims: tuple[int, ...], dtype: np.dtype, nbytes: int, advise: bool) -> np.ndarray | None:
    """An array over a fresh private anonymous mapping, 2 MiB-aligned (``advise``: with ``MADV_HUGEPAGE``): the
    kernel's zero pages until written. None where no mapping is to be had (a map-count or address-space limit)."""
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    try:
        memory = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return None
    anchor = ctypes.c_char.from_buffer(memory)
    base = ctypes.addressof(anchor)
    del anchor  # the export would keep the mapping from ever closing
    offset = -base % HUGE_PAGE
    if advise:
        try:
            memory.madvise(mmap.MADV_HUGEPAGE, offset, span)
        except OSError:  # a kernel or container that refuses the advice: 4 KiB pages, the same bytes
            pass
    return np.frombuffer(memory, np.uint8, nbytes, offset).view(dtype).reshape(dims)


def _size(shape: int | tuple[int, ...], dtype: np.dtype | type) -> tuple[tuple[int, ...], np.dtype, int]:
    dtype = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    return dims, dtype, int(np.prod(dims, dtype=np.int64)) * dtype.itemsize


def empty(shape: int | tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """An uninitialised C-contiguous array whose memory asks for 2 MiB pages (see the module's docstring)."""
    dims, dtype, nbytes = _size(shape, dtype)
    mapped = _mapped(dims, dtype, nbytes, advise=True) if nbytes >= HUGE_PAGE and _advisable() else None
    return np.empty(dims, dtype) if mapped is None else mapped


def zeros(shape: int | tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """A zeroed C-contiguous array, on 2 MiB pages where ``empty`` would be, whose pages the process takes only as
    they are first written: a fresh mapping reads as zeros without touching it, where ``np.zeros`` of a
    reused heap writes every byte (the KV pool: a GiB resident from the start, mostly never used). The memory is
    committed when mapped: under strict overcommit (``vm.overcommit_memory=2``) a pool that does not fit fails
    here, at load; under the default heuristic, as for any memory a process grows into, only when written."""
    dims, dtype, nbytes = _size(shape, dtype)
    linux = sys.platform.startswith("linux")
    mapped = _mapped(dims, dtype, nbytes, advise=_advisable()) if nbytes >= HUGE_PAGE and linux else None
    return np.zeros(dims, dtype) if mapped is None else mapped


def copy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU ``tensor``'s values (any strides) in an ``empty`` array, C order, copied by torch's parallel copy."""
    out = empty(tuple(tensor.shape), torch.empty(0, dtype=tensor.dtype).numpy().dtype)
    torch.from_numpy(out).copy_(tensor)
    return out


def stacked(arrays: list[np.ndarray]) -> np.ndarray:
    """``np.stack(arrays)`` into an ``empty`` array."""
    first = arrays[0]
    out = empty((len(arrays), *first.shape), first.dtype)
    return np.stack(arrays, out=out)


def mapping_of(address: int) -> dict[str, str]:
    """The ``/proc/self/smaps`` fields (``Rss``, ``AnonHugePages``, ``THPeligible``, ...) of the mapping holding
    ``address``; empty where there is none or the file cannot be read (off Linux)."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    inside = False
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and not head.endswith(":"):
            if inside:
                break
            lo, hi = (int(part, 16) for part in head.split("-"))
            inside = lo <= address < hi
        elif inside:
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    return fields


def eligible(array: np.ndarray) -> bool:
    """Whether the kernel may back ``array``'s memory with huge pages (``THPeligible`` of its mapping)."""
    return mapping_of(array.__array_interface__["data"][0]).get("THPeligible") == "1"
