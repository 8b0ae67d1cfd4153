"""The Responder asks the local model in the model's own prompt style (no real model: a recording double)."""
from __future__ import annotations

from edge.responder import Responder
from edge.settings import EdgeSettings, PolicySettings
from shared.prompting import build_messages
from tests.edge.helpers import SITUATIONS, RecordingModel, reading


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
