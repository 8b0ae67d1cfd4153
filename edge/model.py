"""The local model: llama.cpp on an INT4 GGUF, a JSON grammar, and per-token logprobs at full speed.

Why a hand-written decode loop instead of ``Llama.create_chat_completion``: the
high-level path needs ``logits_all=True`` for logprobs and does full-vocabulary work per
token in Python (6x slower than this loop in ``apiary bench edge``). This loop keeps
``logits_all=False``, reads the last logits as a numpy view, and asks the grammar only
about the ``top_k`` best candidates (plus end-of-sequence); only when none of them is
allowed is the grammar applied to the whole vocabulary. That is llama.cpp's own "sample,
then check the grammar" strategy and exact for greedy decoding, so every finished answer
parses; it runs as fast as llama.cpp's grammar-first sampler chain, with logprobs on top.

Per token it records the model's own log-probability of the chosen token (raw
distribution), the log-probability among the grammar-allowed candidates (the "choice"
logprob: how sure the model is between the answers it may give) and that
distribution's entropy. The prompt's longest common prefix with the previous prompt
is kept in the KV cache, so the fixed system message is evaluated once.

The prompt style the model is asked in (``apiary.shared.prompting.build_messages``) is the model's
own: a task-tuned GGUF records it under ``apiary.prompt_style`` (``apiary quantize`` writes
it), anything else reads the worked-examples prompt.
"""
from __future__ import annotations

import ctypes
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from apiary.edge.errors import EdgeError
from apiary.shared.protocol import ChatMessage
from apiary.shared.prompting import ACTION_JSON_SCHEMA, PROMPT_STYLE_KEY, PROMPT_STYLES

if TYPE_CHECKING:
    from apiary.edge.settings import EdgeSettings

def _never_swap_stdio() -> None:
    """Load models without llama-cpp-python's ``suppress_stdout_stderr``.

    With ``verbose=False`` it wraps every load in a context that points the process's fds 1 and 2 and
    ``sys.stdout``/``sys.stderr`` at /dev/null and back: process-wide, from whatever thread loads. The agent
    loads a new model on its OTA thread while other threads log and print, so their output vanished for the
    length of a load, and two overlapping loads could leave fd 1 on /dev/null for good. llama.cpp's own log
    lines go through its log callback, which ``verbose=False`` already limits to errors, so nothing is lost
    by not swapping.
    """
    import contextlib

    import llama_cpp._internals
    import llama_cpp.llama

    def keep_stdio(disable: bool = True) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    llama_cpp.llama.suppress_stdout_stderr = keep_stdio
    llama_cpp._internals.suppress_stdout_stderr = keep_stdio


_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


def resolve_prompt_style(argument: str | None, metadata: dict[str, str], name: str) -> tuple[str, str]:
    """The prompt style to ask a model in and where it came from: ``argument`` when given, else the
    GGUF's :data:`~shared.prompting.PROMPT_STYLE_KEY` metadata, else ``examples``. Raises
    :class:`EdgeError` for a style that is not one of :data:`~shared.prompting.PROMPT_STYLES`."""
    if argument is not None:
        if argument not in PROMPT_STYLES:
            raise EdgeError(f"prompt style must be one of {', '.join(PROMPT_STYLES)}, got {argument!r}")
        return argument, "argument"
    value = metadata.get(PROMPT_STYLE_KEY)
    if value is None:
        return "examples", f"default (no {PROMPT_STYLE_KEY} in the GGUF)"
    if value not in PROMPT_STYLES:
        raise EdgeError(f"{name} has {PROMPT_STYLE_KEY}={value!r} in its metadata, not one of "
                        f"{', '.join(PROMPT_STYLES)}")
    return value, f"GGUF metadata {PROMPT_STYLE_KEY}"


