"""Weights in memory that asks for 2 MiB pages: what ``empty``/``copy``/``stacked`` return, where they fall back to
plain numpy, and that the kernels' packed weights and a decode run's stack come from them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from apiary.kernels import huge_pages

THP = huge_pages.thp_mode() in ("always", "madvise")
needs_thp = pytest.mark.skipif(not THP, reason=f"transparent huge pages are {huge_pages.thp_mode()!r} here")


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


@pytest.mark.parametrize(("text", "mode"), [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                                            ("always madvise [never]", "never"), ("", "unknown")])
def test_the_mode_is_the_bracketed_word(tmp_path, text: str, mode: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "enabled"
    path.write_text(text)
    assert huge_pages.thp_mode(path) == mode
    assert huge_pages.thp_mode(tmp_path / "absent") == "unknown"


@needs_thp
@pytest.mark.parametrize("dtype", [np.int16, np.uint8, np.float32])
def test_a_large_array_starts_on_a_huge_page_in_an_eligible_mapping(dtype) -> None:  # type: ignore[no-untyped-def]
    shape = (3, 1000, 1000)
    array = huge_pages.empty(shape, dtype)
    assert array.shape == shape and array.dtype == dtype
    assert array.flags["C_CONTIGUOUS"] and array.flags["WRITEABLE"] and array.flags["ALIGNED"]
    assert _address(array) % huge_pages.HUGE_PAGE == 0
    array[...] = 7  # touched after the advice: the kernel may fault in 2 MiB pages
    assert huge_pages.eligible(array)
    assert (array == 7).all()


def test_small_arrays_and_hosts_without_huge_pages_get_plain_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    small = huge_pages.empty((64, 64), np.float32)
    assert small.base is None and small.shape == (64, 64)  # np.empty owns its memory
    monkeypatch.setattr(huge_pages, "thp_mode", lambda path=None: "never")
    large = huge_pages.empty(4 << 20, np.uint8)
    assert large.base is None and large.shape == (4 << 20,)


def test_a_refused_mapping_or_advice_still_gives_a_usable_array(monkeypatch: pytest.MonkeyPatch) -> None:
    """``mmap`` failing (a map-count limit) falls back to the heap; ``madvise`` refused keeps the mapping."""
    if not huge_pages._advisable():
        pytest.skip("no huge-page path here to refuse")

    def no_mapping(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(12, "Cannot allocate memory")

    with monkeypatch.context() as patch:
        patch.setattr(huge_pages.mmap, "mmap", no_mapping)
        heap = huge_pages.empty((3 << 20,), np.uint8)
    assert heap.base is None and heap.shape == (3 << 20,)

    class Refusing(huge_pages.mmap.mmap):  # type: ignore[misc, name-defined]
        def madvise(self, *args):  # type: ignore[no-untyped-def]
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(huge_pages.mmap, "mmap", Refusing)
    mapped = huge_pages.empty((3 << 20,), np.uint8)
    mapped[...] = 3
    assert _address(mapped) % huge_pages.HUGE_PAGE == 0 and (mapped == 3).all()


def test_copy_gives_a_strided_tensors_values_in_c_order() -> None:
    g = torch.Generator().manual_seed(0)
    tensor = torch.randint(-2000, 2000, (48, 32, 1024), generator=g, dtype=torch.int16)
    copied = huge_pages.copy(tensor.permute(1, 0, 2))
    assert copied.dtype == np.int16 and copied.flags["C_CONTIGUOUS"]
    assert torch.equal(torch.from_numpy(copied), tensor.permute(1, 0, 2).contiguous())


def test_stacked_is_np_stack() -> None:
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 255, (256, 96, 16, 4), dtype=np.uint8) for _ in range(5)]
    out = huge_pages.stacked(parts)
    assert np.array_equal(out, np.stack(parts))
    assert not np.shares_memory(out, parts[0])


@needs_thp
def test_packed_weights_and_a_decode_runs_stack_are_in_eligible_memory() -> None:
    """The arrays a decode step streams: the int8 kernel's packed weight (the LM head's ranking layout), the bf16
    kernel's, and the stacked projections of a run of layers."""
    gemm = pytest.importorskip("apiary.kernels.cpu_int8_gemm")
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(4096, 576, generator=g)  # 2.4 MB as int8: whole 2 MiB pages inside it
    assert huge_pages.eligible(gemm.quantize_weight(weight).packed)
    bf16 = pytest.importorskip("apiary.kernels.cpu_bf16_gemm")
    assert huge_pages.eligible(bf16.pack(weight).packed)
    layers = pytest.importorskip("apiary.kernels.cpu_decode_layers")
    if not gemm.runnable():
        pytest.skip("the grouped int8 GEMM does not run on this CPU: no int8 stack to build")
    shapes = {"qkv": (1536, 1024), "o_proj": (1024, 1024), "gate_up": (4096, 1024), "down": (1024, 2048)}
    stacked = [{name: gemm.quantize_weight(torch.randn(shape, generator=g)) for name, shape in shapes.items()}
               for _ in range(2)]
    norms = [torch.ones(1024) for _ in range(2)]
    stack = layers.stack(0, stacked, norms, norms)
    assert all(huge_pages.eligible(packed) for packed in stack.packed)


@pytest.mark.skipif(not huge_pages.mapping_of(id(object())), reason="no /proc/self/smaps here")
def test_a_mappings_fields_come_from_smaps() -> None:
    array = np.ones(1 << 16, np.float32)
    fields = huge_pages.mapping_of(_address(array))
    assert int(fields["Rss"].split()[0]) > 0 and "THPeligible" in fields
    assert huge_pages.mapping_of(0) == {}  # nothing is mapped at address 0
