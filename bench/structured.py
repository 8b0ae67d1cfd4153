"""Structured outputs: constrained vs unconstrained tok/s, schema validity, batch 1/32, n-gram on/off; llguidance vs xgrammar.

Two parts (``--parts backends,engine``):

* **backends**: the grammar engines alone, on our workload. The vocabulary is the cloud
  engine's tokenizer for SmolLM2 (byte-level BPE, 49,152 tokens); the grammars are the
  edge's action schema (``apiary.shared.prompting.ACTION_JSON_SCHEMA``), eight generic JSON schemas
  (``bench/data/structured_schemas.json``: nested objects, arrays, enums, numbers with ranges,
  patterns, optional fields, anyOf, a recursive ``$ref``, prefixItems, nullable), ``json_object``
  and a regex. The token sequences replayed are valid instances of each grammar (the worked
  answers of the sensor-agent prompt, hand-written examples of the others) tokenized by the
  engine's tokenizer, plus the end token. Per grammar: compile time with empty caches, time to
  the first mask, the per-token mask time of that first request, the cached path (a new
  matcher from the compile cache plus its first mask), and the warm per-token mask time at
  batch 1; then the batched fill at ``--backend-batch`` rows (all grammars mixed, llguidance's
  ``LLExecutor`` vs xgrammar's ``BatchGrammarMatcher``). Every replayed token is checked
  against the mask just computed ("bad tokens" must be 0). Backends run interleaved, round by
  round, rotating which goes first. xgrammar is optional (``pip install 'apiary-mesh[bench]'``);
  without it its rows are skipped with a message.
* **engine**: one cloud engine (n-gram speculation configured, switched per run) answers the
  edge's sensor-agent prompts (``apiary.shared.prompting.build_messages`` on the simulator's labelled
  situations) and prompts for the generic schemas, each unconstrained and constrained
  (``SamplingParams(structured=StructuredOutput("json_schema", ...))``), at batch 1 (prompt by
  prompt) and at ``--batch``, speculation off and on. Greedy decoding; constrained and
  unconstrained runs of a prompt get the same ``max_tokens`` (``--max-tokens`` for sensor
  prompts, ``--generic-max-tokens`` for the others). Conditions are interleaved (rotating order
  per prompt / per round); every prompt and schema is prefilled and compiled once before timing.
  Outputs stop at different lengths, so the figures are output tokens per second and time per
  output token, not wall time; and because a batch whose outputs end early drains to fewer
  sequences per step, the ratio to unconstrained decoding is also taken over the steps in which
  every request of the run was still decoding ("full batch"; the targets are checked on it).
  Constrained outputs are validated against their schema (``jsonschema`` or ``jsonschema_rs``
  when installed, else the small validator below); the engine's grammar calls are timed in place
  (mask share = bitmask time / wall; grammar share adds applying the masks and advancing the
  matchers). The n-gram history first holds constrained answers to ``--history`` other prompts
  and is then frozen, so runs cannot feed each other. "same as spec off" compares greedy outputs
  token for token (exact only in float32: bf16 verification of k+1 positions rounds
  differently).
"""
from __future__ import annotations

import json
import math
import os
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