def action_grammar() -> str:
    """GBNF for :data:`ACTION_JSON_SCHEMA`, with strings that cannot hold control characters
    or escapes (``json.loads`` rejects raw newlines, and a 135M model loves them)."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    gbnf = json_schema_to_gbnf(json.dumps(ACTION_JSON_SCHEMA))
    char_rule = re.compile(r"^char ::= .*$", re.MULTILINE)
    if not char_rule.search(gbnf):
        raise EdgeError("unexpected grammar from json_schema_to_gbnf: no 'char' rule to restrict")
    return char_rule.sub(lambda _: r'char ::= [^"\\\x7F\x00-\x1F]', gbnf)


@dataclass(slots=True)
class Generation:
    """One constrained completion and what the model thought of each token."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # log p(token) under the model's full distribution
    choice_logprobs: list[float] = field(default_factory=list)  # log p(token) among grammar-allowed candidates
    entropies: list[float] = field(default_factory=list)  # entropy (nats) of the allowed-candidate distribution
    offsets: list[int] = field(default_factory=list)  # byte offset of each token in text.encode()
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the KV cache
    finished: bool = False  # the grammar completed (end of generation) within max_tokens
    full_checks: int = 0  # steps where no top-k candidate fit the grammar and the whole vocabulary was checked
    cpu_s: float = 0.0  # process CPU time spent, all threads (energy = cpu_s x watts per core)
    wall_s: float = 0.0
    prefill_s: float = 0.0  # part of wall_s spent evaluating the uncached prompt tokens

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of the whole call (prefill included)."""
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decode = self.wall_s - self.prefill_s
        return self.completion_tokens / decode if decode > 0 else 0.0


class LocalModel:
    """A GGUF model in llama.cpp, answering chats with grammar-constrained greedy decoding.

    ``prompt_style`` is the ``build_messages`` style callers ask it in: ``prompt_style`` when given,
    else the GGUF's ``apiary.prompt_style``, else ``examples`` (``prompt_style_source`` says which)."""

    def __init__(self, path: str | Path, *, n_ctx: int = 1024, threads: int = 2, top_k: int = 40,
                 grammar: str | None = None, prompt_style: str | None = None) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        _never_swap_stdio()
        self.path = Path(path)
        if not self.path.is_file():
            raise EdgeError(f"model file not found: {self.path}")
        if prompt_style is not None:  # a bad argument fails before the model is loaded
            resolve_prompt_style(prompt_style, {}, self.path.name)
        try:
            self.llm = Llama(str(self.path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                             n_batch=512, logits_all=False, verbose=False)
        except (ValueError, RuntimeError) as e:
            raise EdgeError(f"llama.cpp could not load {self.path}: {e}") from None
        self.n_ctx = n_ctx
        self.threads = threads
        self.top_k = top_k
        self.n_vocab = self.llm.n_vocab()
        self._vocab = self.llm._model.vocab
        template = self.llm.metadata.get("tokenizer.chat_template")
        if not template:
            raise EdgeError(f"{self.path.name} has no chat template in its metadata")
        try:
            self.prompt_style, self.prompt_style_source = resolve_prompt_style(
                prompt_style, self.llm.metadata or {}, self.path.name)
        except EdgeError:
            self.llm.close()
            raise
        eos = self.llm._model.token_get_text(self.llm.token_eos())
        bos = self.llm._model.token_get_text(self.llm.token_bos()) if self.llm.token_bos() >= 0 else ""
        self._formatter = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
        self.grammar_text = grammar if grammar is not None else action_grammar()
        # Reused buffers: the full candidate array (rarely needed) and the top-k one.
        self._full = _token_array(self.n_vocab)
        self._full_np = np.frombuffer(self._full, dtype=_TOKEN_DATA)
        self._all_ids = np.arange(self.n_vocab, dtype=np.int32)
        self._piece_cache: dict[int, bytes] = {}
        self._eos = self.llm.token_eos()  # always a candidate: once the JSON is complete only it is allowed

    @classmethod
    def from_settings(cls, settings: "EdgeSettings", path: str | Path | None = None) -> "LocalModel":
        """The model ``[edge]`` describes (``path`` instead of its model file when given): context,
        threads, top-k and prompt style (``auto``: the GGUF's own)."""
        return cls(path if path is not None else settings.resolve_model_path(), n_ctx=settings.n_ctx,
                   threads=settings.threads, top_k=settings.top_k, prompt_style=settings.model_prompt_style)

    @property
    def version(self) -> str:
        """Model identity for birth certificates and answers: file name and size."""
        return f"{self.path.name}:{self.path.stat().st_size}"

    def set_threads(self, threads: int) -> None:
        """Fewer threads when the battery is low (slower, but less peak power)."""
        if threads != self.threads:
            self.llm._ctx.set_n_threads(threads, threads)
            self.threads = threads

    def prompt_text(self, messages: Sequence[ChatMessage]) -> str:
        return self._formatter(messages=[m.model_dump() for m in messages]).prompt

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def generate(self, messages: Sequence[ChatMessage], *, max_tokens: int = 96) -> Generation:
        """Greedy, grammar-constrained completion of ``messages`` with per-token statistics.

        Raises :class:`EdgeError` when the prompt and ``max_tokens`` do not fit the context.
        """
        import llama_cpp

        tokens = self.tokenize(self.prompt_text(messages))
        if len(tokens) + max_tokens > self.n_ctx:
            raise EdgeError(f"prompt of {len(tokens)} tokens + {max_tokens} to generate exceeds the "
                            f"{self.n_ctx}-token context")
        cpu0, wall0 = time.process_time(), time.perf_counter()
        llm = self.llm
        cached = _common_prefix(llm.input_ids[: llm.n_tokens], tokens)
        cached = min(cached, len(tokens) - 1)  # evaluate at least one token to get fresh logits
        llm.n_tokens = cached
        grammar = llama_cpp.llama_sampler_init_grammar(self._vocab, self.grammar_text.encode(), b"root")
        if not grammar:
            raise EdgeError("llama.cpp rejected the action grammar")
        out = Generation(text="", prompt_tokens=len(tokens), cached_tokens=cached)
        pieces: list[bytes] = []
        offset = 0
        k = min(self.top_k, self.n_vocab)
        top = _token_array(k + 1)
        top_np = np.frombuffer(top, dtype=_TOKEN_DATA)
        try:
            llm.eval(tokens[cached:])
            out.prefill_s = time.perf_counter() - wall0
            for _ in range(max_tokens):
                logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(self.n_vocab,))
                token, choice_lp, entropy, full = self._pick(grammar, logits, top, top_np, k)
                out.full_checks += full
                if token < 0:
                    break  # the grammar allows nothing (cannot happen with a well-formed grammar)
                peak = float(logits.max())
                log_z = peak + float(np.log(np.exp(logits - peak, dtype=np.float64).sum()))
                llama_cpp.llama_sampler_accept(grammar, token)
                if llama_cpp.llama_vocab_is_eog(self._vocab, token):
                    out.finished = True
                    break
                out.token_ids.append(token)
                out.logprobs.append(float(logits[token]) - log_z)
                out.choice_logprobs.append(choice_lp)
                out.entropies.append(entropy)
                out.offsets.append(offset)
                piece = self._piece(token)
                pieces.append(piece)
                offset += len(piece)
                llm.eval([token])
        finally:
            llama_cpp.llama_sampler_free(grammar)
        out.text = b"".join(pieces).decode("utf-8", errors="replace")
        out.cpu_s = time.process_time() - cpu0
        out.wall_s = time.perf_counter() - wall0
        return out

    def _pick(self, grammar, logits: np.ndarray, top, top_np: np.ndarray, k: int) -> tuple[int, float, float, bool]:
        """Best grammar-allowed token, its log-prob among allowed candidates, their entropy, and
        whether the whole vocabulary had to be checked.

        Exact for greedy decoding: if any of the k best tokens is allowed, the best of them is
        the best allowed token overall, since every other token has a lower logit.
        """
        import llama_cpp

        cand = np.argpartition(logits, -k)[-k:]
        n = k
        if self._eos not in cand:
            cand = np.append(cand, self._eos)
            n = k + 1
        top_np["id"][:n] = cand
        top_np["logit"][:n] = logits[cand]
        arr = llama_cpp.llama_token_data_array(data=top, size=n, selected=-1, sorted=False)
        llama_cpp.llama_sampler_apply(grammar, ctypes.byref(arr))
        allowed = top_np["logit"][: arr.size]
        ids = top_np["id"][: arr.size]
        full = False
        if not np.isfinite(allowed).any():
            full = True
            vocab = self._full_np
            vocab["id"] = self._all_ids
            vocab["logit"] = logits
            arr = llama_cpp.llama_token_data_array(data=self._full, size=self.n_vocab, selected=-1, sorted=False)
            llama_cpp.llama_sampler_apply(grammar, ctypes.byref(arr))
            allowed = vocab["logit"][: arr.size]
            ids = vocab["id"][: arr.size]
            if not np.isfinite(allowed).any():
                return -1, 0.0, 0.0, True
        ok = np.isfinite(allowed)
        vals = allowed[ok].astype(np.float64)
        best = int(np.argmax(vals))
        shifted = vals - vals[best]
        z = np.exp(shifted).sum()
        probs = np.exp(shifted) / z
        entropy = float(-(probs * np.log(np.maximum(probs, 1e-300))).sum())
        return int(ids[ok][best]), float(-np.log(z)), entropy, full

    def _piece(self, token: int) -> bytes:
        piece = self._piece_cache.get(token)
        if piece is None:
            piece = self._piece_cache[token] = self.llm.detokenize([token])
        return piece

    def close(self) -> None:
        self.llm.close()


def _token_array(n: int):
    """A ctypes ``llama_token_data[n]`` (numpy views it through :data:`_TOKEN_DATA`)."""
    import llama_cpp

    return (llama_cpp.llama_token_data * n)()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    a_np = np.asarray(a[:n])
    b_np = np.asarray(b[:n])
    diff = np.flatnonzero(a_np != b_np)
    return int(diff[0]) if diff.size else n
