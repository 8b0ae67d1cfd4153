"""One event in, one outcome out: triage, energy, local model, confidence, policy.

This is the agent's decision logic without MQTT or SQLite, so it can be tested and
benchmarked on its own: given an event, its context and whether the link is up, it
returns what to publish - a local final answer, an escalation request (with the local
draft to fall back on), a deferral, or nothing for a routine reading. An escalation always
fits the wire (``apiary.edge.fitting``): its context is trimmed to fit, and an event too large to
escalate at all is answered locally with the reason.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Literal, Sequence

from apiary.edge.confidence import Confidence, measure
from apiary.edge import fitting
from apiary.edge.energy import EnergyBudget
from apiary.edge.errors import EdgeError
from apiary.edge.model import Generation, LocalModel
from apiary.edge.policy import Attempt, Decision, EscalationPolicy, Plan, Situation
from apiary.edge.settings import EdgeSettings
from apiary.edge.triage import needs_answer
from apiary.shared.prompting import build_messages, parse_action
from apiary.shared.protocol import (DEFAULT_MAX_PAYLOAD, EdgeAttempt, InferenceRequest, InferenceResult, SensorEvent,
                             priority_for)

Route = Literal["logged", "answered", "escalated", "deferred"]


@dataclass(slots=True)
class Outcome:
    route: Route
    answer: InferenceResult | None = None  # final answer; for an escalation, the fallback if the cloud never answers
    request: InferenceRequest | None = None  # the escalation
    plan: Plan | None = None
    decision: Decision | None = None
    generation: Generation | None = None
    confidence: Confidence | None = None
    energy_j: float = 0.0
    trimmed: str | None = None  # what the escalation left out to fit the wire (edge.fitting), for logs


def without_truth(event: SensorEvent) -> SensorEvent:
    """The simulator's ground-truth label never leaves the device (nor is it read)."""
    return event.model_copy(update={"truth": None}) if event.truth is not None else event


def _status(valid: bool, attempt: Attempt | None, plan: Plan, decision: Decision) -> tuple[str, str | None]:
    """Status and error of the local answer (for an escalation: of the fallback)."""
    if valid:
        return "ok", None
    if attempt is not None:
        return "error", attempt.error
    if decision.deferred:
        return "deferred", f"deferred: {decision.blocked or plan.note}"
    return "expired", "no cloud answer before the deadline and no local draft"  # used only if the cloud never answers


class Responder:
    """Decides, for each event, who answers it and produces that answer or the escalation."""

    def __init__(self, settings: EdgeSettings, model: LocalModel, *, budget: EnergyBudget | None = None,
                 policy: EscalationPolicy | None = None, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        self.settings = settings
        self.model = model
        self.max_payload = max_payload  # the link's payload limit: an escalation envelope must fit it
        self.budget = budget or EnergyBudget(settings.power)
        self.policy = policy or EscalationPolicy(settings.policy)
        self._escalations: deque[float] = deque()

    def escalations_last_hour(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        while self._escalations and self._escalations[0] < now - 3600.0:
            self._escalations.popleft()
        return len(self._escalations)

    def respond(self, event: SensorEvent, context: Sequence[SensorEvent] = (), *, link_up: bool = True,
                request_id: str | None = None) -> Outcome:
        started = time.perf_counter()
        self.budget.observe(event.readings)
        if not needs_answer(event, context):
            return Outcome(route="logged")
        request_id = request_id or f"{event.device}-{event.seq}"
        threads, max_tokens = self.budget.knobs(self.settings.threads, self.settings.max_tokens)
        situation = Situation.of(event, link_up=link_up, escalations_last_hour=self.escalations_last_hour(),
                                 battery_soc=self.budget.battery_soc, energy_short=self.budget.short(max_tokens),
                                 too_large=fitting.too_large(without_truth(event), max_bytes=self.max_payload))
        plan = self.policy.plan(situation)
        style = getattr(self.model, "prompt_style", "examples")
        messages = build_messages(event, context, style=style)
        gen = conf = action = None
        attempt = None
        energy = 0.0
        if plan.run_model:
            try:
                self.model.set_threads(threads)
                gen = self.model.generate(messages, max_tokens=max_tokens)
            except EdgeError as e:
                attempt = Attempt(valid=False, error=f"local model failed: {e}")
            else:
                energy = self.budget.record(gen.cpu_s, gen.completion_tokens)
                action = parse_action(gen.text)
                p = self.settings.policy
                conf = measure(gen, quantile=p.quantile, span=p.confidence_span)
                error = None if action else ("answer cut off at max_tokens" if not gen.finished
                                             else "answer did not validate as an action")
                attempt = Attempt(valid=action is not None, confidence=conf.score, entropy=conf.entropy, error=error)
        decision = self.policy.decide(situation, plan, attempt)
        status, error = _status(action is not None, attempt, plan, decision)
        local = InferenceResult(
            request_id=request_id, site=event.site, device=event.device, status=status, tier="edge",
            text=gen.text if gen else "", action=action.model_dump(mode="json") if action else None,
            confidence=conf.score if conf else None, event_seq=event.seq, escalation_reason=decision.explain(),
            prompt_tokens=gen.prompt_tokens if gen else 0, completion_tokens=gen.completion_tokens if gen else 0,
            latency_ms=(time.perf_counter() - started) * 1000.0, energy_j=energy if gen else None,
            model=self.model.version, error=error)
        out = Outcome(route="answered", answer=local, plan=plan, decision=decision, generation=gen, confidence=conf,
                      energy_j=energy)
        if decision.deferred:
            out.route = "deferred"
        elif decision.escalate:
            self._escalations.append(time.monotonic())
            out.route = "escalated"
            request = InferenceRequest(
                request_id=request_id, site=event.site, device=event.device,
                # The cloud worker asks an untuned model with the request's messages as they are (it needs the
                # examples prompt) and rebuilds them for a tuned one, so they are the examples prompt whatever
                # style the local model reads.
                messages=messages if style == "examples" else build_messages(event, context),
                max_tokens=self.settings.cloud_max_tokens, temperature=0.0,
                priority=priority_for(event.severity, question=event.kind == "question"),
                deadline=time.time() + self.settings.escalation_deadline_s, event=without_truth(event),
                context=[without_truth(c) for c in context][-self.settings.context_events:],
                edge_attempt=EdgeAttempt(text=gen.text, action=local.action, confidence=local.confidence,
                                         logprob_quantiles=conf.quantiles if conf else {},
                                         completion_tokens=gen.completion_tokens) if gen else None,
                reason="; ".join(decision.reasons))
            fitted = fitting.fit(request, max_bytes=self.max_payload)
            if fitted.request is None:  # too_large() let the bare event through: it always fits
                raise EdgeError(f"escalation of {event.device} #{event.seq} does not fit {self.max_payload} bytes")
            out.request, out.trimmed = fitted.request, fitted.note
        return out
