"""Grammar-constrained decoding in the engine: valid outputs for random schemas, and constraints that
change nothing they need not change, under batching, preemption, prefix caching and speculation.

The tiny random model makes the hard case: left alone it says nothing valid, so every valid
output is the grammar's doing. The real SmolLM2 checks logprobs against a float64 recomputation
and that a constraint leaves an already valid greedy answer alone.
"""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from apiary.cloud.engine import LLMEngine, RequestRejected, SamplingParams, SpeculativeConfig
from apiary.cloud.engine.sampling_params import StructuredOutput
from tests.cloud.engine.conftest import prompt_logits
from tests.cloud.engine.test_engine import engine_for, prompts

COMPACT = {"whitespace_flexible": False}  # llguidance: no free whitespace (a random model would fill it)


def schema_spec(schema: dict) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps({**schema, "x-guidance": COMPACT}))


# ---------------------------------------------------------------- random JSON Schemas (tiny model)

names = st.text(alphabet="abcdefghij_", min_size=1, max_size=6)
leaves = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.just({"type": "boolean"}),
    st.builds(lambda vals: {"enum": vals}, st.lists(st.text(alphabet="xyz ", min_size=1, max_size=4), min_size=1,
                                                    max_size=3, unique=True)),
)


def objects(children):
    return st.builds(lambda props, req: {"type": "object", "properties": props,
                                         "required": sorted(props)[: req % (len(props) + 1)],
                                         "additionalProperties": False},
                     st.dictionaries(names, children, min_size=1, max_size=3), st.integers(0, 3))


schemas = st.recursive(leaves, lambda children: st.one_of(
    objects(children), st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, children,
                                 st.integers(0, 2))), max_leaves=6).filter(lambda s: s.get("type") in ("object", "array"))


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama: Path) -> LLMEngine:
    return engine_for(tiny_llama, kv_cache_bytes=4 << 20, max_num_batched_tokens=128)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas, seed=st.integers(0, 1000))
def test_outputs_follow_random_json_schemas(tiny_engine: LLMEngine, schema: dict, seed: int) -> None:
    """Greedy and sampled rows of one batch, each output a document of its schema."""
    spec = schema_spec(schema)
    params = [SamplingParams(max_tokens=160, structured=spec),
              SamplingParams(max_tokens=160, structured=spec, temperature=1.0, seed=seed),
              SamplingParams(max_tokens=12)]  # an unconstrained neighbour in the same batch
    outs = tiny_engine.generate(prompts(3, seed=seed), params)
    for out in outs[:2]:
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)
        else:  # cut by max_tokens: still a prefix the grammar accepts
            assert out.finish_reason == "length"
            assert tiny_engine.structured.valid_prefix_of(spec, out.output_token_ids)


def test_kinds_regex_grammar_choice_and_json_object(tiny_engine: LLMEngine) -> None:
    cases = [(StructuredOutput("regex", "[a-z]{2,5}-[0-9]{2}"), lambda t: __import__("re").fullmatch(r"[a-z]{2,5}-\d\d", t)),
             (StructuredOutput("grammar", 'root ::= "hive " ("ok" | "hot" | "gone")'), lambda t: t in
              ("hive ok", "hive hot", "hive gone")),
             (StructuredOutput("grammar", 'start: "queen" | "drone"'), lambda t: t in ("queen", "drone")),  # Lark
             (StructuredOutput("choice", '["swarm", "rob", "heat"]'), lambda t: t in ("swarm", "rob", "heat"))]
    for seed in range(3):
        outs = tiny_engine.generate(prompts(len(cases), seed=seed),
                                    [SamplingParams(max_tokens=48, structured=s, temperature=1.0, seed=seed)
                                     for s, _ in cases])
        for (spec, ok), out in zip(cases, outs):
            assert out.finish_reason == "stop" and ok(out.text), (spec, out.text)
    # Any JSON object: a random model rarely closes one within 48 tokens, but it never leaves the grammar.
    anything = StructuredOutput("json_object")
    for out in tiny_engine.generate(prompts(3), SamplingParams(max_tokens=48, structured=anything, temperature=1.0)):
        assert out.text.startswith("{") and tiny_engine.structured.valid_prefix_of(anything, out.output_token_ids)
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)


