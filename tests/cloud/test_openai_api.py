"""Every OpenAI / vLLM field of the REST API with the official ``openai`` client, streamed and not,
on a live uvicorn server with the real engine and SmolLM2 weights."""
from __future__ import annotations

import contextlib
import json
import math
import re
import uuid

import httpx
import jsonschema
import pydantic
import pytest
import torch

from apiary.shared.assets import REGISTRY
from tests.cloud.conftest import MODEL_NAME
from tests.cloud.test_api import COUNTING, client, server, wait_for  # noqa: F401 (server is a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

QUESTION = [{"role": "user", "content": "What do bees make?"}]
POEM = [{"role": "user", "content": "Write a short poem about bees."}]
YES_NO = [{"role": "user", "content": "Reply with one word: yes or no. Is honey sweet?"}]  # greedy: 'No.' + end
MODEL_ID = "smollm2-135m-q4"  # the registry name: the id everywhere
MODEL_FILE = REGISTRY[MODEL_ID].filename
HIVE_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "frames": {"type": "integer"}},
               "required": ["name", "frames"], "additionalProperties": False}


@pytest.fixture
def oa(server):  # noqa: F811
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.inference_key, max_retries=0)


def chat(oa, messages=QUESTION, **kw):
    return oa.chat.completions.create(model=MODEL_NAME, messages=messages, **{"max_tokens": 6, "temperature": 0, **kw})


def complete(oa, prompt=COUNTING, **kw):
    return oa.completions.create(model=MODEL_NAME, prompt=prompt, **{"max_tokens": 6, "temperature": 0, **kw})


def streamed_chat(oa, messages=QUESTION, **kw) -> tuple[dict[int, str], dict[int, str], list]:
    """Texts and finish reasons by choice index, and every chunk, of a streamed chat completion."""
    chunks = list(chat(oa, messages, stream=True, **kw))
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


def streamed_completion(oa, prompt=COUNTING, **kw) -> tuple[dict[int, str], list]:
    chunks = list(complete(oa, prompt, stream=True, **kw))
    texts: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return texts, chunks


