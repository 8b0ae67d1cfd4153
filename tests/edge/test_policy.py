"""The escalation policy on crafted situations: every rule, every blocker, with reasons."""
from __future__ import annotations

import pytest

from apiary.edge.policy import Attempt, EscalationPolicy, Situation
from apiary.edge.settings import PolicySettings
from apiary.shared.protocol import Severity


def situation(**kw) -> Situation:
    base = dict(severity=Severity.WARNING, kind="reading", flags=("bee_traffic_high",), want_cloud=False, link_up=True)
    return Situation(**{**base, **kw})


def run(policy: EscalationPolicy, s: Situation, attempt: Attempt | None):
    plan = policy.plan(s)
    return plan, policy.decide(s, plan, attempt if plan.run_model else None)


POLICY = EscalationPolicy(PolicySettings(min_confidence=-0.5))
CONFIDENT = Attempt(valid=True, confidence=-0.05, entropy=0.1)
UNSURE = Attempt(valid=True, confidence=-1.7, entropy=1.2)


def test_confident_warning_is_answered_locally() -> None:
    plan, d = run(POLICY, situation(), CONFIDENT)
    assert plan.run_model and not d.escalate and d.reasons == () and d.explain() is None


def test_unconfident_answer_escalates_with_the_number() -> None:
    plan, d = run(POLICY, situation(), UNSURE)
    assert d.escalate
    assert d.reasons == ("low confidence: p10 logprob -1.70 < -0.50",)


def test_threshold_is_strict() -> None:
    _, d = run(POLICY, situation(), Attempt(valid=True, confidence=-0.5))
    assert not d.escalate


def test_critical_severity_escalates_even_when_confident_and_drafts_first() -> None:
    plan, d = run(POLICY, situation(severity=Severity.CRITICAL), CONFIDENT)
    assert plan.run_model  # draft_before_escalating: the cloud gets the edge's answer too
    assert d.escalate and d.reasons == ("severity critical is critical",)


def test_critical_without_draft_skips_the_model() -> None:
    policy = EscalationPolicy(PolicySettings(draft_before_escalating=False))
    plan, d = run(policy, situation(severity=Severity.CRITICAL), None)
    assert not plan.run_model and d.escalate


def test_critical_flags_and_kinds_are_configurable() -> None:
    policy = EscalationPolicy(PolicySettings(critical_flags=["hive_weight_drop"], critical_kinds=["question"]))
    _, d = run(policy, situation(flags=("hive_weight_drop", "x")), CONFIDENT)
    assert d.reasons == ("flag hive_weight_drop is critical",)
    _, d = run(policy, situation(kind="question", flags=()), CONFIDENT)
    assert d.reasons == ("kind question is critical",)
    _, d = run(POLICY, situation(flags=("hive_weight_drop",)), CONFIDENT)
    assert not d.escalate


def test_operator_asked_for_cloud_skips_local_draft() -> None:
    plan, d = run(POLICY, situation(kind="question", want_cloud=True), None)
    assert not plan.run_model and d.escalate and d.reasons == ("operator asked for a cloud answer",)
    ignore = EscalationPolicy(PolicySettings(honour_want_cloud=False))
    plan, d = run(ignore, situation(kind="question", want_cloud=True), CONFIDENT)
    assert plan.run_model and not d.escalate


def test_invalid_local_answer_escalates() -> None:
    _, d = run(POLICY, situation(), Attempt(valid=False, error="answer cut off at max_tokens"))
    assert d.escalate and d.reasons == ("local answer invalid: answer cut off at max_tokens",)
    keep = EscalationPolicy(PolicySettings(escalate_invalid=False))
    _, d = run(keep, situation(), Attempt(valid=False, error="x"))
    assert not d.escalate


def test_entropy_rule() -> None:
    policy = EscalationPolicy(PolicySettings(min_confidence=-9, max_entropy=0.8))
    _, d = run(policy, situation(), UNSURE)
    assert d.escalate and d.reasons == ("high entropy: 1.20 nats > 0.80",)


def test_several_reasons_are_all_listed() -> None:
    _, d = run(POLICY, situation(severity=Severity.CRITICAL, want_cloud=True), UNSURE)
    assert d.reasons == ("severity critical is critical", "operator asked for a cloud answer",
                         "low confidence: p10 logprob -1.70 < -0.50")


@pytest.mark.parametrize("settings, s, blocker", [
    (PolicySettings(link="never"), situation(), "policy link=never: this device does not use the cloud"),
    (PolicySettings(link="online_only"), situation(link_up=False), "link is down and policy link=online_only"),
    (PolicySettings(max_escalations_per_hour=3), situation(escalations_last_hour=3),
     "radio budget spent: 3 escalations in the last hour (max 3)"),
    (PolicySettings(min_soc_for_radio=0.2), situation(battery_soc=0.1),
     "battery at 10% is below min_soc_for_radio 20%"),
])
def test_blockers_keep_the_answer_local_and_say_so(settings, s, blocker) -> None:
    plan, d = run(EscalationPolicy(settings), s, UNSURE)
    assert plan.run_model
    assert not d.escalate and d.blocked == blocker and not d.deferred
    threshold = settings.min_confidence
    assert d.explain() == f"low confidence: p10 logprob -1.70 < {threshold:.2f} (not escalated: {blocker})"


def test_link_down_with_queue_policy_still_escalates() -> None:
    _, d = run(POLICY, situation(link_up=False), UNSURE)
    assert d.escalate  # store and forward: the outbox sends it when the link returns


def test_cloud_request_blocked_runs_the_model_instead() -> None:
    policy = EscalationPolicy(PolicySettings(link="online_only"))
    plan, d = run(policy, situation(kind="question", want_cloud=True, link_up=False), CONFIDENT)
    assert plan.run_model and not d.escalate and d.blocked == "link is down and policy link=online_only"


def test_energy_short_skips_model_for_non_critical_and_escalates() -> None:
    plan, d = run(POLICY, situation(energy_short=True), CONFIDENT)
    assert not plan.run_model and d.escalate
    assert d.reasons == ("energy budget short: only critical events use the local model",)


def test_energy_short_and_escalation_blocked_defers() -> None:
    policy = EscalationPolicy(PolicySettings(link="never"))
    plan, d = run(policy, situation(energy_short=True), CONFIDENT)
    assert not plan.run_model and not d.escalate and d.deferred


def test_energy_short_still_runs_model_for_critical() -> None:
    plan, d = run(POLICY, situation(severity=Severity.CRITICAL, energy_short=True), CONFIDENT)
    assert plan.run_model and d.escalate
