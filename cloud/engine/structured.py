"""Grammar-constrained decoding: per-request matchers and the step's allowed-token bitmask.

The grammar engine is llguidance (chosen over xgrammar by measurement, see docs/engine.md:
no compile-time precomputation, so a new schema costs no step, and no dependencies). Each
constrained request gets a matcher that has consumed exactly its output tokens so far; it
lives on the ``Sequence``, so preemption (recompute or swap) keeps it as it is: K/V is
recomputed, tokens never change. Per step the engine asks for the bitmask of every row that
samples (a row = a sequence plus drafted tokens, see ``sampling.Row``), computed for all
plain rows at once by llguidance's executor; rows past drafted tokens advance the matcher
through them, take the mask and roll back. After the step the tokens that were kept are
consumed. Grammar compilation (schema -> llguidance grammar) is cached per spec.

A matcher that has finished (the grammar is complete and its end token consumed) or failed
allows only the end-of-generation tokens, so no row is ever left with nothing to sample.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import torch

from apiary.cloud.engine.errors import EngineError, RequestRejected
from apiary.cloud.engine.sampling import Row
from apiary.cloud.engine.sampling_params import StructuredOutput
from apiary.cloud.engine.sequence import Sequence

COMPILE_CACHE = 256  # compiled grammars kept (by kind and spec)
MAX_SPEC_CHARS = 64_000


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - a dependency of the project
        raise EngineError("structured outputs need the llguidance package") from e
    return llguidance


class StructuredOutputs:
    """Matchers of the engine's constrained requests; built lazily on the first one (~1 s tokenizer import)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer  # cloud.engine.tokenizer.Tokenizer
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._ll_tokenizer = None
        self._executor = None
        self._compiled: OrderedDict[StructuredOutput, str] = OrderedDict()
        self.stop_ids = sorted(t for t in tokenizer.stop_token_ids if t is not None and t < vocab_size)
        self._end_only = torch.zeros(self.words, dtype=torch.int32)
        for t in self.stop_ids:
            self._end_only[t // 32] |= _bit(t % 32)

    # ------------------------------------------------------------ compile

    def _ll(self):
        if self._ll_tokenizer is None:
            ll = _llguidance()
            backend = self._tokenizer._tok  # a tokenizers.Tokenizer
            self._ll_tokenizer = ll.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=self.stop_ids)
            self._executor = ll.LLExecutor()
        return self._ll_tokenizer

    def compile(self, spec: StructuredOutput) -> str:
        """The llguidance grammar for ``spec`` (cached); RequestRejected with the reason if it is invalid."""
        grammar = self._compiled.get(spec)
        if grammar is not None:
            self._compiled.move_to_end(spec)
            return grammar
        if len(spec.spec) > MAX_SPEC_CHARS:
            raise RequestRejected(f"{spec.kind} spec is {len(spec.spec)} characters; the limit is {MAX_SPEC_CHARS}")
        ll = _llguidance()
        try:
            if spec.kind == "json_object":
                grammar = ll.grammar_from("json_schema", '{"type": "object"}')
            elif spec.kind == "json_schema":
                json.loads(spec.spec)
                grammar = ll.grammar_from("json_schema", spec.spec)
            elif spec.kind == "choice":
                choices = json.loads(spec.spec)
                if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                    raise ValueError("choice spec must be a JSON list of strings")
                grammar = ll.grammar_from("choice", spec.spec)
            elif spec.kind == "regex":
                grammar = ll.grammar_from("regex", spec.spec)
            else:
                grammar = ll.grammar_from("grammar", spec.spec)
            is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar, self._ll())
        except (ValueError, TypeError, RuntimeError) as e:
            raise RequestRejected(f"invalid {spec.kind}: {e}") from None
        if is_error:
            raise RequestRejected(f"invalid {spec.kind}: {'; '.join(messages) or 'rejected by the grammar engine'}")
        self._compiled[spec] = grammar
        if len(self._compiled) > COMPILE_CACHE:
            self._compiled.popitem(last=False)
        return grammar

    # ------------------------------------------------------------ per request

    def start(self, seq: Sequence) -> None:
        """Give a constrained ``seq`` its matcher, consuming any output it already has."""
        spec = seq.params.structured
        if spec is None:
            return
        if not self.stop_ids:
            raise RequestRejected("this model has no end-of-generation token, so it cannot end a structured output")
        grammar = self.compile(spec)
        matcher = _llguidance().LLMatcher(self._ll(), grammar, log_level=0)
        if matcher.is_error():
            raise RequestRejected(f"invalid {spec.kind}: {matcher.get_error()}")
        if seq.output_token_ids and not matcher.consume_tokens(seq.output_token_ids):
            raise RequestRejected(f"the output so far does not match the {spec.kind}")
        seq.grammar = matcher

    def valid_prefix_of(self, spec: StructuredOutput, tokens: list[int]) -> bool:
        """Whether ``tokens`` are a prefix of some output that ``spec`` allows (checks, tests)."""
        matcher = _llguidance().LLMatcher(self._ll(), self.compile(spec), log_level=0)
        return matcher.validate_tokens(tokens) == len(tokens)

    def accept(self, seq: Sequence, token: int) -> bool:
        """Consume ``token`` (kept this step); True when the grammar is now complete (the request is done)."""
        m = seq.grammar
        if m is None:
            return False
        if not m.is_stopped():
            m.consume_token(token)
        return m.is_stopped() or m.is_error()

    def valid_prefix(self, seq: Sequence, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar allows after ``seq``'s output (nothing consumed)."""
        m = seq.grammar
        if m is None:
            return len(tokens)
        if m.is_stopped() or m.is_error():
            return 0
        return m.validate_tokens(tokens)

    def bitmask(self, rows: list[Row]) -> torch.Tensor | None:
        """``[len(rows), W]`` allowed-token bitmask (int32), all ones for unconstrained rows; None if none is."""
        if not any(r.seq.grammar is not None for r in rows):
            return None
        self._ll()
        mask = torch.full((len(rows), self.words), -1, dtype=torch.int32)
        plain: list[tuple[Any, int]] = []
        for i, row in enumerate(rows):
            m = row.seq.grammar
            if m is None:
                continue
            if m.is_stopped() or m.is_error():
                mask[i] = self._end_only
            elif not row.drafted:
                plain.append((m, i))
            else:
                n = m.try_consume_tokens(list(row.drafted))
                if n < len(row.drafted) or m.is_stopped() or m.is_error():
                    mask[i] = self._end_only
                else:
                    _fill(m, mask, i)
                m.rollback(n)
        if plain:
            from llguidance.torch import fill_next_token_bitmask_par

            fill_next_token_bitmask_par(self._executor, plain, mask)
        return mask


def _bit(j: int) -> int:
    """Bit j of an int32 word, as a Python int that fits int32 (bit 31 is the sign bit)."""
    return (1 << j) if j < 31 else -(1 << 31)


def _fill(matcher: Any, mask: torch.Tensor, index: int) -> None:
    v = mask[index]
    matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())
