"""The LM head's refinement (kernels.cpu_head through ops.refine_logits): each row's top candidates of an
approximate head, and a grammar row's top allowed tokens, get exact logits; the rest stay as they were."""
from __future__ import annotations

import pytest
import torch

from apiary.kernels import ops
from apiary.kernels.errors import KernelError

pytest.importorskip("numba")

VOCAB, HIDDEN = 1000, 64


def head(dtype: torch.dtype, rows: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden, weight, exact, approx)``: exact float32 logits and an approximation off by up to ~0.05."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, HIDDEN, generator=g).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.3).to(dtype)
    exact = hidden.float() @ weight.float().T
    approx = exact + (torch.rand(exact.shape, generator=g) - 0.5) * 0.1
    return hidden, weight, exact, approx


def bitmask(allowed: list[list[int]]) -> torch.Tensor:
    """Packed int32 words (bit j of word w: token 32w + j) allowing each row's tokens; None-like rows (all ones)
    for empty lists."""
    words = (VOCAB + 31) // 32
    out = torch.zeros(len(allowed), words, dtype=torch.int64)
    for i, tokens in enumerate(allowed):
        if not tokens:
            out[i] = 0xFFFFFFFF
        for t in tokens:
            out[i, t // 32] |= 1 << (t % 32)
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 8, 32])
def test_each_rows_top_candidates_become_exact_and_the_rest_stay(dtype: torch.dtype, k: int) -> None:
    hidden, weight, exact, approx = head(dtype)
    logits = approx.clone()
    assert ops.refine_logits(hidden, weight, logits, candidates=k) is logits
    top = approx.topk(k, dim=1).indices
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    changed = logits != approx
    assert int(changed.sum(1).max()) <= k
    untouched = torch.ones_like(changed).scatter_(1, top, False)
    assert torch.equal(logits[untouched], approx[untouched])


def test_a_grammar_row_also_gets_its_best_allowed_tokens_exactly() -> None:
    """Row 0's grammar allows only tokens far below its top (the approximation's 40 smallest); row 1 has no
    grammar (all ones) and gets only its top candidates; row 2 allows three tokens: fewer than k."""
    hidden, weight, exact, approx = head(torch.float32, rows=3)
    low = approx[0].argsort()[:40].tolist()
    mask = bitmask([low, [], [5, 77, 999]])
    logits = approx.clone()
    ops.refine_logits(hidden, weight, logits, mask, candidates=8)
    best_allowed = sorted(low, key=lambda t: -float(approx[0, t]))[:8]
    torch.testing.assert_close(logits[0, best_allowed], exact[0, best_allowed], rtol=1e-5, atol=1e-5)
    assert int((logits[1] != approx[1]).sum()) <= 8
    torch.testing.assert_close(logits[2, [5, 77, 999]], exact[2, [5, 77, 999]], rtol=1e-5, atol=1e-5)
    # without the mask, row 0's allowed tokens keep their approximations
    plain = approx.clone()
    ops.refine_logits(hidden, weight, plain, candidates=8)
    assert torch.equal(plain[0, best_allowed], approx[0, best_allowed])


def test_the_argmax_under_a_grammar_is_the_exact_one() -> None:
    """Where the approximation would pick the wrong allowed token (two allowed tokens close together, the
    approximation ordering them the other way), the refined logits pick the exact head's."""
    hidden, weight, exact, approx = head(torch.float32, rows=1)
    a, b = exact[0].argsort()[10:12].tolist()  # two tokens below the top, exact[b] > exact[a]
    approx[0, a], approx[0, b] = exact[0, b] + 0.01, exact[0, a]  # the approximation swaps their order
    assert int(approx[0, [a, b]].argmax()) == 0
    logits = approx.clone()
    ops.refine_logits(hidden, weight, logits, bitmask([[a, b]]), candidates=4)
    assert [a, b][int(logits[0, [a, b]].argmax())] == b


def test_bad_inputs_are_refused() -> None:
    hidden, weight, _, approx = head(torch.float32)
    with pytest.raises(KernelError, match="shapes do not fit"):
        ops.refine_logits(hidden[:, :10], weight, approx.clone())
    with pytest.raises(KernelError, match="contiguous float32"):
        ops.refine_logits(hidden, weight, approx.to(torch.bfloat16))
    with pytest.raises(KernelError, match="float32 or bfloat16"):
        ops.refine_logits(hidden.half(), weight, approx.clone())
    with pytest.raises(KernelError, match="bitmask must be int32"):
        ops.refine_logits(hidden, weight, approx.clone(), torch.zeros(5, 32, dtype=torch.int64))
    with pytest.raises(KernelError, match="candidates must be >= 1"):
        ops.refine_logits(hidden, weight, approx.clone(), candidates=0)
    empty = torch.empty(0, VOCAB)
    assert ops.refine_logits(hidden[:0], weight, empty) is empty
