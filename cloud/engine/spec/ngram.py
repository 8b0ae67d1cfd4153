"""Prompt-lookup proposals: continue the text the way it continued the last time the same words appeared.

Sensor-agent answers are structured (JSON keys, enum values, phrases quoted from the prompt)
and answers to similar events repeat from one request to the next. So the last n tokens
(n = ngram_max down to ngram_min) are looked up in two places: the sequence's own prompt and
output, and a bounded history of recently finished outputs (each kept with the few prompt
tokens before it, so the very first output tokens can match too). The longer match wins; on
a tie the history does, since it holds real answers where the prompt holds instructions.

Both are indexes from every n-gram to the end of its latest occurrence, updated as tokens
arrive, so a lookup costs O(ngram_max) whatever the lengths. No match means no proposal and
no cost. Verification makes any proposal safe: the history changes speed, never outputs.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence as Seq


@dataclass(slots=True)
class NgramIndex:
    """n-gram -> end (exclusive) of its latest occurrence in ``tokens[:indexed]``."""

    ngram_min: int
    ngram_max: int
    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # ends < indexed are in the index

    def extend(self, tokens: Seq[int], upto: int) -> None:
        """Index every n-gram ending before ``upto`` (the text only ever grows)."""
        for end in range(self.indexed, upto):
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                self.last_end[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, upto)

    def match(self, tokens: list[int]) -> tuple[int, int]:
        """``(n, end)``: the longest suffix of ``tokens`` seen strictly earlier, and where it ended; (0, 0) if none."""
        length = len(tokens)
        self.extend(tokens, length)  # every end but `length` itself: the suffix must match strictly earlier
        for n in range(min(self.ngram_max, length), self.ngram_min - 1, -1):
            end = self.last_end.get(tuple(tokens[length - n:]))
            if end is not None:
                return n, end
        return 0, 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        n, end = self.match(tokens)
        return tokens[end:end + k] if n and k > 0 else []


class NgramHistory:
    """Recently finished outputs, indexed by n-gram; the oldest are forgotten past ``capacity`` tokens."""

    def __init__(self, ngram_min: int, ngram_max: int, capacity: int) -> None:
        self.ngram_min, self.ngram_max, self.capacity = ngram_min, ngram_max, capacity
        self.texts: OrderedDict[int, list[int]] = OrderedDict()
        self.last_end: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (text id, end)
        self.num_tokens = 0
        self.frozen = False  # benchmarks freeze it so repeated runs of one prompt cannot feed each other
        self._next_id = 0

    def _grams(self, text: list[int]):
        for end in range(1, len(text)):
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                yield tuple(text[end - n:end]), end

    def add(self, text: list[int]) -> None:
        if self.frozen or self.capacity <= 0 or len(text) < 2:
            return
        text = text[-self.capacity:]
        text_id, self._next_id = self._next_id, self._next_id + 1
        self.texts[text_id] = text
        self.num_tokens += len(text)
        for gram, end in self._grams(text):
            self.last_end[gram] = (text_id, end)
        while self.num_tokens > self.capacity:
            old_id, old = self.texts.popitem(last=False)
            self.num_tokens -= len(old)
            for gram, _ in self._grams(old):
                if self.last_end.get(gram, (None,))[0] == old_id:
                    del self.last_end[gram]

    def match(self, tokens: list[int]) -> tuple[int, list[int], int]:
        """``(n, text, end)`` for the longest suffix of ``tokens`` in the history; ``(0, [], 0)`` if none."""
        for n in range(min(self.ngram_max, len(tokens)), self.ngram_min - 1, -1):
            hit = self.last_end.get(tuple(tokens[len(tokens) - n:]))
            if hit is not None:
                return n, self.texts[hit[0]], hit[1]
        return 0, [], 0

    def clear(self) -> None:
        self.texts.clear()
        self.last_end.clear()
        self.num_tokens = 0


class NgramProposer:
    """Per-sequence indexes (keyed by the sequence object) plus the shared history of finished outputs."""

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4, history_tokens: int = 0) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.indices: dict[object, NgramIndex] = {}
        self.history = NgramHistory(ngram_min, ngram_max, history_tokens)

    def propose(self, key: object, tokens: list[int], k: int) -> list[int]:
        index = self.indices.get(key)
        if index is None:
            index = self.indices[key] = NgramIndex(self.ngram_min, self.ngram_max)
        n_own, end = index.match(tokens)
        n_hist, text, hist_end = self.history.match(tokens)
        if k <= 0 or (n_own == 0 and n_hist == 0):
            return []
        if n_hist >= n_own:
            return text[hist_end:hist_end + k]
        return tokens[end:end + k]

    def finish(self, key: object, tokens: list[int], num_prompt_tokens: int) -> None:
        """A sequence is done: drop its index and remember its output (with a little prompt context)."""
        self.indices.pop(key, None)
        if len(tokens) > num_prompt_tokens:
            self.history.add(tokens[max(0, num_prompt_tokens - self.ngram_max):])

    def drop(self, key: object) -> None:
        self.indices.pop(key, None)