def test_chat_logprobs_streamed_and_not(oa, idle_engine):
    import openai

    done = chat(oa, logprobs=True, top_logprobs=3)
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens == 6
    assert "".join(t.token for t in content) == done.choices[0].message.content
    for t in content:
        assert math.isfinite(t.logprob) and t.logprob <= 0
        assert t.bytes == list(t.token.encode())
        assert len(t.top_logprobs) == 3 and all(a.logprob <= 0 for a in t.top_logprobs)
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        # greedy: the chosen token is the most likely one
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)

    plain = chat(oa, logprobs=True)  # the chosen tokens only
    assert [t.token for t in plain.choices[0].logprobs.content] == [t.token for t in content]
    assert all(t.top_logprobs == [] for t in plain.choices[0].logprobs.content)
    assert chat(oa).choices[0].logprobs is None

    texts, _, chunks = streamed_chat(oa, logprobs=True, top_logprobs=3)
    pieces = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert texts[0] == done.choices[0].message.content
    assert [t.token for t in pieces] == [t.token for t in content]
    assert [t.logprob for t in pieces] == pytest.approx([t.logprob for t in content], abs=1e-4)
    for c in chunks:  # each chunk carries the logprobs of its own delta
        if c.choices and c.choices[0].logprobs:
            assert "".join(t.token for t in c.choices[0].logprobs.content) == c.choices[0].delta.content

    with pytest.raises(openai.BadRequestError, match="top_logprobs") as e:
        chat(oa, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        chat(oa, logprobs=True, top_logprobs=21)


def test_logprobs_of_grammar_masked_alternatives_are_minus_9999(oa, idle_engine):
    answers = ["the queen lays the eggs", "the workers gather nectar"]
    done = chat(oa, QUESTION, max_tokens=12, logprobs=True, top_logprobs=5, extra_body={"guided_choice": answers})
    assert done.choices[0].message.content in answers
    alternatives = [a.logprob for t in done.choices[0].logprobs.content for a in t.top_logprobs]
    assert all(math.isfinite(v) and v <= 0 for v in alternatives)
    assert -9999.0 in alternatives  # once the answer is decided, every other token is ruled out


def test_completion_logprobs_legacy_shape(oa, idle_engine):
    import openai

    done = complete(oa, logprobs=2)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == done.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert math.isfinite(value) and value <= 0
        assert top[token] == pytest.approx(value) and len(top) <= 3
        assert max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy
    assert complete(oa).choices[0].logprobs is None
    only = complete(oa, logprobs=0).choices[0].logprobs
    assert only.tokens == lp.tokens and all(list(top) == [t] for t, top in zip(only.tokens, only.top_logprobs))

    texts, chunks = streamed_completion(oa, logprobs=2)
    pieces = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert texts[0] == done.choices[0].text
    assert [t for p in pieces for t in p.tokens] == lp.tokens
    assert [o for p in pieces for o in p.text_offset] == lp.text_offset  # offsets run on across chunks

    with pytest.raises(openai.BadRequestError, match="logprobs"):
        complete(oa, logprobs=21)


def test_n_choices_with_seeds(oa, idle_engine):
    import openai

    two = chat(oa, POEM, max_tokens=8, temperature=1.0, n=2, seed=11)
    assert [c.index for c in two.choices] == [0, 1]
    texts = [c.message.content for c in two.choices]
    assert texts[0] != texts[1]  # seeds 11 and 12
    again = chat(oa, POEM, max_tokens=8, temperature=1.0, n=2, seed=11)
    assert [c.message.content for c in again.choices] == texts  # reproducible
    assert chat(oa, POEM, max_tokens=8, temperature=1.0, seed=12).choices[0].message.content == texts[1]
    one = chat(oa, POEM, max_tokens=8, temperature=1.0, seed=11)
    assert two.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert two.usage.completion_tokens == 16 and two.usage.total_tokens == two.usage.prompt_tokens + 16

    streamed, finish, chunks = streamed_chat(oa, POEM, max_tokens=8, temperature=1.0, n=2, seed=11,
                                             stream_options={"include_usage": True})
    assert streamed == {0: texts[0], 1: texts[1]} and finish == {0: "length", 1: "length"}
    indexes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.content]
    assert indexes[:4] == [0, 1, 0, 1]  # interleaved as the engine steps them together
    assert chunks[-1].usage.completion_tokens == 16

    done = complete(oa, "Bees are", max_tokens=5, temperature=1.0, n=3, seed=5)
    assert [c.index for c in done.choices] == [0, 1, 2] and done.usage.completion_tokens == 15
    ctexts, _ = streamed_completion(oa, "Bees are", max_tokens=5, temperature=1.0, n=3, seed=5)
    assert ctexts == {c.index: c.text for c in done.choices}

    with pytest.raises(openai.BadRequestError, match="n"):
        chat(oa, n=9)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        complete(oa, n=1, best_of=3)
    assert len(complete(oa, n=2, best_of=2).choices) == 2


class Hive(pydantic.BaseModel):
    name: str
    frames: int


def test_response_format_json_schema_and_json_object(oa, idle_engine):
    import openai

    describe = [{"role": "user", "content": "Describe a beehive as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "hive", "strict": True, "schema": HIVE_SCHEMA}}
    done = chat(oa, describe, max_tokens=40, response_format=fmt)
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done.choices[0].message.content), HIVE_SCHEMA)
    texts, finish, _ = streamed_chat(oa, describe, max_tokens=40, response_format=fmt)
    assert texts[0] == done.choices[0].message.content and finish[0] == "stop"

    parsed = oa.chat.completions.parse(model=MODEL_NAME, messages=describe, max_tokens=40, temperature=0,
                                       response_format=Hive)  # the client's strict schema from a pydantic model
    assert isinstance(parsed.choices[0].message.parsed, Hive)

    obj = chat(oa, describe, max_tokens=24, response_format={"type": "json_object"})
    text = obj.choices[0].message.content
    assert text.lstrip().startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    assert chat(oa, response_format={"type": "text"}).choices[0].message.content

    bad = {"type": "json_schema", "json_schema": {"name": "broken", "schema": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError, match="json_schema") as e:
        chat(oa, response_format=bad)
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError, match="response_format"):
        chat(oa, response_format={"type": "xml"})
    with pytest.raises(openai.BadRequestError, match="response_format.json_schema"):
        chat(oa, response_format={"type": "json_schema"})


