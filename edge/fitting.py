"""Escalations that fit the wire: the context is trimmed before an event is kept from the cloud.

An escalation carries the event, the device's earlier events as context, the prompt and the
local draft. A few large (but valid) events in the context make it larger than the protocol's
payload limit, and an envelope that cannot be encoded left the event with no answer at all.
:func:`fit` leaves out as few context events as it can (the largest first), then the fields the
cloud can do without (the prompt, which it builds from the event; the draft's text; the draft;
a long reason), until the encoded envelope fits. :func:`too_large` says before anything runs
when not even the bare event fits, so the policy answers it locally and says why.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Iterator

from apiary.shared.protocol import DEFAULT_MAX_PAYLOAD, InferenceRequest, SensorEvent, encode, make

MAX_REASON = 200  # characters of the escalation reason kept when even the reason has to be shortened

# The largest envelope header the protocol accepts (id, sender, reply-to, correlation id): a request
# measured in it fits whatever topic and ids the agent gives it.
_HEADER = dict(id="x" * 64, sender="x" * 128, reply_to="x" * 512, correlation_id="x" * 128)


@dataclass(frozen=True, slots=True)
class Fitted:
    """What to send, and what was left out to make it fit (for logs)."""

    request: InferenceRequest | None  # None: not even the bare event fits
    note: str | None = None  # None when nothing was left out


def encoded_size(request: InferenceRequest) -> int:
    """Bytes of ``request`` encoded in the largest envelope header the protocol accepts."""
    return len(encode(make(request, **_HEADER), max_bytes=sys.maxsize))


def too_large(event: SensorEvent, *, max_bytes: int = DEFAULT_MAX_PAYLOAD) -> str | None:
    """Why ``event`` cannot be escalated even alone, or None when it can: the most :func:`fit` trims a
    request to is measured with every other field at its largest."""
    bare = InferenceRequest(request_id="x" * 128, site=event.site, device=event.device, event=event,
                            max_tokens=4096, temperature=2.0, priority=0, deadline=0.0, reason="x" * MAX_REASON)
    size = encoded_size(bare)
    if size <= max_bytes:
        return None
    return f"event too large to escalate: {size} bytes even without context, over the {max_bytes}-byte limit"


def fit(request: InferenceRequest, *, max_bytes: int = DEFAULT_MAX_PAYLOAD) -> Fitted:
    """The least trimmed version of ``request`` whose envelope encodes within ``max_bytes``."""
    for candidate, note in _trimmed(request):
        if encoded_size(candidate) <= max_bytes:
            return Fitted(candidate, note)
    return Fitted(None, "not even the bare event fits")


def _trimmed(request: InferenceRequest) -> Iterator[tuple[InferenceRequest, str | None]]:
    """``request``, then ever more trimmed versions of it, each with what it leaves out."""
    yield request, None
    context = list(request.context)
    # largest first (the oldest of equals), so the fewest events are left out
    order = sorted(range(len(context)), key=lambda i: (-len(encode(make(context[i], sender="x"), max_bytes=sys.maxsize)), i))
    notes: list[str] = []
    for n in range(1, len(context) + 1):
        dropped = set(order[:n])
        notes = [f"{n} of {len(context)} context events left out"]
        request = request.model_copy(update={"context": [e for i, e in enumerate(context) if i not in dropped]})
        yield request, notes[0]
    for field, update, note in (
            ("messages", {"messages": []}, "prompt left out (the cloud builds it from the event)"),
            ("edge_attempt", {"edge_attempt": request.edge_attempt and request.edge_attempt.model_copy(
                update={"text": ""})}, "draft text left out"),
            ("edge_attempt", {"edge_attempt": None}, "draft left out"),
            ("reason", {"reason": request.reason[:MAX_REASON]}, "reason shortened")):
        if getattr(request, field) != update[field]:
            request = request.model_copy(update=update)
            notes.append(note)
            yield request, "; ".join(notes)
