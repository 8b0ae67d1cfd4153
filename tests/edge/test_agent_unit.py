"""Pure pieces of the agent: stable ids and how a cloud reply becomes the final answer."""
from __future__ import annotations

from apiary.edge.agent import derived_id, final_from_reply
from apiary.shared.protocol import InferenceResult

DRAFT = InferenceResult(request_id="hive-01-7-abcd", site="north", device="hive-01", tier="edge", status="ok",
                        action={"assessment": "robbing", "action": "Reduce the entrance", "urgency": "medium",
                                "explanation": "x"}, confidence=-1.3, event_seq=7, latency_ms=900.0, energy_j=2.0,
                        escalation_reason="low confidence: p10 logprob -1.30 < -0.75")
NO_DRAFT = DRAFT.model_copy(update={"status": "expired", "action": None, "confidence": None,
                                    "escalation_reason": "operator asked for a cloud answer"})


def cloud(status: str = "ok", **kw) -> InferenceResult:
    action = {"assessment": "swarming", "action": "Look for queen cells", "urgency": "high", "explanation": "y"}
    return InferenceResult(request_id="cloud-side-id", site="north", device="hive-01", tier="cloud", status=status,
                           action=action if status == "ok" else None, prompt_tokens=900, completion_tokens=30, **kw)


def test_derived_ids_are_stable_and_distinct() -> None:
    assert derived_id("a", "ev1") == derived_id("a", "ev1")
    assert derived_id("a", "ev1") != derived_id("e", "ev1") != derived_id("a", "ev2")
    assert len(derived_id("a", "x" * 64)) == 32


def test_cloud_answer_becomes_final_with_the_edge_bookkeeping() -> None:
    final = final_from_reply(cloud(), DRAFT, waited_s=2.0)
    assert final.tier == "cloud" and final.action["assessment"] == "swarming"
    assert final.request_id == DRAFT.request_id and final.event_seq == 7
    assert final.escalation_reason == DRAFT.escalation_reason
    assert final.latency_ms == 2900.0 and final.prompt_tokens == 900


def test_failed_cloud_answer_falls_back_to_the_draft() -> None:
    final = final_from_reply(cloud("expired", error="deadline passed"), DRAFT, waited_s=1.0)
    assert final.tier == "edge" and final.action == DRAFT.action
    assert final.escalation_reason.endswith("cloud answered expired: deadline passed; local answer used")


def test_failed_cloud_answer_without_draft_is_passed_on() -> None:
    final = final_from_reply(cloud("rejected", error="too long"), NO_DRAFT, waited_s=1.0)
    assert final.tier == "cloud" and final.status == "rejected" and final.error == "too long"
    assert final.event_seq == 7 and final.request_id == NO_DRAFT.request_id