SCHEMAS_FILE = Path(__file__).resolve().parent / "data" / "structured_schemas.json"
BACKENDS = ("llguidance", "xgrammar", "xgrammar-dynamic")
XGRAMMAR_MISSING = ("xgrammar is not installed: its rows are skipped "
                    "(pip install 'apiary-mesh[bench]' to measure it; it is not a runtime dependency)")
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_features() -> str:
    """The CPU model and which of avx2/avx512f/avx512_bf16/amx it has (speed figures depend on them)."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        return "unknown CPU"
    have = [f for f in CPU_FLAGS if f in flags]
    return f"{model or 'unknown CPU'}; {' '.join(have) if have else 'no avx2/avx512/amx'}"


# ---------------------------------------------------------------- schemas, instances, validation


def load_schemas() -> dict[str, Any]:
    return json.loads(SCHEMAS_FILE.read_text())


def action_examples() -> list[dict[str, str]]:
    """The sensor-agent prompt's worked answers, fields in the schema's (= generation) order."""
    from apiary.shared.prompting import ACTION_FIELDS, EXAMPLES

    return [{k: answer[k] for k in ACTION_FIELDS} for _, answer in EXAMPLES]


_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}


def mini_validate(value: Any, schema: Any, root: Any = None) -> list[str]:
    """Errors of ``value`` against ``schema``: the keywords our schemas use (no formats). For machines without jsonschema."""
    root = schema if root is None else root
    if schema is True or schema is None:
        return []
    if schema is False:
        return ["no value allowed here"]
    if "$ref" in schema:
        target: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part] if part else target
        return mini_validate(value, target, root)
    errors: list[str] = []
    types = schema.get("type")
    if types is not None and not any(_TYPES[t](value) for t in ([types] if isinstance(types, str) else types)):
        return [f"{value!r} is not of type {types}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{value!r} not in {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{value!r} != {schema['const']!r}")
    for key in ("anyOf", "oneOf"):
        if key in schema:
            matches = sum(not mini_validate(value, s, root) for s in schema[key])
            if matches == 0 or (key == "oneOf" and matches > 1):
                errors.append(f"{value!r} matches {matches} of {key}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", math.inf):
            errors.append(f"length {len(value)} outside [{schema.get('minLength', 0)}, {schema.get('maxLength')}]")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{value!r} does not match {schema['pattern']}")
    if _TYPES["number"](value) and not (schema.get("minimum", -math.inf) <= value <= schema.get("maximum", math.inf)):
        errors.append(f"{value} outside [{schema.get('minimum')}, {schema.get('maximum')}]")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", math.inf):
            errors.append(f"{len(value)} items outside [{schema.get('minItems', 0)}, {schema.get('maxItems')}]")
        prefix = schema.get("prefixItems", [])
        for i, item in enumerate(value):
            errors += mini_validate(item, prefix[i] if i < len(prefix) else schema.get("items", True), root)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errors += [f"missing {k!r}" for k in schema.get("required", []) if k not in value]
        for k, v in value.items():
            if k in props:
                errors += mini_validate(v, props[k], root)
            else:
                errors += mini_validate(v, schema.get("additionalProperties", True), root)
    return errors


def schema_validator(schema: dict[str, Any]) -> tuple[str, Callable[[Any], bool]]:
    """``(which, is_valid)``: jsonschema if installed, else jsonschema_rs, else :func:`mini_validate`."""
    try:
        import jsonschema

        v = jsonschema.validators.validator_for(schema)(schema)
        return "jsonschema", v.is_valid
    except ImportError:
        pass
    try:
        import jsonschema_rs

        return "jsonschema_rs", jsonschema_rs.validator_for(schema).is_valid
    except ImportError:
        return "mini", lambda value: not mini_validate(value, schema)


def is_valid_json(text: str, valid: Callable[[Any], bool]) -> bool:
    """The whole text is one JSON value (whitespace around it allowed) that ``valid`` accepts."""
    try:
        return bool(valid(json.loads(text)))
    except (ValueError, RecursionError):
        return False


# ---------------------------------------------------------------- grammar backends


@dataclass(slots=True)
class Grammar:
    name: str
    kind: str  # json_schema, json_object, regex (as in cloud.engine.sampling_params.StructuredOutput)
    spec: str
    sequences: list[list[int]]  # valid outputs as token ids, each ending with the end token


def backend_grammars(tok: Any) -> list[Grammar]:
    from apiary.shared.prompting import ACTION_JSON_SCHEMA

    data = load_schemas()

    def ids(text: str) -> list[int]:
        out = tok.encode(text)
        if tok.bos_token_id is not None and out[:1] == [tok.bos_token_id]:
            out = out[1:]
        return [*out, tok.eos_token_id]

    grammars = [Grammar("action", "json_schema", json.dumps(ACTION_JSON_SCHEMA),
                        [ids(json.dumps(e)) for e in action_examples()])]
    for name, s in data["json_schemas"].items():
        grammars.append(Grammar(name, "json_schema", json.dumps(s["schema"]),
                                [ids(json.dumps(e)) for e in s["examples"]]))
    grammars.append(Grammar("json_object", "json_object", "",
                            [ids(json.dumps(e)) for e in data["json_object"]["examples"]]))
    grammars.append(Grammar("regex", "regex", data["regex"]["pattern"], [ids(e) for e in data["regex"]["examples"]]))
    return grammars


class LLGuidanceBackend:
    """What cloud/engine/structured.py does: grammar_from + validate (cached per spec), one LLMatcher per request."""

    name = "llguidance"

    def __init__(self, tok: Any, vocab_size: int, stop_ids: list[int], threads: int) -> None:
        import llguidance as ll
        from llguidance.torch import fill_next_token_bitmask, fill_next_token_bitmask_par

        self.ll = ll
        self.tokenizer = ll.LLTokenizer(tok._tok.to_str(), n_vocab=vocab_size, eos_token=stop_ids)
        self.executor = ll.LLExecutor(num_threads=threads)
        self._one, self._par = fill_next_token_bitmask, fill_next_token_bitmask_par
        self.cache: dict[tuple[str, str], str] = {}

    def compile(self, kind: str, spec: str) -> str:
        key = (kind, spec)
        if key not in self.cache:
            ll = self.ll
            if kind == "json_object":
                kind, spec = "json_schema", '{"type": "object"}'
            grammar = ll.grammar_from(kind, spec)
            is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
            if is_error:
                raise ValueError("; ".join(messages))
            self.cache[key] = grammar
        return self.cache[key]

    def clear(self) -> None:
        self.cache.clear()

    def matcher(self, compiled: str) -> Any:
        return self.ll.LLMatcher(self.tokenizer, compiled, log_level=0)

    @staticmethod
    def copy(matcher: Any) -> Any:
        return matcher.deep_copy()

    def fill(self, matchers: list[Any], mask: Any, rows: list[int]) -> None:
        if len(matchers) == 1:
            self._one(matchers[0], mask, rows[0])
        else:
            self._par(self.executor, list(zip(matchers, rows)), mask)

    @staticmethod
    def accept(matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    @staticmethod
    def done(matcher: Any) -> bool:
        return matcher.is_stopped()


class XGrammarBackend:
    """xgrammar 0.2.x: TokenizerInfo built from the vocabulary (no transformers), a caching GrammarCompiler.

    ``dynamic``: the compiler's lazy mode (token-mask cache entries made on first use, not at compile).
    Control tokens are given as empty strings, which xgrammar treats as special (never text): as
    llguidance does with the tokenizer's special tokens. Otherwise ``<|im_end|>`` would be allowed
    inside a JSON string as the literal text.
    """

    def __init__(self, tok: Any, vocab_size: int, stop_ids: list[int], threads: int, dynamic: bool = False) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.name = "xgrammar-dynamic" if dynamic else "xgrammar"
        backend = tok._tok  # tokenizers.Tokenizer
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        encoded = [""] * vocab_size
        for piece, i in backend.get_vocab(with_added_tokens=True).items():
            if i < vocab_size and i not in special:
                encoded[i] = piece
        info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, enable_dynamic_compilation=dynamic)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, kind: str, spec: str) -> Any:
        if kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', strict_mode=False)
        if kind == "json_schema":
            return self.compiler.compile_json_schema(spec)
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        return self.compiler.compile_grammar(spec)

    def clear(self) -> None:
        self.compiler.clear_cache()

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], mask: Any, rows: list[int]) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(mask, rows[0])
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, mask, rows)

    @staticmethod
    def accept(matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    @staticmethod
    def done(matcher: Any) -> bool:
        return matcher.is_terminated()


def make_backends(names: list[str], tok: Any, vocab_size: int, threads: int) -> tuple[list[Any], list[str]]:
    """The backends that can run here, and a note per one that cannot."""
    stop_ids = sorted(t for t in tok.stop_token_ids if t is not None and t < vocab_size)
    made, notes = [], []
    for name in names:
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
        if name == "llguidance":
            made.append(LLGuidanceBackend(tok, vocab_size, stop_ids, threads))
            continue
        try:
            import xgrammar  # noqa: F401
        except ImportError:
            if XGRAMMAR_MISSING not in notes:
                notes.append(XGRAMMAR_MISSING)
            continue
        made.append(XGrammarBackend(tok, vocab_size, stop_ids, threads, dynamic=name == "xgrammar-dynamic"))
    return made, notes


def _allowed(mask: Any, row: int, token: int) -> bool:
    return bool(int(mask[row, token >> 5]) & (1 << (token & 31)))


def replay(backend: Any, compiled: Any, seq: list[int], mask: Any) -> dict[str, Any]:
    """Feed ``seq`` to a new matcher: mask, check, accept per token. Times in seconds (lists per token)."""
    m = backend.matcher(compiled)
    fill, accept, bad = [], [], 0
    for t in seq:
        t0 = time.perf_counter()
        backend.fill([m], mask, [0])
        t1 = time.perf_counter()
        ok = backend.accept(m, t)
        t2 = time.perf_counter()
        fill.append(t1 - t0)
        accept.append(t2 - t1)
        bad += not (ok and _allowed(mask, 0, t))
    return {"fill": fill, "accept": accept, "bad": bad + (not backend.done(m))}


def replay_batch(backend: Any, compiled: dict[str, Any], rows: list[tuple[str, list[int]]], mask: Any) -> dict[str, Any]:
    """All rows decode together: per step one batched fill for the rows not yet done, then each accepts its token."""
    matchers = [backend.matcher(compiled[name]) for name, _ in rows]
    pos = [0] * len(rows)
    steps: list[tuple[int, float, float]] = []
    bad = 0
    while True:
        active = [i for i, (_, seq) in enumerate(rows) if pos[i] < len(seq)]
        if not active:
            break
        t0 = time.perf_counter()
        backend.fill([matchers[i] for i in active], mask, active)
        t1 = time.perf_counter()
        oks = [backend.accept(matchers[i], rows[i][1][pos[i]]) for i in active]
        t2 = time.perf_counter()
        steps.append((len(active), t1 - t0, t2 - t1))
        for i, ok in zip(active, oks):
            bad += not (ok and _allowed(mask, i, rows[i][1][pos[i]]))
            pos[i] += 1
    bad += sum(not backend.done(m) for m in matchers)
    return {"steps": steps, "bad": bad}


def measure_backends(tok: Any, vocab_size: int, names: list[str], rounds: int, batch: int,
                     threads: int) -> dict[str, Any]:
    """Per-grammar and batched timings of each backend (median over interleaved rounds)."""
    import torch

    grammars = backend_grammars(tok)
    backends, notes = make_backends(names, tok, vocab_size, threads)
    for note in notes:
        print(note, flush=True)
    words = (vocab_size + 31) // 32
    mask1 = torch.zeros((1, words), dtype=torch.int32)
    maskb = torch.zeros((batch, words), dtype=torch.int32)
    pairs = [(g.name, s) for g in grammars for s in g.sequences]
    batch_rows = [pairs[i % len(pairs)] for i in range(batch)]
    per: dict[str, dict[str, dict[str, list[float]]]] = {b.name: {g.name: {} for g in grammars} for b in backends}
    errors: dict[str, dict[str, str]] = {b.name: {} for b in backends}
    bad: dict[str, int] = {b.name: 0 for b in backends}
    batched: dict[str, list[dict[str, float]]] = {b.name: [] for b in backends}

    def add(b: str, g: str, key: str, value: float) -> None:
        per[b][g].setdefault(key, []).append(value)

    for r in range(rounds):
        order = backends[r % len(backends):] + backends[:r % len(backends)] if backends else []
        for backend in order:
            b = backend.name
            compiled: dict[str, Any] = {}
            for g in grammars:
                if g.name in errors[b]:
                    continue
                backend.clear()
                t0 = time.perf_counter()
                try:
                    c = backend.compile(g.kind, g.spec)
                except Exception as e:  # noqa: BLE001 - a grammar a backend cannot compile is a result
                    errors[b][g.name] = f"{type(e).__name__}: {e}"[:300]
                    continue
                t1 = time.perf_counter()
                first = replay(backend, c, g.sequences[0], mask1)  # the first request after a cold compile
                add(b, g.name, "compile_ms", (t1 - t0) * 1e3)
                add(b, g.name, "first_mask_ms", first["fill"][0] * 1e3)
                add(b, g.name, "first_request_us_per_token", sum(first["fill"]) / len(first["fill"]) * 1e6)
                t2 = time.perf_counter()
                c = backend.compile(g.kind, g.spec)  # from the cache now
                m = backend.matcher(c)
                backend.fill([m], mask1, [0])
                add(b, g.name, "cached_to_first_mask_ms", (time.perf_counter() - t2) * 1e3)
                if hasattr(backend, "copy"):  # llguidance: a new request as a copy of a pristine matcher
                    template = backend.matcher(c)
                    t3 = time.perf_counter()
                    m = backend.copy(template)
                    backend.fill([m], mask1, [0])
                    add(b, g.name, "copy_to_first_mask_ms", (time.perf_counter() - t3) * 1e3)
                compiled[g.name] = c
                bad[b] += first["bad"]
            for g in grammars:  # warm: new matchers from the cached compile, every instance
                if g.name not in compiled:
                    continue
                fills, accepts = [], []
                for seq in g.sequences:
                    out = replay(backend, compiled[g.name], seq, mask1)
                    fills += out["fill"]
                    accepts += out["accept"]
                    bad[b] += out["bad"]
                add(b, g.name, "mask_us_per_token", sum(fills) / len(fills) * 1e6)
                add(b, g.name, "accept_us_per_token", sum(accepts) / len(accepts) * 1e6)
                add(b, g.name, "tokens", sum(len(s) for s in g.sequences))
            rows = [(name, seq) for name, seq in batch_rows if name in compiled]
            if rows:
                out = replay_batch(backend, compiled, rows, maskb)
                steps = out["steps"]
                full = [f for n, f, _ in steps if n == len(rows)]
                row_tokens = sum(n for n, _, _ in steps)
                batched[b].append({"rows": len(rows), "steps": len(steps), "full_batch_steps": len(full),
                                   "full_step_us": statistics.median(full) * 1e6 if full else float("nan"),
                                   "mask_us_per_row_token": sum(f for _, f, _ in steps) / row_tokens * 1e6,
                                   "accept_us_per_row_token": sum(a for _, _, a in steps) / row_tokens * 1e6})
                bad[b] += out["bad"]
            print(f"backends round {r + 1}/{rounds}: {b} done", flush=True)
    medians = {b: {g: {k: statistics.median(v) for k, v in d.items()} for g, d in gs.items() if d}
               for b, gs in per.items()}
    batch_medians = {b: {k: statistics.median(x[k] for x in runs) for k in runs[0]}
                     for b, runs in batched.items() if runs}
    return {"grammars": [g.name for g in grammars],
            "tokens_per_grammar": {g.name: sum(map(len, g.sequences)) for g in grammars},
            "per_grammar": medians, "batch": batch_medians, "batch_size": batch, "bad_tokens": bad,
            "compile_errors": errors, "notes": notes, "rounds": rounds, "threads": threads,
            "backends": [b.name for b in backends], "raw_batch": batched}


def backends_report(result: dict[str, Any], features: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from apiary.bench.common import RESULTS_DIR, report

    table = Table(title=f"Grammar backends per grammar (median of {result['rounds']} rounds; {features})")
    columns = ["grammar", "tokens", "backend", "compile ms (cold)", "first mask ms", "1st request us/tok",
               "cached: matcher + 1st mask ms", "copy + 1st mask ms", "mask us/tok", "accept us/tok"]
    for c in columns:
        table.add_column(c)
    per_rows = []
    for g in result["grammars"]:
        for b in result["backends"]:
            d = result["per_grammar"].get(b, {}).get(g)
            if d is None:
                row = [g, result["tokens_per_grammar"][g], b, f"error: {result['compile_errors'][b].get(g, '?')[:60]}"]
                row += ["-"] * (len(columns) - len(row))
            else:
                row = [g, result["tokens_per_grammar"][g], b, d["compile_ms"], d["first_mask_ms"],
                       d["first_request_us_per_token"], d["cached_to_first_mask_ms"],
                       d.get("copy_to_first_mask_ms", "-"), d["mask_us_per_token"],
                       d["accept_us_per_token"]]
            per_rows.append(row)
            table.add_row(*[f"{v:.3g}" if isinstance(v, float) else str(v) for v in row])
    Console().print(table)
    summary_cols = ["backend", "grammars compiled", "compile ms median (max)", "cached->1st mask ms median",
                    "1st request us/tok median", "b1 mask us/tok median (max)", f"b{result['batch_size']} step us",
                    f"b{result['batch_size']} mask us/row-tok", "bad tokens"]
    rows = []
    for b in result["backends"]:
        ds = list(result["per_grammar"].get(b, {}).values())
        if not ds:
            continue
        bm = result["batch"].get(b, {})

        def med(key: str) -> float:
            return statistics.median(d[key] for d in ds)

        rows.append([b, f"{len(ds)}/{len(result['grammars'])}",
                     f"{med('compile_ms'):.3g} ({max(d['compile_ms'] for d in ds):.3g})",
                     f"{med('cached_to_first_mask_ms'):.3g}"
                     + (f" (copy {med('copy_to_first_mask_ms'):.3g})" if "copy_to_first_mask_ms" in ds[0] else ""),
                     med("first_request_us_per_token"),
                     f"{med('mask_us_per_token'):.3g} ({max(d['mask_us_per_token'] for d in ds):.3g})",
                     bm.get("full_step_us", "-"), bm.get("mask_us_per_row_token", "-"), result["bad_tokens"][b]])
    report("structured-backends", f"Grammar backends, all grammars ({features}; {result['threads']} threads)",
           summary_cols, rows, {"cpu": features, "per_grammar_columns": columns, "per_grammar_rows": per_rows, **result},
           out=RESULTS_DIR / "structured-backends.json")


# ---------------------------------------------------------------- engine: constrained vs unconstrained


@dataclass(slots=True)
class Prompt:
    ids: list[int]
    schema_name: str  # "action" or a generic schema's name
    schema: dict[str, Any]
    max_tokens: int = 96  # the same for the constrained and the unconstrained run of this prompt


def sensor_prompts(tok: Any, n: int, seed: int) -> list[Prompt]:
    from apiary.firmware_bridge.simulator import labelled_situations
    from apiary.shared.prompting import ACTION_JSON_SCHEMA, build_messages

    return [Prompt(tok.encode(tok.apply_chat_template([m.model_dump() for m in build_messages(s.event, s.context)])),
                   "action", ACTION_JSON_SCHEMA) for s in labelled_situations(n, seed=seed)]


def generic_prompts(tok: Any, n: int, offset: int = 0) -> list[Prompt]:
    schemas = list(load_schemas()["json_schemas"].items())
    out = []
    for i in range(offset, offset + n):
        name, s = schemas[i % len(schemas)]
        text = (f"{s['task']}\nAnswer with one JSON object that follows this JSON schema:\n"
                f"{json.dumps(s['schema'])}")
        out.append(Prompt(tok.encode(tok.apply_chat_template([{"role": "user", "content": text}])), name, s["schema"]))
    return out


class GrammarTimer:
    """Times the engine's grammar work in place: the matcher calls (instance attributes shadow the
    methods) and ``sampling.apply_bitmask`` (the mask applied to the logits; the module attribute is
    swapped until :meth:`close`). Nothing in the engine's code changes."""

    def __init__(self, structured: Any) -> None:
        from apiary.cloud.engine import sampling

        self.seconds = {"bitmask": 0.0, "accept": 0.0, "valid_prefix": 0.0, "apply_bitmask": 0.0}
        for name in ("bitmask", "accept", "valid_prefix"):
            setattr(structured, name, self._timed(name, getattr(structured, name)))
        self._sampling, self._apply = sampling, sampling.apply_bitmask
        sampling.apply_bitmask = self._timed("apply_bitmask", sampling.apply_bitmask)

    def close(self) -> None:
        self._sampling.apply_bitmask = self._apply

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
        return timed

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)


