"""The engine's token logprobs in OpenAI's two shapes: chat (``content``) and completions (legacy).

Token text is what the tokenizer decodes the one id to; ``bytes`` are its UTF-8 bytes, or
for a token that is only part of a character (byte-level BPE, byte-fallback pieces) the raw
bytes it stands for, so a client can join them back into the character. A logprob of
``-inf`` (an alternative the grammar ruled out) is reported as -9999.0, as OpenAI and vLLM do.
"""
from __future__ import annotations

import functools
import math
import re
from typing import Any, Iterable

FLOOR = -9999.0
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (printable stand-in character -> byte), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(printable, printable)), 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


@functools.lru_cache(maxsize=1 << 16)
def token_text(tokenizer: Any, token_id: int) -> tuple[str, list[int]]:
    """The token's text and bytes (cached per tokenizer and id)."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if "\ufffd" in text:  # part of a multi-byte character: recover the bytes from the vocabulary piece
        piece = tokenizer.token_to_piece(token_id) or ""
        if m := _BYTE_PIECE.fullmatch(piece):
            return text, [int(m.group(1), 16)]
        alphabet = _byte_level_alphabet()
        if piece and all(ch in alphabet for ch in piece):
            return text, [alphabet[ch] for ch in piece]
    return text, list(text.encode("utf-8"))


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


def chat_logprobs(tokenizer: Any, logprobs: Iterable[Any]) -> list[dict[str, Any]]:
    """``choices[].logprobs.content`` for ``apiary.cloud.engine.sampling.TokenLogprob`` items."""
    content = []
    for lp in logprobs:
        text, raw = token_text(tokenizer, lp.token_id)
        top = []
        for token_id, value in lp.top:
            alt, alt_raw = token_text(tokenizer, token_id)
            top.append({"token": alt, "logprob": _value(value), "bytes": alt_raw})
        content.append({"token": text, "logprob": _value(lp.logprob), "bytes": raw, "top_logprobs": top})
    return content


def completion_logprobs(tokenizer: Any, logprobs: Iterable[Any], offset: int = 0) -> dict[str, list]:
    """OpenAI's legacy completion logprobs; ``offset``: characters of the choice's text before these tokens.

    ``top_logprobs`` per token maps the text of the chosen token and of the alternatives to their
    logprobs (vLLM's: the chosen token is always there).
    """
    doc: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in logprobs:
        text, _ = token_text(tokenizer, lp.token_id)
        top = {text: _value(lp.logprob)}
        for token_id, value in lp.top:
            top.setdefault(token_text(tokenizer, token_id)[0], _value(value))
        doc["tokens"].append(text)
        doc["token_logprobs"].append(_value(lp.logprob))
        doc["top_logprobs"].append(top)
        doc["text_offset"].append(offset)
        offset += len(text)
    return doc
