"""The real SmolLM2-135M Q4_1 GGUF through llama.cpp: grammar-constrained answers always parse."""
from __future__ import annotations

import json

import numpy as np
import pytest

from apiary.edge.confidence import measure
from apiary.edge.errors import EdgeError
from apiary.edge.model import action_grammar
from apiary.shared.prompting import ACTION_FIELDS, PREFIX, build_messages, parse_action
from apiary.shared.protocol import ASSESSMENTS
from tests.edge.helpers import SITUATIONS, question, reading

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CASES = {**SITUATIONS, "question": question(9, "Is it a good day to inspect the hive?")}


@pytest.mark.parametrize("name", list(CASES))
def test_answer_parses_as_documented_json(local_model, name: str) -> None:
    ev = CASES[name]
    context = [reading(i) for i in range(3)] if name == "robbing" else []
    gen = local_model.generate(build_messages(ev, context), max_tokens=128)
    assert gen.finished, f"not finished in 128 tokens: {gen.text!r}"
    doc = json.loads(gen.text)  # the grammar makes it strict JSON, not just "parseable"
    assert tuple(doc) == ACTION_FIELDS
    action = parse_action(gen.text)
    assert action is not None and action.assessment in ASSESSMENTS
    # Per-token statistics line up with the tokens and are proper probabilities.
    n = gen.completion_tokens
    assert n > 10 and len(gen.logprobs) == len(gen.choice_logprobs) == len(gen.entropies) == len(gen.offsets) == n
    assert gen.offsets == sorted(gen.offsets) and gen.offsets[0] == 0
    lp, clp, ent = map(np.asarray, (gen.logprobs, gen.choice_logprobs, gen.entropies))
    assert (lp <= 1e-6).all() and (clp <= 1e-6).all() and (ent >= -1e-9).all()
    assert (clp >= lp - 1e-4).all()  # renormalising over the allowed tokens can only raise a probability
    c = measure(gen)
    assert c.n_tokens >= 2 and c.score is not None and c.score <= 0.0
    assert gen.cpu_s > 0 and gen.wall_s > 0 and gen.prompt_tokens > 100


def test_system_prompt_is_served_from_the_kv_cache(local_model) -> None:
    local_model.generate(build_messages(SITUATIONS["robbing"], []), max_tokens=8)
    gen = local_model.generate(build_messages(SITUATIONS["heat_stress"], []), max_tokens=8)
    prefix_tokens = len(local_model.tokenize(local_model.prompt_text(list(PREFIX))))
    assert prefix_tokens > 300 and gen.cached_tokens >= prefix_tokens - 1


def test_cut_off_answer_is_reported_not_parsed(local_model) -> None:
    gen = local_model.generate(build_messages(SITUATIONS["robbing"], []), max_tokens=12)
    assert not gen.finished and gen.completion_tokens == 12
    assert parse_action(gen.text) is None


def test_prompt_too_long_is_a_clear_error(local_model) -> None:
    with pytest.raises(EdgeError, match="exceeds the 2048-token context"):
        local_model.generate(build_messages(question(1, "why? " * 3000), []), max_tokens=64)


def test_grammar_restricts_strings() -> None:
    g = action_grammar()
    assert r'char ::= [^"\\\x7F\x00-\x1F]' in g
    assert '"\\"heat_stress\\""' in g


def test_loading_a_model_leaves_every_threads_stdout_alone(local_model) -> None:
    """llama-cpp-python's verbose=False load pointed sys.stdout/stderr (and fds 1 and 2) at /dev/null, process-wide:
    while the agent's OTA thread loaded a new model, what other threads printed vanished (an operator's CLI lost
    its last line). LocalModel loads without that swap."""
    import sys

    import llama_cpp._internals
    import llama_cpp.llama

    before = (sys.stdout, sys.stderr)
    for module in (llama_cpp.llama, llama_cpp._internals):
        with module.suppress_stdout_stderr(disable=False):
            assert (sys.stdout, sys.stderr) == before
