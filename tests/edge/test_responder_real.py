"""Escalation decisions on the real model follow the policy: confident, unconfident, critical, routine, energy."""
from __future__ import annotations

import pytest

from apiary.edge.responder import Responder
from apiary.edge.settings import EdgeSettings, PolicySettings, PowerProfile
from apiary.shared.protocol import Severity
from tests.edge.helpers import SITUATIONS, question, reading

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def responder(local_model, **policy) -> Responder:
    settings = EdgeSettings(threads=1, policy=PolicySettings(**policy))
    return Responder(settings, local_model)


def test_routine_reading_is_logged_without_the_model(local_model) -> None:
    out = responder(local_model).respond(reading(1))
    assert out.route == "logged" and out.generation is None and out.answer is None


def test_confident_case_is_answered_locally(local_model) -> None:
    """Threshold far below any logprob: the real answer counts as confident and stays on the edge."""
    r = responder(local_model, min_confidence=-100.0)
    out = r.respond(SITUATIONS["robbing"], [reading(i) for i in range(3)])
    assert out.route == "answered" and out.request is None
    a = out.answer
    assert a.tier == "edge" and a.status == "ok" and a.action is not None and a.escalation_reason is None
    assert a.confidence == out.confidence.score and a.energy_j > 0 and a.completion_tokens > 10
    assert r.budget.energy_j == pytest.approx(a.energy_j)


def test_unconfident_case_escalates_with_draft(local_model) -> None:
    """Threshold above every possible logprob (> 0): the same kind of answer is unconfident and escalates."""
    out = responder(local_model, min_confidence=0.01).respond(SITUATIONS["robbing"])
    assert out.route == "escalated"
    score = out.confidence.score
    assert out.decision.reasons == (f"low confidence: p10 logprob {score:.2f} < 0.01",)
    req = out.request
    assert req.edge_attempt is not None and req.edge_attempt.confidence == score
    assert req.edge_attempt.action == out.answer.action and req.edge_attempt.logprob_quantiles["n_all"] > 0
    assert req.priority == 3 and req.reason == out.decision.reasons[0] and req.deadline is not None
    assert req.event.truth is None and req.messages[0].role == "system"


def test_decision_matches_the_rule_at_the_default_threshold(local_model) -> None:
    r = responder(local_model)
    out = r.respond(SITUATIONS["sensor_fault"])
    expected = out.confidence.score < r.policy.settings.min_confidence or out.answer.action is None
    assert (out.route == "escalated") == expected


def test_critical_case_escalates_whatever_the_confidence(local_model) -> None:
    out = responder(local_model, min_confidence=-100.0).respond(SITUATIONS["heat_stress"])
    assert out.route == "escalated" and out.decision.reasons == ("severity critical is critical",)
    assert out.generation is not None and out.request.priority == 0  # drafted locally first


def test_operator_asking_for_cloud_escalates_without_spending_energy(local_model) -> None:
    r = responder(local_model)
    out = r.respond(question(3, "Is the queen laying?", want_cloud=True))
    assert out.route == "escalated" and out.generation is None and r.budget.energy_j == 0
    assert out.request.priority == 2 and out.request.edge_attempt is None
    assert out.answer.status == "expired"  # the fallback, used only if the cloud never answers


def test_short_energy_budget_spares_non_critical_events(local_model) -> None:
    r = Responder(EdgeSettings(threads=1, power=PowerProfile(reserve_soc=0.3)), local_model)
    night = dict(battery_v=3.45, solar_w=0.0)  # 10% charge, no sun: no tokens to spend
    out = r.respond(reading(4, severity=Severity.WARNING, flags=("bee_traffic_high",), bee_traffic=9000.0, **night))
    assert r.budget.tokens_per_hour == 0.0
    assert out.route == "escalated" and out.generation is None
    assert out.decision.reasons == ("energy budget short: only critical events use the local model",)
    crit = r.respond(reading(5, severity=Severity.CRITICAL, flags=("battery_v_low",), battery_v=3.3, solar_w=0.0))
    assert crit.generation is not None  # critical events still get the model, with the low-power knobs
    assert crit.generation.completion_tokens <= r.settings.power.low_max_tokens
    offline = Responder(EdgeSettings(threads=1, power=PowerProfile(reserve_soc=0.3), policy=PolicySettings(link="never")),
                        local_model)
    out = offline.respond(reading(6, severity=Severity.WARNING, flags=("bee_traffic_high",), **night))
    assert out.route == "deferred" and out.answer.status == "deferred" and out.generation is None
    assert "not escalated: policy link=never" in out.answer.escalation_reason
