"""The Responder asks the local model in the model's own prompt style (no real model: a recording double)."""
from __future__ import annotations

from apiary.edge.responder import Responder
from apiary.edge.settings import EdgeSettings, PolicySettings
from apiary.shared.prompting import build_messages
from apiary.shared.protocol import Severity, encode, make
from tests.edge.helpers import SITUATIONS, RecordingModel, question, reading


def respond(model: RecordingModel, min_confidence: float = -100.0):
    settings = EdgeSettings(threads=1, policy=PolicySettings(min_confidence=min_confidence))
    event, context = SITUATIONS["robbing"], [reading(i) for i in range(3)]
    return Responder(settings, model).respond(event, context), event, context


def test_model_is_asked_in_its_prompt_style() -> None:
    for style in ("short", "examples"):
        model = RecordingModel(style)
        out, event, context = respond(model)
        assert out.route == "answered" and out.answer.action["assessment"] == "robbing"
        assert model.asked == [build_messages(event, context, style=style)]


def test_a_model_without_a_prompt_style_is_asked_with_examples() -> None:
    model = RecordingModel()
    _, event, context = respond(model)
    assert model.asked == [build_messages(event, context)]


def test_escalation_carries_the_examples_prompt_whatever_the_edge_model_reads() -> None:
    """The cloud worker takes an examples prompt as it comes and rebuilds it for a tuned model: a short
    prompt in the request would reach an untuned cloud model as is."""
    model = RecordingModel("short")
    out, event, context = respond(model, min_confidence=0.01)
    assert out.route == "escalated"
    assert model.asked == [build_messages(event, context, style="short")]
    assert out.request.messages == build_messages(event, context)


def test_an_escalation_too_large_for_the_wire_is_sent_with_less_context() -> None:
    model = RecordingModel()
    settings = EdgeSettings(threads=1)
    big = [reading(i, **{f"probe_{k:05d}": float(k) for k in range(10_000)}) for i in (1, 2)]  # ~210 KB each
    event = reading(3, severity=Severity.CRITICAL, flags=("hive_temp_c_high",), hive_temp_c=40.5)
    out = Responder(settings, model).respond(event, big)
    assert out.route == "escalated" and out.request.context == [big[1]]
    assert out.trimmed == "1 of 2 context events left out"
    assert encode(make(out.request, sender="edge.north.hive-01", reply_to="apiary/v1/north/hive-01/reply"))


def test_an_event_too_large_to_escalate_even_alone_is_answered_locally_and_says_why() -> None:
    model = RecordingModel()
    settings = EdgeSettings(threads=1)
    event = reading(1, severity=Severity.CRITICAL, flags=("hive_temp_c_high",), hive_temp_c=40.5,
                    **{f"probe_{k:05d}": float(k) for k in range(1200)})
    out = Responder(settings, model, max_payload=16 * 1024).respond(event, [])
    assert out.route == "answered" and out.request is None and len(model.asked) == 1
    assert out.answer.status == "ok" and out.answer.tier == "edge" and out.answer.action is not None
    assert out.answer.escalation_reason.startswith(
        "severity critical is critical (not escalated: event too large to escalate: ")
    # an operator's cloud question gets the local model instead of nothing
    ask = question(2, "x" * 20_000, want_cloud=True)
    out = Responder(settings, model, max_payload=16 * 1024).respond(ask, [])
    assert out.route == "answered" and out.answer.status == "ok" and len(model.asked) == 2
    assert "not escalated: event too large to escalate" in out.answer.escalation_reason
