"""When the edge asks the cloud, as explainable rules: every decision lists the reasons it fired.

The policy is pure: it looks at a :class:`Situation` (the event's severity, kind,
flags, the operator's wish, the link, the energy and radio budgets) and, after the
local model ran, at its :class:`Attempt` (did the answer validate, how confident).
Two questions are asked in order:

1. :meth:`EscalationPolicy.plan` - before spending energy: run the local model? Routine
   work is skipped when the energy budget is short (only critical events get the model;
   the rest go to the cloud or are deferred); an operator's explicit cloud request skips
   the local draft unless configured otherwise.
2. :meth:`EscalationPolicy.decide` - escalate? Yes when any reason fires: critical
   severity/kind/flag, operator asked for cloud, the local answer failed validation, or
   confidence (a low logprob quantile) is below ``min_confidence`` / entropy above
   ``max_entropy``; and no blocker forbids it (an event too large for the wire, link
   policy, radio budget, battery). A blocked escalation is answered locally and the answer
   says why.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from apiary.edge.settings import PolicySettings
from apiary.shared.protocol import SensorEvent, Severity


_CRITICAL = re.compile(r"(severity|kind|flag) .+ is critical")


def rule_of(reason: str) -> str:
    """The rule behind one reason the policy gives, without its values: "low confidence" for "low
    confidence: p10 logprob -2.31 < -1.50", "critical flag" for "flag swarm_risk is critical". Reasons
    are counted by rule; their values differ at every event."""
    head = reason.split(":", 1)[0].strip()
    critical = _CRITICAL.fullmatch(head)
    return f"critical {critical.group(1)}" if critical else head or "unspecified"


@dataclass(frozen=True, slots=True)
class Situation:
    """Everything the policy may look at besides the model's answer."""

    severity: Severity
    kind: str
    flags: tuple[str, ...]
    want_cloud: bool
    link_up: bool
    escalations_last_hour: int = 0
    battery_soc: float | None = None
    energy_short: bool = False  # the energy budget cannot pay for a local inference now
    too_large: str | None = None  # why the event cannot be escalated at any size (edge.fitting.too_large)

    @classmethod
    def of(cls, event: SensorEvent, *, link_up: bool, escalations_last_hour: int = 0,
           battery_soc: float | None = None, energy_short: bool = False,
           too_large: str | None = None) -> "Situation":
        return cls(severity=event.severity, kind=event.kind, flags=tuple(event.flags), want_cloud=event.want_cloud,
                   link_up=link_up, escalations_last_hour=escalations_last_hour, battery_soc=battery_soc,
                   energy_short=energy_short, too_large=too_large)


@dataclass(frozen=True, slots=True)
class Attempt:
    """The local model's answer as the policy sees it."""

    valid: bool
    confidence: float | None = None  # Confidence.score
    entropy: float | None = None  # Confidence.entropy
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    run_model: bool
    reasons: tuple[str, ...]  # reasons to escalate known before the model runs
    note: str = ""  # why the model is (not) run, for the answer and logs


@dataclass(frozen=True, slots=True)
class Decision:
    escalate: bool
    reasons: tuple[str, ...]  # every rule that wanted the cloud
    blocked: str | None = None  # why it was not escalated although wanted
    deferred: bool = False  # no usable answer: neither the model nor the cloud may be used now

    def explain(self) -> str | None:
        """One line for ``InferenceResult.escalation_reason``; None when nothing wanted the cloud."""
        if not self.reasons:
            return self.blocked
        wanted = "; ".join(self.reasons)
        return f"{wanted} (not escalated: {self.blocked})" if self.blocked else wanted


class EscalationPolicy:
    def __init__(self, settings: PolicySettings | None = None) -> None:
        self.settings = settings or PolicySettings()

    def critical(self, s: Situation) -> list[str]:
        """Reasons that make an event critical: it goes to the cloud whatever the model says."""
        cfg = self.settings
        reasons = []
        if s.severity in cfg.critical_severities:
            reasons.append(f"severity {s.severity.value} is critical")
        if s.kind in cfg.critical_kinds:
            reasons.append(f"kind {s.kind} is critical")
        hot = [f for f in s.flags if f in cfg.critical_flags]
        if hot:
            reasons.append(f"flag {', '.join(hot)} is critical")
        return reasons

    def blocker(self, s: Situation) -> str | None:
        """Why an escalation may not be sent now, or None."""
        cfg = self.settings
        if s.too_large is not None:
            return s.too_large
        if cfg.link == "never":
            return "policy link=never: this device does not use the cloud"
        if cfg.link == "online_only" and not s.link_up:
            return "link is down and policy link=online_only"
        if cfg.max_escalations_per_hour is not None and s.escalations_last_hour >= cfg.max_escalations_per_hour:
            return f"radio budget spent: {s.escalations_last_hour} escalations in the last hour " \
                   f"(max {cfg.max_escalations_per_hour})"
        if s.battery_soc is not None and s.battery_soc < cfg.min_soc_for_radio:
            return f"battery at {s.battery_soc:.0%} is below min_soc_for_radio {cfg.min_soc_for_radio:.0%}"
        return None

    def plan(self, s: Situation) -> Plan:
        """Decide whether to spend energy on the local model for this event."""
        cfg = self.settings
        critical = self.critical(s)
        reasons = list(critical)
        asked = cfg.honour_want_cloud and s.want_cloud
        if asked:
            reasons.append("operator asked for a cloud answer")
        blocked = self.blocker(s)
        if s.energy_short and not critical:
            reasons.append("energy budget short: only critical events use the local model")
            return Plan(run_model=False, reasons=tuple(reasons), note="energy budget short")
        if reasons and blocked is None:
            draft = (critical and cfg.draft_before_escalating) or (asked and not critical and cfg.draft_when_cloud_asked)
            if not draft:
                return Plan(run_model=False, reasons=tuple(reasons), note="escalating without a local draft")
        return Plan(run_model=True, reasons=tuple(reasons))

    def decide(self, s: Situation, plan: Plan, attempt: Attempt | None) -> Decision:
        """Escalate or answer locally, with every reason that fired and any blocker."""
        cfg = self.settings
        reasons = list(plan.reasons)
        if attempt is not None:
            if not attempt.valid:
                if cfg.escalate_invalid:
                    reasons.append(f"local answer invalid: {attempt.error or 'did not parse as an action'}")
            else:
                if attempt.confidence is not None and attempt.confidence < cfg.min_confidence:
                    reasons.append(f"low confidence: p{cfg.quantile * 100:.0f} logprob {attempt.confidence:.2f} "
                                   f"< {cfg.min_confidence:.2f}")
                if cfg.max_entropy is not None and attempt.entropy is not None and attempt.entropy > cfg.max_entropy:
                    reasons.append(f"high entropy: {attempt.entropy:.2f} nats > {cfg.max_entropy:.2f}")
        if not reasons:
            return Decision(escalate=False, reasons=())
        blocked = self.blocker(s)
        if blocked is None:
            return Decision(escalate=True, reasons=tuple(reasons))
        return Decision(escalate=False, reasons=tuple(reasons), blocked=blocked, deferred=attempt is None)