def test_vllm_guided_decoding_extras(oa, idle_engine):
    import openai

    choice = chat(oa, YES_NO, extra_body={"guided_choice": ["yes", "no"]}).choices[0].message.content
    assert choice in ("yes", "no")
    assert complete(oa, "Is honey sweet?", extra_body={"guided_choice": ["yes", "no"]}).choices[0].text in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}", chat(oa, extra_body={"guided_regex": "[0-9]{3}"}).choices[0].message.content)
    for grammar in ('start: "bee" | "wasp"', 'root ::= "bee" | "wasp"'):  # Lark and GBNF
        assert chat(oa, extra_body={"guided_grammar": grammar}).choices[0].message.content in ("bee", "wasp")
    guided = chat(oa, [{"role": "user", "content": "Describe a beehive as JSON."}], max_tokens=40,
                  extra_body={"guided_json": HIVE_SCHEMA})
    jsonschema.validate(json.loads(guided.choices[0].message.content), HIVE_SCHEMA)
    texts, _ = streamed_completion(oa, "Is honey sweet?", extra_body={"guided_regex": "(yes|no)"})
    assert texts[0] in ("yes", "no")

    with pytest.raises(openai.BadRequestError, match="guided_regex"):
        chat(oa, extra_body={"guided_regex": "[a-"})
    with pytest.raises(openai.BadRequestError, match="one output constraint"):
        chat(oa, response_format={"type": "json_object"}, extra_body={"guided_choice": ["a"]})