@pytest.mark.parametrize("spec, reason", [
    (StructuredOutput("json_schema", "{not json"), "invalid json_schema"),
    (StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"type": "strang"}}}'), "invalid json_schema"),
    (StructuredOutput("regex", "(unclosed"), "invalid regex"),
    (StructuredOutput("grammar", "root ::= ("), "invalid grammar"),
    (StructuredOutput("choice", '"one"'), "invalid choice"),
])
def test_bad_grammars_are_refused_before_queueing(tiny_engine: LLMEngine, spec: StructuredOutput, reason: str) -> None:
    with pytest.raises(RequestRejected, match=reason):
        tiny_engine.add_request("hive", params=SamplingParams(structured=spec))
    assert not tiny_engine.requests


def test_compiled_grammars_are_cached_per_spec(tiny_engine: LLMEngine) -> None:
    spec = schema_spec({"type": "object", "properties": {"cached": {"type": "boolean"}}, "required": ["cached"]})
    tiny_engine.generate(["a", "b"], SamplingParams(max_tokens=20, structured=spec))
    grammar = tiny_engine.structured._compiled[spec]
    tiny_engine.generate(["c"], SamplingParams(max_tokens=20, structured=StructuredOutput(spec.kind, spec.spec)))
    assert tiny_engine.structured._compiled[spec] is grammar


# ---------------------------------------------------------------- nothing else changes

