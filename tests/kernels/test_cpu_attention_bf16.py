"""Prompt attention over bf16 caches through ``vdpbf16ps`` (``cpu_attention_bf16.runs``) against the float64 oracle
and ``cpu_attention._runs``, whose contract it keeps."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from apiary.kernels import cpu_attention, ops
from tests.kernels.cases import dense_attention, make_case, tolerance

bf16 = pytest.importorskip("apiary.kernels.cpu_attention_bf16")
pytestmark = pytest.mark.skipif(not bf16.available(), reason="numba does not compile vdpbf16ps for this CPU")


def _long_runs(kernel, case, window=None):  # type: ignore[no-untyped-def]
    """``kernel`` over the case's runs longer than ``SHORT_QUERIES``; the output, and the indices of the rows it wrote."""
    out = np.zeros(tuple(case.q.shape), np.float32)
    cu = case.cu_seqlens_q.to(torch.int32).contiguous()
    seqs = torch.nonzero((cu[1:] - cu[:-1]) > cpu_attention.SHORT_QUERIES).flatten().to(torch.int32)
    kernel(case.q.float().contiguous().numpy(), cpu_attention._cache_array(case.k_cache),
           cpu_attention._cache_array(case.v_cache), cpu_attention._NO_SCALES, cpu_attention._NO_SCALES, False,
           case.block_tables.to(torch.int32).contiguous().numpy(), cu.numpy(),
           case.context_lens.to(torch.int32).contiguous().numpy(), seqs.numpy(), np.float32(case.scale),
           int(window or 0), out)
    rows = torch.cat([torch.arange(int(cu[s]), int(cu[s + 1])) for s in seqs.tolist()] or [torch.zeros(0, dtype=torch.long)])
    return torch.from_numpy(out), rows


@pytest.mark.parametrize("ctx,q_lens,hq,hkv,d,window", [
    ([300, 140, 97], [300, 60, 17], 9, 3, 64, None),    # SmolLM2's heads: a fresh prompt, a chunk over a prefix
    ([61, 40], [61, 40], 9, 3, 64, None),              # odd and even lengths: a zero key after the odd one
    ([260, 75], [200, 75], 6, 2, 32, 50),               # long runs under a window
    ([91, 33], [91, 33], 4, 1, 128, 7),                 # Llama 3's head dim, a window that starts on odd keys
    ([18, 40], [17, 23], 4, 4, 16, 1),                  # a window of one token, the shortest long run
])
def test_matches_dense_attention_and_the_float32_kernel(ctx, q_lens, hq, hkv, d, window):
    """Within bf16 rounding of the float64 oracle (the probabilities are bf16 in the weighted sums), and of
    ``_runs``, which computes the same in float32."""
    case = make_case(ctx, q_lens, hq, hkv, d, 16, torch.bfloat16, seed=3)
    ours, rows = _long_runs(bf16.runs, case, window)
    theirs, _ = _long_runs(cpu_attention._runs, case, window)
    exact = dense_attention(case, window)
    torch.testing.assert_close(ours[rows].double(), exact[rows], **tolerance(torch.bfloat16))
    torch.testing.assert_close(ours[rows], theirs[rows], **tolerance(torch.bfloat16))
    assert (ours[rows].double() - exact[rows]).abs().max() < 8e-3  # values of unit scale: about one bf16 ulp
    assert not ours[torch.isin(torch.arange(case.q.shape[0]), rows, invert=True)].any()  # other rows untouched


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_runs_match_dense_attention(data):
    hkv = data.draw(st.sampled_from([1, 2, 3]))
    hq = hkv * data.draw(st.sampled_from([1, 3, 4]))
    q_lens = data.draw(st.lists(st.integers(17, 90), min_size=1, max_size=4))
    ctx = [q + data.draw(st.integers(0, 60)) for q in q_lens]
    window = data.draw(st.one_of(st.none(), st.integers(1, 40)))
    case = make_case(ctx, q_lens, hq, hkv, data.draw(st.sampled_from([16, 32, 64])), data.draw(st.sampled_from([4, 16])),
                     torch.bfloat16, seed=data.draw(st.integers(0, 1000)))
    ours, rows = _long_runs(bf16.runs, case, window)
    torch.testing.assert_close(ours[rows].double(), dense_attention(case, window)[rows], **tolerance(torch.bfloat16))


def test_ops_serves_long_runs_over_bf16_caches_from_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ops.paged_prefill_attention`` and a CPU step (``cpu_attention.PreparedPrefill``) send runs longer than
    ``SHORT_QUERIES`` over bf16 caches here, and those over float32 caches to ``_runs``."""
    served: list[str] = []
    for module, name in ((bf16, "runs"), (cpu_attention, "_runs")):
        real = getattr(module, name)

        def spy(*args, _name=name, _real=real):  # type: ignore[no-untyped-def]
            served.append(_name)
            return _real(*args)

        monkeypatch.setattr(module, name, spy)
    for dtype, kernel in ((torch.bfloat16, "runs"), (torch.float32, "_runs")):
        case = make_case([40, 90], [3, 50], 9, 3, 64, 16, dtype)
        served.clear()
        out = ops.paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.cu_seqlens_q,
                                          case.context_lens, case.scale)
        assert served == [kernel]
        torch.testing.assert_close(out.double(), dense_attention(case), **tolerance(dtype))
        prepared = cpu_attention.PreparedPrefill(case.block_tables, case.cu_seqlens_q, case.context_lens, case.scale,
                                                 None, 9, 64)
        into = torch.empty_like(case.q)
        prepared(case.q, cpu_attention._cache_array(case.k_cache), cpu_attention._cache_array(case.v_cache), None, into)
        assert served == [kernel, kernel] and torch.equal(into, out)


def test_decode_scores_over_bf16_keys_take_vdpbf16ps() -> None:
    """``cpu_attention._group_dots`` (the grouped decode kernels' scores) computes bf16 keys' products with
    ``vdpbf16ps`` here, and float32 keys' with FMAs; both give the scaled dot products."""
    import numba
    from numba import njit

    @njit
    def scores(q, keys, scale):  # type: ignore[no-untyped-def]
        out = np.zeros((3, 4), np.float32)
        cpu_attention._group_dots(out, 0, 4, q, 0, keys, 0, 64, 4, 3, 64, 4, scale)
        return out

    rng = np.random.default_rng(0)
    q = torch.from_numpy(rng.standard_normal((3, 64)).astype(np.float32)).bfloat16()  # a bf16 engine's queries
    keys = torch.from_numpy(rng.standard_normal((4, 64)).astype(np.float32)).bfloat16()
    expected = (q.double() @ keys.double().T * 0.125).numpy()
    got = {}
    for name, cache in (("bf16", cpu_attention._cache_array(keys)), ("float32", keys.float().numpy())):
        got[name] = scores(q.float().numpy(), cache, np.float32(0.125))
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-5)
        signature = next(sig for sig in scores.signatures if sig[1].dtype == numba.from_dtype(cache.dtype))
        instructions = [line.split()[0] for line in scores.inspect_asm(signature).splitlines() if line.startswith("\t")]
        assert ("vdpbf16ps" in instructions) == (name == "bf16"), name  # (the symbols carry this test's name)
