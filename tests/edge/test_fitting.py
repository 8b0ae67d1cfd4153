"""Escalations fit the wire: context is trimmed (fewest events, then shorter fields) before the cloud is given up."""
from __future__ import annotations

from apiary.edge.fitting import encoded_size, fit, too_large
from apiary.shared.prompting import build_messages
from apiary.shared.protocol import EdgeAttempt, InferenceRequest, SensorEvent, Severity
from tests.edge.helpers import DEVICE, SITE, reading

LIMIT = 16 * 1024


def bulky(seq: int, n: int) -> SensorEvent:
    """A valid reading with ``n`` extra sensors (21 bytes each on the wire)."""
    return reading(seq, **{f"probe_{i:05d}": float(i) for i in range(n)})


def request(event: SensorEvent, context: list[SensorEvent], **fields) -> InferenceRequest:
    return InferenceRequest(request_id=f"{DEVICE}-{event.seq}", site=SITE, device=DEVICE, event=event,
                            context=context, messages=build_messages(event, context), deadline=1e9,
                            reason="severity critical is critical", priority=0,
                            edge_attempt=EdgeAttempt(text="x" * 300, confidence=-0.5), **fields)


def critical(seq: int, **changes: float) -> SensorEvent:
    return reading(seq, severity=Severity.CRITICAL, flags=("hive_temp_c_high",), hive_temp_c=40.5, **changes)


def test_a_request_that_fits_is_sent_as_it_is() -> None:
    req = request(critical(9), [reading(i) for i in range(1, 7)])
    fitted = fit(req, max_bytes=LIMIT)
    assert fitted.request == req and fitted.note is None


def test_the_largest_context_events_go_first_so_the_fewest_are_left_out() -> None:
    small = [reading(i) for i in (1, 2, 5, 6)]
    big3, big4 = bulky(3, 400), bulky(4, 300)  # ~8.4 KB and ~6.3 KB: only one fits next to the rest
    req = request(critical(9), [small[0], small[1], big3, big4, small[2], small[3]])
    assert encoded_size(req) > LIMIT
    fitted = fit(req, max_bytes=LIMIT)
    assert [e.seq for e in fitted.request.context] == [1, 2, 4, 5, 6]  # only the largest one left out
    assert fitted.request.messages == req.messages and fitted.request.edge_attempt == req.edge_attempt
    assert encoded_size(fitted.request) <= LIMIT
    assert fitted.note == "1 of 6 context events left out"


def test_then_the_fields_the_cloud_can_do_without_are_shortened() -> None:
    event = critical(9, **{f"probe_{i:05d}": float(i) for i in range(500)})  # the prompt repeats every reading
    req = request(event, [bulky(1, 300)])
    fitted = fit(req, max_bytes=LIMIT)
    assert fitted.request.context == [] and fitted.request.messages == []  # the cloud builds the prompt from the event
    assert fitted.request.event == event and fitted.request.reason == req.reason
    assert encoded_size(fitted.request) <= LIMIT
    assert fitted.note == "1 of 1 context events left out; prompt left out (the cloud builds it from the event)"


def test_an_event_too_large_alone_is_said_so_up_front_and_never_fitted() -> None:
    event = critical(9, **{f"probe_{i:05d}": float(i) for i in range(1200)})
    why = too_large(event, max_bytes=LIMIT)
    assert why is not None and why.startswith("event too large to escalate:") and f"{LIMIT}-byte" in why
    assert fit(request(event, []), max_bytes=LIMIT).request is None
    assert too_large(critical(9), max_bytes=LIMIT) is None


def test_whatever_too_large_lets_through_fits_once_trimmed() -> None:
    """The bare event passes the up-front check only if the most trimmed request fits: fit never fails after it."""
    for n in range(700, 1100, 25):
        event = critical(9, **{f"probe_{i:05d}": float(i) for i in range(n)})
        req = request(event, [bulky(1, 400)], max_tokens=4096, temperature=2.0)
        assert (too_large(event, max_bytes=LIMIT) is None) <= (fit(req, max_bytes=LIMIT).request is not None), n
