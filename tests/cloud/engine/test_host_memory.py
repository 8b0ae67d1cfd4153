"""Host memory for the CPU engine: freed temporaries stay in the process, the KV pool is advised onto huge pages."""
from __future__ import annotations

import ctypes
import ctypes.util
import platform

import pytest

import torch

from apiary.cloud.engine.host_memory import keep_freed_memory, zeros
from apiary.kernels import huge_pages
from apiary.kernels.huge_pages import HUGE_PAGE

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


@pytest.mark.skipif(not GLIBC or huge_pages.thp_mode() in ("never", "unknown"), reason="no transparent huge pages here")
def test_kv_pool_memory_is_eligible_for_huge_pages() -> None:
    # ~100 MiB: a fresh mapping of its own (never one advised by an earlier pool)
    shape = (8, 2, 1024, 16, 3, 64)
    pool = zeros(shape, torch.bfloat16, torch.device("cpu"))
    assert pool.shape == shape and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    inner = -(-pool.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # the first whole 2 MiB page inside the tensor
    assert huge_pages.mapping_of(inner).get("THPeligible") == "1"
    assert not pool.any()


@pytest.mark.skipif(platform.system() != "Linux", reason="/proc/self/smaps is Linux's")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_a_pool_reads_as_zeros_and_becomes_resident_only_where_written(dtype: torch.dtype) -> None:
    """The KV pool is not written at load: a GiB-sized default pool would be resident from the start."""
    shape = (4, 2, 512, 16, 3, 64)  # 12-48 MiB
    pool = zeros(shape, dtype, torch.device("cpu"))
    mapping = huge_pages.mapping_of(pool.data_ptr())
    assert int(mapping["Rss"].split()[0]) == 0  # nothing touched yet
    pool[0, 0, 7] = 1  # one block of one layer's keys
    written = int(huge_pages.mapping_of(pool.data_ptr())["Rss"].split()[0])
    assert 0 < written <= HUGE_PAGE >> 10  # at most one 2 MiB page, in KiB
    assert pool[0, 0, 7].eq(1).all() and int(pool.ne(0).sum()) == 16 * 3 * 64
    assert zeros((3,), dtype, torch.device("cpu")).eq(0).all()  # small ones: plain zeros