def test_penalties_bias_and_sampling_extras(oa, cloud_engine, idle_engine):
    import openai

    baseline = complete(oa, max_tokens=10).choices[0].text  # " 8, 9, 10,"
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"extra_body": {"repetition_penalty": 2.0}}):
        assert complete(oa, max_tokens=10, **kw).choices[0].text != baseline, kw
    assert complete(oa, max_tokens=10, presence_penalty=0.0, frequency_penalty=0.0).choices[0].text == baseline

    (bee,) = cloud_engine.tokenizer.encode(" bee")
    assert complete(oa, max_tokens=3, logit_bias={str(bee): 100}).choices[0].text == " bee bee bee"
    texts, _ = streamed_completion(oa, max_tokens=3, logit_bias={str(bee): 100})
    assert texts[0] == " bee bee bee"
    (eight,) = cloud_engine.tokenizer.encode("8")  # greedy goes on " 8": the space, then the digit
    assert "8" not in complete(oa, max_tokens=2, logit_bias={eight: -100}).choices[0].text

    (comma,) = cloud_engine.tokenizer.encode(",")
    stopped = complete(oa, max_tokens=10, extra_body={"stop_token_ids": [comma]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == " 8"

    # top_k=1 and min_p=1 leave only the most likely token: sampling at temperature 1 is greedy
    assert complete(oa, max_tokens=10, temperature=1.0, extra_body={"top_k": 1}).choices[0].text == baseline
    assert complete(oa, max_tokens=10, temperature=1.0, extra_body={"min_p": 1.0}).choices[0].text == baseline
    assert complete(oa, max_tokens=10, extra_body={"top_k": -1, "priority": 0}).choices[0].text == baseline

    short = chat(oa, YES_NO, max_tokens=12)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 8
    assert chat(oa, YES_NO, max_tokens=12, extra_body={"min_tokens": 8}).usage.completion_tokens >= 8
    forced = chat(oa, YES_NO, max_tokens=12, extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == 12 and forced.choices[0].finish_reason == "length"
    _, finish, chunks = streamed_chat(oa, YES_NO, max_tokens=12, stream_options={"include_usage": True},
                                      extra_body={"ignore_eos": True})
    assert finish == {0: "length"} and chunks[-1].usage.completion_tokens == 12

    bad = [({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
           ({"logit_bias": {str(bee): 200}}, "logit_bias"), ({"logit_bias": {"bee": 1}}, "logit_bias"),
           ({"logit_bias": {"10000000": 1}}, "vocabulary"), ({"extra_body": {"top_k": -2}}, "top_k"),
           ({"extra_body": {"min_p": 1.5}}, "min_p"), ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
           ({"extra_body": {"min_tokens": 20}}, "min_tokens"), ({"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids"),
           ({"extra_body": {"priority": 12}}, "priority"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
           ({"stream_options": {"include_usage": True}}, "stream_options"),
           ({"extra_body": {"echo": True}}, "echo"), ({"seed": "abc"}, "seed")]
    for kw, needle in bad:
        with pytest.raises(openai.BadRequestError, match=needle):
            complete(oa, max_tokens=4, **kw)
    with pytest.raises(openai.BadRequestError, match="tool calling"):
        chat(oa, tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])


def test_cached_prompt_tokens_are_reported(oa, idle_engine):
    tag = uuid.uuid4().hex  # a prompt no other test has cached
    long = [{"role": "system", "content": f"Session {tag}. " + "Bees keep the brood nest near 35 C. " * 30},
            {"role": "user", "content": "Why?"}]
    first = chat(oa, long, max_tokens=2)
    assert first.usage.prompt_tokens > 200
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = chat(oa, long, max_tokens=2)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens and cached % 16 == 0  # whole KV blocks
    _, _, chunks = streamed_chat(oa, long, max_tokens=2, stream_options={"include_usage": True})
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    usage = oa.completions.create(model=MODEL_NAME, prompt=long[0]["content"], max_tokens=1).usage
    assert usage.prompt_tokens_details is not None


def test_unknown_fields_are_ignored_and_named(oa, server):  # noqa: F811
    raw = oa.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi", "x_note": 1}], max_tokens=2,
        extra_body={"reasoning_effort": "low", "made_up": {"a": 1}})
    assert raw.headers["x-apiary-ignored-fields"] == "reasoning_effort, made_up, messages.0.x_note"
    assert raw.parse().choices[0].message.content
    with oa.completions.with_streaming_response.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, stream=True,
                                                      extra_body={"made_up": 1}) as streamed:
        assert streamed.headers["x-apiary-ignored-fields"] == "made_up"
        assert "[DONE]" in streamed.read().decode()
    assert "x-apiary-ignored-fields" not in oa.completions.with_raw_response.create(
        model=MODEL_NAME, prompt="Hi", max_tokens=1).headers
    with client(server) as c:  # nulls mean the defaults; nonsense types on known fields stay refused
        r = c.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": QUESTION, "max_tokens": 2,
                                                 "temperature": None, "n": None, "stop": None, "logprobs": None})
        assert r.status_code == 200, r.text
        for body, param in [({"temperature": "hot"}, "temperature"), ({"messages": "hi"}, "messages"),
                            ({"n": 1.5}, "n"), ({"logprobs": "sure"}, "logprobs")]:
            r = c.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": QUESTION, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_models_list_and_retrieve(oa, cloud_engine):
    import openai

    (card,) = oa.models.list().data
    assert card.id == MODEL_NAME and card.max_model_len == cloud_engine.max_model_len
    assert oa.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("gpt-4")


def test_one_model_id_and_the_file_name_as_alias(make_service, keys, idle_engine):
    """Without served_model_name the registry model is served under its registry name (what `apiary models
    list`, the demo and the README say), and a request naming its file, with or without .gguf, is served."""
    import openai

    service = make_service(served_model_name=None)  # the model given as the cached file's path, as the demo does
    oa = openai.OpenAI(base_url=service.url + "/v1", api_key=keys.create(["inference"]), max_retries=0)
    assert [m.id for m in oa.models.list().data] == [MODEL_ID]
    for alias in (MODEL_FILE, MODEL_FILE.removesuffix(".gguf"), MODEL_ID):
        done = oa.chat.completions.create(model=alias, messages=QUESTION, max_tokens=2, temperature=0)
        assert done.model == MODEL_ID and done.usage.completion_tokens >= 1
        assert oa.models.retrieve(alias).id == MODEL_ID
    with pytest.raises(openai.NotFoundError, match=MODEL_ID):
        oa.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=2)


def test_prompt_is_tokenized_once(oa, cloud_engine, monkeypatch):
    tokenizer = cloud_engine.tokenizer
    calls = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text: calls.append(text) or encode(text))
    chat(oa, max_tokens=2)
    complete(oa, max_tokens=2, n=2)
    assert len(calls) == 2  # one per request, not one more in the engine (nor per choice)