ACTIONISH = {"type": "object", "properties": {"kind": {"enum": ["swarm", "heat", "ok"]},
                                              "note": {"type": "string", "maxLength": 10},
                                              "level": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["kind", "note", "level"], "additionalProperties": False}


def constrained_params() -> list[SamplingParams]:
    spec = schema_spec(ACTIONISH)
    return [SamplingParams(max_tokens=60, structured=spec), SamplingParams(max_tokens=30),
            SamplingParams(max_tokens=60, structured=spec, temperature=0.9, seed=11),
            SamplingParams(max_tokens=60, structured=StructuredOutput("regex", "[a-f ]{4,30}"))]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_same_tokens_alone_batched_cached_and_preempted(tiny_llama: Path, mode: str) -> None:
    texts = prompts(4, seed=2, max_words=16)
    roomy = engine_for(tiny_llama, kv_cache_bytes=4 << 20)
    alone = [roomy.generate([t], p)[0].output_token_ids for t, p in zip(texts, constrained_params())]
    assert [o.output_token_ids for o in roomy.generate(texts, constrained_params())] == alone
    assert [o.output_token_ids for o in roomy.generate(texts, constrained_params())] == alone  # prefix-cache hits
    assert roomy.stats.cached_prompt_tokens > 0
    tight = engine_for(tiny_llama, kv_cache_bytes=96 * 1024, preemption_mode=mode, max_num_batched_tokens=48)
    outs = tight.generate(texts, constrained_params())
    assert tight.scheduler.num_preemptions > 0
    assert [o.output_token_ids for o in outs] == alone
    for out in outs[:1]:
        jsonschema.validate(json.loads(out.text), ACTIONISH)


@pytest.mark.parametrize("weights", ["dtype", "int8"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_under_a_grammar_changes_no_greedy_token(tiny_llama: Path, method: str, weights: str) -> None:
    """Proposals are cut at the first token the grammar forbids (n-gram) or drawn under its mask (draft);
    verification and rollback keep the matcher in step: greedy outputs are those of plain decoding. With int8
    weights the LM head refines its candidates, and a verification's positions get their grammar's too."""
    if weights == "int8":
        from apiary.cloud.engine import int8

        if int8.gemm_choice().backend != "grouped":
            pytest.skip("the refined LM head takes the grouped int8 kernel, which this host does not run")
    texts = prompts(4, seed=4, max_words=20)
    params = [p for p in constrained_params() if p.greedy]
    plain = engine_for(tiny_llama, kv_cache_bytes=4 << 20, weights=weights)
    ref = [o.output_token_ids for o in plain.generate(texts[:len(params)], params)]
    spec = SpeculativeConfig(method=method, k=3, adaptive=False, draft_num_layers=1 if method == "draft" else None)
    fast = engine_for(tiny_llama, kv_cache_bytes=4 << 20, speculative=spec, weights=weights)
    asked: list[list] = []  # the sampling positions the engine computed a grammar bitmask for, before the head
    allowed_tokens = fast._allowed_tokens
    fast._allowed_tokens = lambda rows: asked.append(rows) or allowed_tokens(rows)
    got = [o.output_token_ids for o in fast.generate(texts[:len(params)], params)]
    assert got == ref
    stats = fast.metrics()
    assert stats[f"spec_{method}_proposed"] > 0 and stats[f"spec_{method}_accepted"] > 0
    if weights == "int8":  # verifications' positions (the drafts before each) hand the head their grammar's too
        assert any(row.drafted for rows in asked for row in rows)


def test_sampled_structured_outputs_stay_valid_under_draft_speculation(tiny_llama: Path) -> None:
    spec = SpeculativeConfig(method="draft", k=3, adaptive=False, draft_num_layers=1)
    engine = engine_for(tiny_llama, kv_cache_bytes=4 << 20, speculative=spec)
    params = [SamplingParams(max_tokens=80, structured=schema_spec(ACTIONISH), temperature=1.0, seed=s) for s in range(6)]
    for out in engine.generate(prompts(6, seed=9), params):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), ACTIONISH)


# ---------------------------------------------------------------- the real model


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_valid_greedy_answer_is_left_alone_and_logprobs_match_float64(real_engine: LLMEngine) -> None:
    """Sensor prompts with worked examples: where the unconstrained greedy answer already is a valid
    action, the schema-constrained one is token for token the same; each reported logprob equals a
    float64 log-softmax of the model's logits over the tokens the grammar allowed at that step."""
    import llguidance

    from apiary.firmware_bridge.simulator import labelled_situations
    from apiary.shared.prompting import ACTION_JSON_SCHEMA, build_messages

    engine = real_engine
    tok = engine.tokenizer
    situations = labelled_situations(6, seed=21)
    chats = [tok.encode(tok.apply_chat_template([m.model_dump() for m in build_messages(s.event, s.context)]))
             for s in situations]
    spec = StructuredOutput("json_schema", json.dumps(ACTION_JSON_SCHEMA))
    free = engine.generate(chats, SamplingParams(max_tokens=120))
    tied = engine.generate(chats, SamplingParams(max_tokens=120, structured=spec, logprobs=2))
    valid = 0
    for f, t in zip(free, tied):
        doc = json.loads(t.text)
        jsonschema.validate(doc, ACTION_JSON_SCHEMA)
        try:
            jsonschema.validate(json.loads(f.text), ACTION_JSON_SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            continue
        if f.finish_reason == "stop":
            valid += 1
            # The constrained answer ends when its grammar is complete, one step before the model's end token.
            assert t.output_token_ids == [x for x in f.output_token_ids if x not in engine.stop_token_ids]
            assert t.text == f.text
    assert valid >= 1, "no unconstrained answer was valid: the equality check above never ran"

    prompt, out = chats[0], tied[0]
    _, logits = prompt_logits(engine, prompt + out.output_token_ids[:-1], use_prefix_cache=False)
    logits = logits[-len(out.output_token_ids):].double()
    grammar = engine.structured.compile(spec)
    matcher = llguidance.LLMatcher(engine.structured._ll(), grammar, log_level=0)
    words = (logits.shape[-1] + 31) // 32
    for step, (token, lp) in enumerate(zip(out.output_token_ids, out.logprobs)):
        mask = torch.zeros(1, words, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        allowed = ((mask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten()[:logits.shape[-1]]
        ref = logits[step].masked_fill(~allowed, float("-inf")).log_softmax(-1)
        assert lp.token_id == token and abs(lp.logprob - ref[token].item()) < 2e-4, step
        assert [t for t, _ in lp.top] == ref.topk(2).indices.tolist()[: len(lp.top)] or lp.top[1][1] == float("-inf")
        assert matcher.consume_token(token)


@pytest.mark.slow
def test_unconstrained_sampled_logprobs_match_float64(real_engine: LLMEngine) -> None:
    engine = real_engine
    prompt = engine.tokenizer.encode("Bees keep their brood at about 35 degrees because")
    out = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=3, logprobs=4))[0]
    _, logits = prompt_logits(engine, prompt + out.output_token_ids[:-1], use_prefix_cache=False)
    ref = (logits[-len(out.output_token_ids):].double() / 0.7).log_softmax(-1)
    for step, lp in enumerate(out.logprobs):
        assert abs(lp.logprob - ref[step, lp.token_id].item()) < 2e-4
        assert [t for t, _ in lp.top] == ref[step].topk(4).indices.tolist()