class StepLog:
    """Per engine step: seconds, decoding requests (outputs past their first token) and tokens they got.

    Outputs stop at different lengths, so a run's batch drains differently with and without a grammar;
    steps where every request of the run still decodes compare the two at the same batch size.
    """

    def __init__(self, engine: Any) -> None:
        self.steps: list[tuple[float, int, int]] = []
        step = engine.step

        def logged() -> list[Any]:
            t0 = time.perf_counter()
            outs = step()
            decoding = [o for o in outs if len(o.output_token_ids) > len(o.new_token_ids)]
            self.steps.append((time.perf_counter() - t0, len(decoding), sum(len(o.new_token_ids) for o in decoding)))
            return outs
        engine.step = logged  # generate() calls self.step(): the instance attribute shadows the method


CONDITIONS = [(c, s) for s in (False, True) for c in (False, True)]  # (constrained, speculation)


def _cond(constrained: bool, spec: bool) -> str:
    return f"{'constrained' if constrained else 'unconstrained'}{', n-gram' if spec else ''}"


def measure_engine(engine: Any, workloads: dict[str, dict[int, list[Prompt]]], rounds: int,
                   history: list[Prompt]) -> dict[str, Any]:
    from apiary.cloud.engine import SamplingParams
    from apiary.cloud.engine.sampling_params import StructuredOutput

    spec = engine.speculator
    assert spec is not None
    timer = GrammarTimer(engine.structured)
    log = StepLog(engine)
    validators: dict[str, tuple[str, Callable[[Any], bool]]] = {}

    def params(p: Prompt, constrained: bool, tokens: int | None = None) -> SamplingParams:
        structured = StructuredOutput("json_schema", json.dumps(p.schema)) if constrained else None
        return SamplingParams(max_tokens=tokens or p.max_tokens, structured=structured)

    def run(prompts: list[Prompt], constrained: bool, on: bool) -> dict[str, Any]:
        spec.enabled = on
        g0, first_step = timer.snapshot(), len(log.steps)
        t0 = time.perf_counter()
        outs = engine.generate([p.ids for p in prompts], [params(p, constrained) for p in prompts])
        wall = time.perf_counter() - t0
        g1 = timer.snapshot()
        full = [(sec, toks) for sec, n, toks in log.steps[first_step:] if n == len(prompts)]
        results = []
        for p, o in zip(prompts, outs):
            if p.schema_name not in validators:
                validators[p.schema_name] = schema_validator(p.schema)
            n = len(o.output_token_ids)
            m = o.metrics
            results.append({"tokens": n, "finish": o.finish_reason, "ids": o.output_token_ids,
                            "valid": is_valid_json(o.text, validators[p.schema_name][1]), "text": o.text,
                            "tpot_s": (m.finish_time - m.first_token_time) / (n - 1) if n > 1 else None,
                            "ttft_s": m.first_token_time - m.arrival_time, "cached_prompt_tokens": m.cached_prompt_tokens,
                            "prompt_tokens": len(p.ids)})
        return {"wall": wall, "outputs": results, "grammar_s": {k: g1[k] - g0[k] for k in g1},
                "full_batch": {"steps": len(full), "seconds": sum(f[0] for f in full), "tokens": sum(f[1] for f in full)}}

    # Untimed: prefill every prompt, compile every schema, one run per condition (step-time tables, first calls).
    everything = [p for sizes in workloads.values() for ps in sizes.values() for p in ps] + history
    engine.generate([p.ids for p in everything], [params(p, True, 1) for p in everything])
    for sizes in workloads.values():
        small = min(sizes.values(), key=len)[:2]
        for constrained, on in CONDITIONS:
            spec.enabled = on
            engine.generate([p.ids for p in small], [params(p, constrained, 8) for p in small])
    # The n-gram history: constrained answers to other prompts (a server that has been answering), then frozen.
    spec.ngram.history.clear()
    spec.enabled = True
    engine.generate([p.ids for p in history], [params(p, True) for p in history])
    spec.ngram.history.frozen = True

    runs: dict[str, dict[int, dict[tuple[bool, bool], list[dict[str, Any]]]]] = {
        w: {size: {c: [] for c in CONDITIONS} for size in sizes} for w, sizes in workloads.items()}
    for r in range(rounds):
        for w, sizes in workloads.items():
            for size, prompts in sizes.items():
                units = [[p] for p in prompts] if size == 1 else [prompts]  # batch 1: prompt by prompt
                for i, unit in enumerate(units):
                    shift = (r + i) % len(CONDITIONS)
                    for cond in CONDITIONS[shift:] + CONDITIONS[:shift]:
                        runs[w][size][cond].append(run(unit, *cond))
                line = ", ".join(f"{_cond(*c)} {_tps(rs):.1f}" for c, rs in runs[w][size].items())
                print(f"round {r + 1}/{rounds} {w} batch {size}: tok/s {line}", flush=True)
    spec.enabled = True
    timer.close()
    return {"runs": runs, "validators": {k: v[0] for k, v in validators.items()}}


