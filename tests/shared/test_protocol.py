"""The envelope round-trips every message type and rejects bad bytes with ProtocolError only."""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apiary.shared import protocol as p

EVENT = p.SensorEvent(site="meadow", device="hive-0001", seq=7, timestamp=1.7e9,
                      readings={"hive_temp_c": 35.2, "hive_weight_kg": 41.5}, severity=p.Severity.WARNING,
                      flags=["hive_temp_high"], truth="heat_stress")

BODIES: list[p.Body] = [
    EVENT,
    p.SensorEvent(site="s", device="d", seq=0, timestamp=0.0, readings={}, kind="question",
                  question="Is hive 3 queenless?", want_cloud=True),
    p.InferenceRequest(
        request_id="r-1", site="meadow", device="hive-0001", priority=0, deadline=1.7e9 + 30,
        messages=[p.ChatMessage(role="system", content="You watch hives."), p.ChatMessage(role="user", content="?")],
        event=EVENT, context=[EVENT],
        edge_attempt=p.EdgeAttempt(text='{"assessment": "normal"}', action={"assessment": "normal"}, confidence=-2.5,
                                   logprob_quantiles={"p10": -2.5, "min": -4.0}, completion_tokens=12),
        reason="low_confidence"),
    p.InferenceResult(request_id="r-1", site="meadow", device="hive-0001", tier="cloud", text="{}",
                      action={"assessment": "heat_stress", "action": "shade", "urgency": "high"}, confidence=-0.2,
                      logprob_quantiles={"p10": -0.2, "min": -0.3, "n_all": 41.0}, event_seq=7, prompt_tokens=120, completion_tokens=30, latency_ms=812.5, model="smollm2"),
    p.DeviceState(site="meadow", device="hive-0001", status="birth", online=True, session=3, battery_soc=0.81,
                  battery_v=3.9, solar_w=2.5, model_version="smollm2-135m-q4", counters={"answered": 4}),
    p.OtaCommand(site="meadow", device="hive-0001", image_version="1.2.0", url="http://cloud/v1/images/a.tar",
                 sha256="ab" * 32, signature="cd" * 64, size=1234),
    p.OtaStatus(site="meadow", device="hive-0001", image_version="1.2.0", phase="downloading", progress=0.5),
]


@pytest.mark.parametrize("body", BODIES, ids=lambda b: type(b).__name__)
def test_round_trip_every_type(body: p.Body) -> None:
    env = p.make(body, sender="test", reply_to="apiary/v1/meadow/hive-0001/reply", correlation_id="c-1")
    back = p.decode(p.encode(env))
    assert back == env
    assert back.type == p.TYPE_OF_BODY[type(body)]


def test_every_message_type_has_a_body() -> None:
    assert set(p.BODY_TYPES) == set(p.MessageType)
    assert {type(b) for b in BODIES} == set(p.BODY_TYPES.values())


def _wire(**overrides):
    env = p.make(EVENT, sender="t")
    raw = msgpack.unpackb(p.encode(env))
    raw.update(overrides)
    return msgpack.packb(raw)


@pytest.mark.parametrize("data, message", [
    (b"", "empty"),
    (b"\xc1", "not a msgpack"),
    (msgpack.packb([1, 2, 3]), "must be a map"),
    (_wire(v=2), "unknown schema version"),
    (_wire(v="1"), "unknown schema version"),
    (_wire(type="telepathy"), "unknown message type"),
    (_wire(ts="yesterday"), "bad envelope"),
    (_wire(body={"site": "meadow"}), "bad sensor_event body"),
    (_wire(body={**msgpack.unpackb(_wire())["body"], "seq": "7"}), "seq"),
    (_wire(body={**msgpack.unpackb(_wire())["body"], "device": "a/b"}), "device"),
    (_wire(extra_field=1), "bad envelope"),
])
def test_rejections_name_the_problem(data: bytes, message: str) -> None:
    with pytest.raises(p.ProtocolError, match=message):
        p.decode(data)


def test_size_limit_on_both_sides() -> None:
    big = p.make(p.SensorEvent(site="s", device="d", seq=1, timestamp=0.0,
                               readings={f"r{i}": float(i) for i in range(2000)}), sender="t")
    with pytest.raises(p.ProtocolError, match="over the 1024-byte limit"):
        p.encode(big, max_bytes=1024)
    data = p.encode(big)
    with pytest.raises(p.ProtocolError, match="over the 1024-byte limit"):
        p.decode(data, max_bytes=1024)


def test_unknown_optional_fields_are_ignored_within_a_version() -> None:
    raw = msgpack.unpackb(_wire())
    raw["body"]["added_in_a_later_minor"] = True
    assert p.decode(msgpack.packb(raw)).body == EVENT