def test_disconnects_abort_every_choice(server, cloud_engine, idle_engine):  # noqa: F811
    before = cloud_engine.metrics()["requests_aborted"]
    body = {"model": MODEL_NAME, "prompt": COUNTING, "max_tokens": 400, "temperature": 0, "n": 3}
    with client(server) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            assert next(line for line in r.iter_lines() if line.startswith("data:"))
    wait_for(lambda: cloud_engine.metrics()["requests_aborted"] == before + 3)
    c = client(server, timeout=httpx.Timeout(60, read=1.0))
    with pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json={**body, "n": 2})
    c.close()
    wait_for(lambda: cloud_engine.metrics()["requests_aborted"] == before + 5)
    wait_for(lambda: cloud_engine.metrics()["kv_blocks_used"] == 0)


@contextlib.contextmanager
def _served(llm, tmp_path, keys, gguf_path):
    """``llm`` behind the REST door (``CloudService``, as `apiary cloud serve` runs it): an ``openai`` client."""
    import openai

    from apiary.cloud.engine import AsyncEngine
    from apiary.cloud.service import CloudService
    from apiary.cloud.settings import CloudSettings

    engine = AsyncEngine(llm)
    service = CloudService(CloudSettings(port=0, db=str(tmp_path / "cloud.db"), api_key_file=str(keys.path),
                                         generate_key="never", images=str(tmp_path / "images"), model=str(gguf_path),
                                         served_model_name=MODEL_NAME), engine=engine)
    service.start()
    try:
        yield openai.OpenAI(base_url=service.url + "/v1", api_key=keys.create(["inference"]), max_retries=0)
    finally:
        service.stop()
        engine.shutdown()


def _through_the_run_and_without(oa, llm, monkeypatch, concurrent: bool = True) -> tuple[list, int, list]:
    """Three concurrent streamed greedy chats (text, and each token's logprob) with the engine's run of layers in
    one call (``CpuStep.stacked_layers``), how many steps took it, then the same chats with the run switched off.
    ``concurrent=False``: the chats one after another, for engines whose answers depend on the step's row count
    (concurrent chats are batched differently in the two rounds)."""
    import concurrent.futures as concurrent_futures

    from apiary.kernels import cpu_layers

    calls = []
    through = cpu_layers.CpuStep.stacked_layers
    monkeypatch.setattr(cpu_layers.CpuStep, "stacked_layers", lambda *a: calls.append(1) or through(*a))

    def answer(messages):
        stream = oa.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0,
                                            logprobs=True, stream=True)
        chunks = [c.choices[0] for c in stream if c.choices]
        return ("".join(c.delta.content or "" for c in chunks),
                [(t.token, t.logprob) for c in chunks if c.logprobs for t in c.logprobs.content or []])

    def all_answers():
        if not concurrent:
            return [answer(messages) for messages in (QUESTION, POEM, YES_NO)]
        with concurrent_futures.ThreadPoolExecutor(3) as pool:
            return list(pool.map(answer, [QUESTION, POEM, YES_NO]))

    fused = all_answers()
    fused_calls = len(calls)
    model = llm.runner.model  # the engine is idle between the rounds: the next step reads the attribute
    stack, model.layer_stack = model.layer_stack, None
    calls.clear()
    llm.reset_prefix_cache()  # the second round's prompts computed in full again, as the first round's were
    try:
        layered = all_answers()
    finally:
        model.layer_stack = stack
    assert not calls
    return fused, fused_calls, layered


def _answers_the_same_through_the_run_and_without(llm, gemm: str, tmp_path, keys, gguf_path, monkeypatch) -> None:
    """``llm`` runs all 30 layers of a decode step in one call through the ``gemm`` kernel, and behind the REST door
    its concurrent chats decode through that run and answer what the per-layer path answers."""
    stack = llm.runner.model.layer_stack
    assert stack is not None and (stack.first, stack.count, stack.gemm) == (0, 30, gemm)
    with _served(llm, tmp_path, keys, gguf_path) as oa:
        fused, calls, layered = _through_the_run_and_without(oa, llm, monkeypatch)
    assert calls >= 8 and all(text for text, _ in fused)
    assert layered == fused