def _full_tps(rs: list[dict[str, Any]]) -> float:
    seconds = sum(r["full_batch"]["seconds"] for r in rs)
    return sum(r["full_batch"]["tokens"] for r in rs) / seconds if seconds else float("nan")


def _tps(rs: list[dict[str, Any]]) -> float:
    tokens = sum(o["tokens"] for r in rs for o in r["outputs"])
    wall = sum(r["wall"] for r in rs)
    return tokens / wall if wall else float("nan")


def engine_rows(result: dict[str, Any]) -> tuple[list[list[Any]], dict[str, Any]]:
    rows, raw = [], {}
    for w, sizes in result["runs"].items():
        for size, conds in sizes.items():
            for constrained, on in CONDITIONS:
                rs = conds[(constrained, on)]
                outs = [o for r in rs for o in r["outputs"]]
                tps, full = _tps(rs), _full_tps(rs)
                ratio = tps / _tps(conds[(False, on)])
                full_ratio = full / _full_tps(conds[(False, on)])
                target = 0.95 if size > 1 else 0.90
                verdict = (" ok" if full_ratio >= target else " MISS") if constrained else ""
                tpots = [o["tpot_s"] for o in outs if o["tpot_s"] is not None]
                wall = sum(r["wall"] for r in rs)
                mask_s = sum(r["grammar_s"]["bitmask"] for r in rs)
                grammar_s = sum(sum(r["grammar_s"].values()) for r in rs)
                plain = [o for r in conds[(constrained, False)] for o in r["outputs"]]
                same = sum(a["ids"] == b["ids"] for a, b in zip(outs, plain))
                finished = [o for o in outs if o["finish"] == "stop"]
                rows.append([w, size, _cond(constrained, on), len(outs), statistics.mean(o["tokens"] for o in outs),
                             tps, f"{ratio:.3f}", full, f"{full_ratio:.3f}{verdict}",
                             1e3 * statistics.median(tpots) if tpots else "-",
                             f"{sum(o['valid'] for o in outs)}/{len(outs)}",
                             f"{sum(o['valid'] for o in finished)}/{len(finished)}",
                             sum(o["finish"] == "length" for o in outs),
                             f"{100 * mask_s / wall:.2f}% / {100 * grammar_s / wall:.2f}%" if constrained else "-",
                             f"{same}/{len(outs)}" if on else "-"])
                raw[f"{w} b{size} {_cond(constrained, on)}"] = [
                    {"wall_s": r["wall"], "grammar_s": r["grammar_s"], "full_batch": r["full_batch"],
                     "outputs": [{k: v for k, v in o.items() if k != "ids"} for o in r["outputs"]]} for r in rs]
    return rows, raw