def test_results_from_senders_without_confidence_fields_still_decode() -> None:
    """InferenceResult.logprob_quantiles (and confidence) are optional: a result from an older sender decodes."""
    result = next(b for b in BODIES if isinstance(b, p.InferenceResult))
    raw = msgpack.unpackb(p.encode(p.make(result, sender="t")))
    assert raw["body"]["logprob_quantiles"]["p10"] == -0.2
    del raw["body"]["logprob_quantiles"], raw["body"]["confidence"]
    body = p.decode(msgpack.packb(raw)).body
    assert body.confidence is None and body.logprob_quantiles == {}
    assert body == result.model_copy(update={"confidence": None, "logprob_quantiles": {}})


def test_priority_from_severity() -> None:
    assert p.priority_for(p.Severity.CRITICAL) < p.priority_for(p.Severity.WARNING) < p.priority_for(p.Severity.INFO)
    assert p.priority_for(p.Severity.INFO, question=True) == p.PRIORITY_QUESTION
    assert p.priority_for(p.Severity.CRITICAL, question=True) == 0


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2048))
def test_random_bytes_only_raise_protocol_error(data: bytes) -> None:
    try:
        p.decode(data)
    except p.ProtocolError:
        pass


VALID = [p.encode(p.make(b, sender="fuzz")) for b in BODIES]


@settings(max_examples=600, deadline=None)
@given(st.sampled_from(VALID), st.data())
def test_mutated_envelopes_only_raise_protocol_error(valid: bytes, data: st.DataObject) -> None:
    buf = bytearray(valid)
    op = data.draw(st.sampled_from(["flip", "truncate", "insert", "splice"]))
    if op == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(buf) - 1))
            buf[i] ^= 1 << data.draw(st.integers(0, 7))
    elif op == "truncate":
        buf = buf[: data.draw(st.integers(0, len(buf) - 1))]
    elif op == "insert":
        i = data.draw(st.integers(0, len(buf)))
        buf[i:i] = data.draw(st.binary(min_size=1, max_size=16))
    else:
        buf += data.draw(st.sampled_from(VALID))
    try:
        env = p.decode(bytes(buf))
    except p.ProtocolError:
        return
    assert isinstance(env.body, tuple(p.BODY_TYPES.values()))  # a mutation may still be a valid envelope


SCALARS = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
           | st.binary(max_size=8))
DOCS = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                    max_leaves=20)
HEADER_KEYS = ["v", "id", "type", "ts", "sender", "reply_to", "corr", "body"]


@settings(max_examples=300, deadline=None)
@given(st.one_of(DOCS, st.dictionaries(st.sampled_from(HEADER_KEYS), DOCS | st.just(1) | st.sampled_from(
    [m.value for m in p.MessageType]), max_size=8)))
def test_arbitrary_msgpack_documents_only_raise_protocol_error(doc) -> None:
    try:
        p.decode(msgpack.packb(doc, use_bin_type=True))
    except p.ProtocolError:
        pass


# Values msgpack carries but the stores cannot hold (SQLite INTEGER is signed 64-bit; NaN becomes NULL) are
# refused at decode, so every consumer gets one clear ProtocolError instead of a crash or a silent drop.
def _body_wire(body: p.Body, **fields) -> bytes:
    raw = msgpack.unpackb(p.encode(p.make(body, sender="t")))
    raw["body"].update(fields)
    return msgpack.packb(raw)


RESULT = next(b for b in BODIES if isinstance(b, p.InferenceResult))
STATE = next(b for b in BODIES if isinstance(b, p.DeviceState))


@pytest.mark.parametrize("data, message", [
    (_body_wire(EVENT, seq=2**64 - 1), "seq: Input should be less than or equal to 9223372036854775807"),
    (_body_wire(EVENT, seq=2**63), "seq"),
    (_body_wire(EVENT, timestamp=float("nan")), "timestamp: Input should be a finite number"),
    (_body_wire(EVENT, timestamp=float("inf")), "timestamp: Input should be a finite number"),
    (_body_wire(EVENT, readings={"hive_temp_c": float("nan")}), "readings.hive_temp_c: Input should be a finite"),
    (_body_wire(EVENT, readings={"hive_temp_c": float("-inf")}), "readings.hive_temp_c: Input should be a finite"),
    (_body_wire(STATE, session=2**64 - 1), "session"),
    (_body_wire(STATE, counters={"answered": 2**63}), "counters.answered"),
    (_body_wire(STATE, battery_v=float("nan")), "battery_v"),
    (_body_wire(RESULT, event_seq=2**64 - 1), "event_seq"),
    (_body_wire(RESULT, latency_ms=float("nan")), "latency_ms"),
    (_body_wire(RESULT, confidence=float("-inf")), "confidence"),
    (_wire(ts=float("nan")), "ts: Input should be a finite number"),
])
def test_values_storage_cannot_hold_are_refused_at_decode(data: bytes, message: str) -> None:
    with pytest.raises(p.ProtocolError, match=message):
        p.decode(data)


def test_the_largest_values_storage_holds_still_decode() -> None:
    top = 2**63 - 1
    event = p.decode(_body_wire(EVENT, seq=top, timestamp=-1e300, readings={"x": 1.5e308})).body
    assert event.seq == top and event.readings == {"x": 1.5e308}
    assert p.decode(_body_wire(STATE, session=top, counters={"n": -top - 1})).body.session == top