def test_a_bf16_server_decodes_through_its_run_of_layers(tmp_path, keys, gguf_path, monkeypatch):
    """`apiary cloud serve`'s default engine where bf16 is native and our vdpbf16ps kernel runs, behind the REST
    door: concurrent streamed chats decode through the run of all 30 layers in one call, and answer, token for
    token and logprob for logprob, what the per-layer path answers once the run is switched off."""
    import importlib

    from apiary.cloud.engine import EngineConfig, LLMEngine
    from apiary.kernels import cpu, ops

    if not (cpu.native_bf16(cpu.host_flags()) and ops.numba_available()
            and importlib.import_module("apiary.kernels.cpu_bf16_gemm").available()):
        pytest.skip("this host's bf16 layers do not take the vdpbf16ps kernel (no avx512_bf16 for numba)")
    llm = LLMEngine(EngineConfig(model_path=gguf_path, max_num_seqs=4, kv_cache_bytes=64 << 20))  # dtype auto
    _answers_the_same_through_the_run_and_without(llm, "bf16", tmp_path, keys, gguf_path, monkeypatch)


def test_a_bf16_weights_server_decodes_through_its_run_of_layers(tmp_path, keys, gguf_path, monkeypatch):
    """`apiary cloud serve`'s default engine on a CPU without native bf16 (float32 with its projection weights held
    in bf16, ``weights="bf16"``, and so its KV rows in bf16; asked for here on any host with AVX2 + FMA) behind the
    REST door: concurrent streamed chats decode through the run of all 30 layers in one call, and answer, token for
    token and logprob for logprob, what the per-layer path answers once the run is switched off (each row is summed
    on its own)."""
    from apiary.cloud.engine import EngineConfig, LLMEngine
    from apiary.kernels import ops

    if not ops.bf16w_gemm_available():
        pytest.skip("numba does not compile for AVX2 and FMA here: the bf16-weight kernel does not run")
    llm = LLMEngine(EngineConfig(model_path=gguf_path, dtype="float32", weights="bf16", max_num_seqs=4,
                                 kv_cache_bytes=64 << 20))
    assert llm.runner.kv_pool.dtype == torch.bfloat16
    _answers_the_same_through_the_run_and_without(llm, "bf16w", tmp_path, keys, gguf_path, monkeypatch)


def test_an_int8_server_decodes_through_its_run_of_layers(tmp_path, keys, gguf_path, monkeypatch):
    """`apiary cloud serve --weights int8`'s engine behind the REST door: streamed chats decode through the run of
    int8 layers in one call (``CpuStep.stacked_layers``), and answer, token for token and logprob for logprob, what
    the per-layer path answers once the run is switched off; a JSON-schema answer through the LM head that ranks in
    int8 (handed the grammar's bitmask) is a document of its schema.

    With bf16 activations every projection is one of our kernels, whose rows do not depend on the batch, so the
    chats run concurrently. With float32 ones (CPUs without native bf16) the first and last layers stay float32
    through torch's sgemm, whose sums change with the step's row count, and the int8 activations' rounding turns
    those last bits into logprobs a few hundredths apart: a prompt computed in one step of 35 rows or, its prefix
    cached, in one of 3 (found in the AVX2 rehearsal, ``.ci/avx2-rehearsal``). So the rounds start from an empty
    prefix cache, and there the chats go one at a time."""
    from apiary.cloud.engine import EngineConfig, LLMEngine, int8

    if int8.gemm_choice().backend != "grouped":
        pytest.skip("the run takes grouped int8 weights; this host's int8 is per-token")
    llm = LLMEngine(EngineConfig(model_path=gguf_path, weights="int8", max_num_seqs=4, kv_cache_bytes=64 << 20))
    assert isinstance(llm.runner.model.head, int8.RefinedHead)
    refined = int8.RefinedHead.__call__
    with _served(llm, tmp_path, keys, gguf_path) as oa:
        fused, calls, layered = _through_the_run_and_without(oa, llm, monkeypatch,
                                                             concurrent=llm.runner.dtype == torch.bfloat16)
        assert calls >= 8 and all(text for text, _ in fused)
        assert layered == fused
        model = llm.runner.model
        # A structured answer: the step's grammar bitmask reaches the head, which ranks in int8 (int8.RefinedHead)
        masks = []
        head = model.head
        monkeypatch.setattr(type(head), "__call__", lambda self, h, allowed=None: masks.append(allowed) or
                            refined(self, h, allowed))
        fmt = {"type": "json_schema", "json_schema": {"name": "hive", "strict": True, "schema": HIVE_SCHEMA}}
        done = oa.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Describe a "
                                          "beehive as JSON."}], max_tokens=40, temperature=0, response_format=fmt)
        assert done.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(done.choices[0].message.content), HIVE_SCHEMA)
        assert any(m is not None for m in masks)