# tok/s: all output tokens / wall. full-batch tok/s: tokens / time of the steps in which every request of the
# run was decoding (batch 1: the decode steps), so constrained and unconstrained runs are compared at the same
# batch size although their outputs end at different lengths; the targets (>= 0.90 at batch 1, >= 0.95 batched)
# are checked on it. mask share: computing the allowed-token masks (StructuredOutputs.bitmask) / wall; grammar
# share: that plus applying them to the logits (sampling.apply_bitmask) and advancing the matchers.
ENGINE_COLUMNS = ["workload", "batch", "condition", "requests", "mean out tok", "tok/s", "vs unconstrained",
                  "full-batch tok/s", "vs unconstrained (full batch)", "TPOT ms p50", "schema-valid",
                  "valid of finished", "cut at max_tokens", "mask / grammar share", "same as spec off"]


# ---------------------------------------------------------------- command


def _tokenizer(path: str) -> tuple[Any, int]:
    import gguf

    from apiary.cloud.engine.loader import read_gguf_metadata
    from apiary.cloud.engine.tokenizer import load_tokenizer

    p = Path(path).expanduser()
    meta = read_gguf_metadata(gguf.GGUFReader(str(p))) if p.is_file() else None
    tok = load_tokenizer(p, meta)
    vocab = int(meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"])) if meta else tok.vocab_size
    return tok, vocab


def command(parts: str = "backends,engine", backends: str = ",".join(BACKENDS), backend_rounds: int = 3,
            backend_batch: int = 32, grammar_threads: int = 0, prompts: int = 4, batch: int = 32,
            max_tokens: int = 96, generic_max_tokens: int = 256, rounds: int = 2, history: int = 16,
            dtype: str = "bfloat16", threads: int = 0, seed: int = 0, model: str = "") -> None:
    import torch

    from apiary.bench.common import report
    from apiary.shared import assets

    chosen = {p.strip() for p in parts.split(",") if p.strip()}
    if not chosen <= {"backends", "engine"}:
        raise SystemExit(f"--parts takes backends and/or engine, got {parts!r}")
    path = model or str(assets.ensure("smollm2-135m-q4"))
    features = cpu_features()
    print(f"CPU: {features}", flush=True)
    if "backends" in chosen:
        tok, vocab = _tokenizer(path)
        result = measure_backends(tok, vocab, [b.strip() for b in backends.split(",") if b.strip()],
                                  backend_rounds, backend_batch, grammar_threads or os.cpu_count() or 1)
        backends_report(result, features)
    if "engine" not in chosen:
        return
    from apiary.cloud.engine import EngineConfig, LLMEngine
    from apiary.cloud.engine.spec import SpeculativeConfig

    engine = LLMEngine(EngineConfig(model_path=path, dtype=dtype, kv_cache_bytes=1 << 30, max_num_seqs=max(batch, 8),
                                    max_num_batched_tokens=2048, num_threads=threads or None,
                                    speculative=SpeculativeConfig(method="ngram")))
    tok = engine.tokenizer
    workloads = {
        "sensor": {1: sensor_prompts(tok, prompts, seed), batch: sensor_prompts(tok, batch, seed + 1)},
        "generic": {1: generic_prompts(tok, prompts), batch: generic_prompts(tok, batch, offset=prompts)},
    }
    hist = sensor_prompts(tok, history, seed + 1000) + generic_prompts(tok, history, offset=3)
    for p in [p for sizes in workloads.values() for ps in sizes.values() for p in ps] + hist:
        p.max_tokens = max_tokens if p.schema_name == "action" else generic_max_tokens
    result = measure_engine(engine, workloads, rounds, hist)
    rows, raw = engine_rows(result)
    report("structured", f"Constrained vs unconstrained decoding (max_tokens {max_tokens} sensor / "
           f"{generic_max_tokens} generic, {dtype}, "
           f"threads={torch.get_num_threads()}; {features})", ENGINE_COLUMNS, rows,
           {"cpu": features, "raw": raw, "validators": result["validators"], "load_average_at_end": os.getloadavg(),
            "config": {"prompts": prompts, "batch": batch, "max_tokens": max_tokens,
                       "generic_max_tokens": generic_max_tokens, "rounds": rounds,
                       "history_requests": len(hist), "dtype": dtype, "threads": torch.get_num_threads(),
                       "model": path, "spec_max_batch": engine.speculator.config.max_batch},
            "targets": {"ratio_batch_1": 0.90, "ratio_batch_n": 0.95, "schema_valid": 1.0},
            "metrics": {k: v for k, v in engine.metrics().items() if k.startswith("spec_")}})
