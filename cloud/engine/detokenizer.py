"""Incremental detokenization and stop strings: text grows per token without re-decoding everything.

Text is only released once it is final: a token that ends inside a multi-byte character
waits for the rest, and with stop strings the last ``len(longest stop) - 1`` characters wait
until they cannot start a stop string, so a stream never shows text that is later taken back.
"""
from __future__ import annotations

from apiary.cloud.engine.sequence import Sequence
from apiary.cloud.engine.tokenizer import Tokenizer

CONTEXT_TOKENS = 5  # prompt tokens decoded alongside so the first output token gets correct spacing


def start(seq: Sequence) -> None:
    seq.prefix_offset = max(0, seq.num_prompt_tokens - CONTEXT_TOKENS)
    seq.read_offset = seq.num_prompt_tokens


def update_text(tokenizer: Tokenizer, seq: Sequence, final: bool = False, end: int | None = None) -> None:
    """Append the text of newly generated tokens (up to ``end``) to ``seq.text``.

    Incomplete characters are held back unless ``final``.
    """
    ids = seq.token_ids if end is None else seq.token_ids[:end]
    prefix_text = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset])
    new_text = tokenizer.decode(ids[seq.prefix_offset:])
    if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
        seq.text += new_text[len(prefix_text):]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)


def find_stop(seq: Sequence, searched_from: int) -> bool:
    """Cut ``seq.text`` at the earliest stop string that appeared after ``searched_from``; True if one did."""
    best = -1
    for stop in seq.params.stop:
        i = seq.text.find(stop, max(0, searched_from - len(stop) + 1))
        if i >= 0 and (best < 0 or i < best):
            best = i
    if best >= 0:
        seq.text = seq.text[:best]
        return True
    return False


def release(seq: Sequence, final: bool) -> str:
    """The newly releasable text; while running, keep back what could still begin a stop string."""
    hold = 0 if final or not seq.params.stop else max(len(s) for s in seq.params.stop) - 1
    end = max(seq.released, len(seq.text) - hold)
    delta = seq.text[seq.released:end]
    seq.released = end
    return delta
