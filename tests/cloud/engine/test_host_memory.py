"""Host memory for the CPU engine: freed temporaries stay in the process (and the load's go back once), the KV pool
is advised onto huge pages, a mapped checkpoint's pages are dropped once copied where that loses nothing."""
from __future__ import annotations

import ctypes
import ctypes.util
import platform
from pathlib import Path

import pytest

import torch

from apiary.cloud.engine.host_memory import FilePages, keep_freed_memory, return_freed_memory, zeros
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


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_the_heap_gives_back_what_the_load_freed() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    assert keep_freed_memory()
    size = 32 << 20
    block = libc.malloc(size)  # on the heap (under the raised mmap threshold), then freed and kept
    assert block
    ctypes.memset(block, 1, size)  # resident
    libc.free(block)
    assert return_freed_memory()  # glibc returned pages to the OS


def _rss_kib(tensor: torch.Tensor) -> int:
    return int(huge_pages.mapping_of(tensor.data_ptr())["Rss"].split()[0])


def _mapped_tensors(tmp_path: Path) -> dict[str, torch.Tensor]:
    """Two 8 MiB float32 tensors read back through safetensors' private file mapping (as the checkpoint cache
    reads), every page touched."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    save_file({"a": torch.randn(2048, 1024, generator=g), "b": torch.randn(2048, 1024, generator=g)},
              tmp_path / "w.safetensors")
    tensors = load_file(tmp_path / "w.safetensors")
    for t in tensors.values():
        assert float(t.sum()) == float(t.sum())  # touch every page
    return tensors


@pytest.mark.skipif(not GLIBC, reason="madvise through glibc, smaps from Linux")
def test_copied_checkpoint_pages_are_dropped_and_read_back_unchanged(tmp_path: Path) -> None:
    tensors = _mapped_tensors(tmp_path)
    a, b = tensors["a"], tensors["b"]
    before, kept = a.clone(), _rss_kib(a)
    assert kept >= (16 << 10) - 8  # both tensors resident
    dropped = FilePages([a, b]).release(a)
    assert (8 << 20) - 2 * 4096 <= dropped <= 8 << 20  # a's whole pages
    assert _rss_kib(a) <= kept - (dropped >> 10)
    assert torch.equal(a, before)  # read back from the file


@pytest.mark.skipif(not GLIBC, reason="madvise through glibc, smaps from Linux")
def test_memory_that_would_lose_data_is_left_alone(tmp_path: Path) -> None:
    tensors = _mapped_tensors(tmp_path)
    a = tensors["a"]
    a[0, 0] = 123.0  # a private copy of one page: dropping it would bring the file's value back
    pages = FilePages([a])
    assert pages.release(a) == 0 and float(a[0, 0]) == 123.0
    heap = torch.randn(2048, 1024)  # anonymous memory: dropping would zero it
    copy = heap.clone()
    assert FilePages([heap]).release(heap) == 0 and torch.equal(heap, copy)
    assert FilePages([]).release(copy) == 0  # asked about nothing, releases nothing
