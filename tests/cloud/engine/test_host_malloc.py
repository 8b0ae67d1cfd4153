"""The CPU engine keeps freed temporaries in the process: big allocations come from the reusable heap."""
from __future__ import annotations

import ctypes
import ctypes.util
import platform

import pytest

from cloud.engine.host_malloc import keep_freed_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


@pytest.mark.skipif(not GLIBC, reason="the tuning is glibc's mallopt")
def test_freed_megabytes_stay_in_the_heap_instead_of_being_unmapped() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("glibc older than 2.33 has no mallinfo2")
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    assert keep_freed_memory() and keep_freed_memory()  # applied once, then cached
    size = 16 << 20  # far above glibc's default mmap threshold (128 KiB, at most 32 MiB when dynamic)
    mapped = libc.mallinfo2().hblkhd
    block = libc.malloc(size)
    try:
        assert block
        assert libc.mallinfo2().hblkhd == mapped  # served from the heap, not from fresh mmap pages
    finally:
        libc.free(block)
    assert libc.mallinfo2().fordblks >= size  # and kept for the next temporary
