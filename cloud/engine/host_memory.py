"""Host memory for CPU inference: keep freed temporaries, and back the KV pool with huge pages.

Why keep freed memory: glibc serves allocations above a (dynamic, small) threshold with fresh
``mmap`` pages and returns freed heap tops to the OS. A CPU forward pass allocates and frees
MB-sized temporaries hundreds of times per step, and on these VMs every first touch of a fresh
page is a page fault: an RMSNorm of 1,024 bf16 rows measured 4.7 ms with the defaults and 0.35 ms
with ``mallopt`` raising both thresholds. This is what preloading tcmalloc or jemalloc buys (vLLM's
CPU docs recommend it), done in-process. It is process-wide, so the engine applies it once, on
CPU only, and only where the C library is glibc.

Why huge pages: decode attention gathers 128-byte K/V rows from all over a GiB-sized pool, and
with 4 KiB pages nearly every block read is a TLB miss. Where transparent huge pages are on
``madvise`` (as here), the pool is advised ``MADV_HUGEPAGE`` before its first touch. Decode
attention over a 30-layer pool measured 15-20% faster on 2 MiB pages in isolation; in the whole
engine benchmark the difference stayed inside this machine's run-to-run noise. The pool is a fresh mapping
(``apiary.kernels.huge_pages.zeros``), advised ``MADV_HUGEPAGE`` before its first touch and never written
whole: it reads as zeros and becomes resident block by block as the cache fills (it was zeroed at load,
a GiB resident from the start). The weights the CPU kernels stream each step take 2 MiB pages through the
same module, where they are packed.
"""
from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import math
import mmap
import platform
from pathlib import Path

import numpy as np
import torch

from apiary.kernels import huge_pages

MADV_DONTNEED = 4  # from <sys/mman.h> (Linux)
M_TRIM_THRESHOLD = -1  # from glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 << 20  # allocations below this come from the reusable heap
TRIM_THRESHOLD_BYTES = 1 << 30  # free heap tops up to this size stay with the process


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    return libc


@functools.cache
def keep_freed_memory() -> bool:
    """Apply the malloc tuning once; True if glibc accepted it (False elsewhere: macOS, musl, Windows)."""
    libc = _libc()
    return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros``; on CPU in a fresh mapping (``apiary.kernels.huge_pages.zeros``): on huge pages where the
    host allows it, and resident only as far as it is written (CUDA memory is left alone)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(huge_pages.zeros((nbytes,), np.uint8)).view(dtype).view(shape)


def return_freed_memory() -> bool:
    """Give the heap's free pages back to the OS once (``malloc_trim``): what loading a model freed (float32
    conversions, packing) stays with the process under ``keep_freed_memory``'s thresholds, ~200 MB for SmolLM2 that
    no step reuses. True if glibc returned any."""
    libc = _libc()
    return libc is not None and bool(libc.malloc_trim(0))


class FilePages:
    """Lets a model drop the pages of checkpoint tensors it has copied, where that loses nothing.

    Why: the checkpoint cache maps its float32 safetensors file (538 MB for SmolLM2) and every page the
    conversion to bf16 reads stays resident in this process until the checkpoint is dropped, after the engine's
    warm-up: the peak of an engine's load. ``release`` tells the kernel it may drop a tensor's pages
    (``MADV_DONTNEED``), but only inside a private file mapping that holds no private copies (smaps' ``Anonymous``
    0 kB when this object was made: nothing wrote to it): there a dropped page reads back from the file,
    unchanged, if anything touches it again (a draft model built from the same checkpoint). Anonymous memory,
    the heap, or a mapping something wrote to are left alone (dropping would zero or lose them). The
    checkpoint cache replaces entries by renaming new files into place, never rewriting a mapped one.
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.clean: list[tuple[int, int]] = []  # [start, end) of the clean private file mappings holding them
        if _libc() is None or not tensors:
            return
        addresses = sorted({t.data_ptr() for t in tensors if t.device.type == "cpu" and t.numel()})
        try:
            text = Path("/proc/self/smaps").read_text()
        except OSError:
            return
        span: tuple[int, int] | None = None
        for line in text.splitlines():
            head, _, rest = line.partition(" ")
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(part, 16) for part in head.split("-"))
                fields = rest.split()
                # "perms offset dev inode path": a named file (not [heap], [stack], anonymous), private
                private_file = len(fields) >= 5 and fields[0].endswith("p") and fields[4].startswith("/")
                at = bisect.bisect_left(addresses, lo)  # the first tensor at or after the mapping's start
                span = (lo, hi) if private_file and at < len(addresses) and addresses[at] < hi else None
            elif span is not None and head == "Anonymous:":
                if rest.split()[0] == "0":
                    self.clean.append(span)
                span = None

    def release(self, tensor: torch.Tensor) -> int:
        """Drop the whole pages of ``tensor``'s memory from the process where ``__init__`` found them clean; the
        bytes dropped (0 elsewhere)."""
        libc = _libc()
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        if libc is None or not any(lo <= start and end <= hi for lo, hi in self.clean):
            return 0
        page = mmap.PAGESIZE
        first, last = -(-start // page) * page, end // page * page
        if last <= first or libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED):
            return 0
        return last - first
