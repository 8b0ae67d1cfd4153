"""The wire protocol: one versioned msgpack envelope for every message on the mesh.

Every MQTT payload is an :class:`Envelope` (id, type, schema version, timestamp,
sender, optional reply-to and correlation id, body) encoded with msgpack. Decoding
validates everything and fails with exactly one exception type, :class:`ProtocolError`,
so a consumer can drop (and count) bad input without ever crashing.

Compatibility rule: within one ``SCHEMA_VERSION`` new *optional* body fields may be
added (older decoders ignore them); removing, renaming or retyping a field bumps the
version, and decoders reject versions they do not know.

Every number on the wire must be one the stores can hold: floats are finite (SQLite turns
NaN into NULL) and ints fit a signed 64-bit integer (SQLite's INTEGER), so a value that
msgpack carries but storage cannot is a :class:`ProtocolError` at decode, never a crash or
a silent drop deep in a consumer.
"""
from __future__ import annotations

import json
import time
import uuid
from enum import StrEnum
from typing import Annotated, Any, Literal, TypeAlias

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

SCHEMA_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})
DEFAULT_MAX_PAYLOAD = 256 * 1024  # bytes; brokers and devices both cap payloads


class ProtocolError(ValueError):
    """Raised for any payload that is not a valid envelope: not msgpack, too large,
    unknown schema version or message type, missing fields or wrong types."""


class MessageType(StrEnum):
    SENSOR_EVENT = "sensor_event"
    INFERENCE_REQUEST = "inference_request"
    INFERENCE_RESULT = "inference_result"
    DEVICE_STATE = "device_state"
    OTA_COMMAND = "ota_command"
    OTA_STATUS = "ota_status"


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


# Smaller is more urgent, matching the cloud engine's scheduler order.
PRIORITY_BY_SEVERITY: dict[Severity, int] = {Severity.CRITICAL: 0, Severity.WARNING: 3, Severity.INFO: 6}
PRIORITY_QUESTION = 2  # an operator waiting on an answer outranks routine warnings


def priority_for(severity: Severity, *, question: bool = False) -> int:
    """Engine priority for an event: critical first, operator questions next."""
    p = PRIORITY_BY_SEVERITY[Severity(severity)]
    return min(p, PRIORITY_QUESTION) if question else p


# The assessment vocabulary shared by the simulator's ground-truth labels, the edge and cloud answers.
ASSESSMENTS = ("normal", "heat_stress", "swarming", "robbing", "sensor_fault", "low_battery")
Assessment = Literal["normal", "heat_stress", "swarming", "robbing", "sensor_fault", "low_battery"]
Urgency = Literal["low", "medium", "high"]


SeverityField = Annotated[Severity, Field(strict=False)]  # enums arrive as their string values


class _Body(BaseModel):
    # strict: msgpack gives exact types, so "1" for an int is a real error, not something to coerce
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]

INT64_MAX = 2**63 - 1  # SQLite's INTEGER is signed 64-bit: larger ints raise OverflowError when stored
Finite = Annotated[float, Field(allow_inf_nan=False)]  # NaN is stored as NULL and compares unequal to itself
Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]  # sequence numbers, sessions, sizes, token counts


class SensorEvent(_Body):
    """What a device's sensors saw, as published by the firmware bridge (or an operator question)."""

    site: Name
    device: Name
    seq: Count
    timestamp: Finite  # sensor time, unix seconds
    readings: dict[str, Finite]
    severity: SeverityField = Severity.INFO
    kind: Literal["reading", "question"] = "reading"
    flags: list[str] = Field(default_factory=list)  # threshold rules the bridge saw crossed, e.g. "hive_temp_high"
    question: str | None = None  # operator question (kind == "question")
    want_cloud: bool = False  # operator asked for a cloud answer
    truth: str | None = None  # simulator ground-truth label, for evaluation only; agents never read it


class Action(_Body):
    """The JSON action every answer carries (edge model output, constrained by a grammar; cloud output, parsed)."""

    assessment: Assessment
    action: str = Field(max_length=200)
    urgency: Urgency
    explanation: str = Field(default="", max_length=500)


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant"]
    content: str


class EdgeAttempt(_Body):
    """The edge model's own answer and how sure it was, sent along with an escalation."""

    text: str
    action: dict[str, Any] | None = None
    confidence: Finite | None = None  # the policy's confidence score (e.g. p10 token logprob)
    logprob_quantiles: dict[str, Finite] = Field(default_factory=dict)
    completion_tokens: Count = 0


class InferenceRequest(_Body):
    """An escalation from an edge device (or any client) to the cloud tier."""

    request_id: str = Field(min_length=1, max_length=128)
    site: Name
    device: Name
    messages: list[ChatMessage] = Field(default_factory=list)
    prompt: str | None = None
    max_tokens: int = Field(default=128, ge=1, le=4096)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    priority: int = Field(default=6, ge=0, le=9)
    deadline: Finite | None = None  # unix seconds; the cloud answers "expired" after it
    event: SensorEvent | None = None
    context: list[SensorEvent] = Field(default_factory=list)
    edge_attempt: EdgeAttempt | None = None
    reason: str = ""  # why the edge escalated
    response_format: Literal["text", "json_action"] = "json_action"


class InferenceResult(_Body):
    """A final (or cloud) answer: who answered, what, how fast, at what token cost."""

    request_id: str = Field(min_length=1, max_length=128)
    site: Name
    device: Name
    status: Literal["ok", "expired", "error", "rejected", "deferred"] = "ok"
    tier: Literal["edge", "cloud"]
    text: str = ""
    action: dict[str, Any] | None = None
    # How sure the answering model was, by the same rule on both tiers (shared.confidence): the p10 choice
    # logprob of the decision tokens, and its summary (as EdgeAttempt's). Optional: older senders omit them.
    confidence: Finite | None = None
    logprob_quantiles: dict[str, Finite] = Field(default_factory=dict)
    event_seq: Count | None = None
    escalation_reason: str | None = None
    prompt_tokens: Count = 0
    completion_tokens: Count = 0
    latency_ms: Finite = 0.0
    energy_j: Finite | None = None
    model: str = ""
    error: str | None = None


class DeviceState(_Body):
    """Sparkplug-style birth/death certificate and telemetry; retained on the state topic."""

    site: Name
    device: Name
    status: Literal["birth", "death", "update"]
    online: bool
    session: Count  # bdSeq: new on every birth; a death or update counts only for the node's current session
    role: Literal["edge", "bridge", "cloud"] = "edge"
    battery_soc: float | None = Field(default=None, ge=0.0, le=1.0)
    battery_v: Finite | None = None
    solar_w: Finite | None = None
    model_version: str | None = None
    image_version: str | None = None  # the signed edge image the running model came from (None: not from one)
    budget_tokens_per_hour: Finite | None = None
    counters: dict[str, Int64] = Field(default_factory=dict)


class RollbackGrant(_Body):
    """An operator's signed permission for one device to install one older image, once, until ``expires``.

    The signature (Ed25519, by a key in the device's ``[edge.ota] operator_keys``) covers
    :func:`rollback_message`: the command's site, device, image version and archive sha256, ``rollback: true``,
    ``expires`` and ``nonce``. So it cannot be moved to another device or image, used after it expires, or used
    twice (the device keeps the nonces it spent)."""

    expires: Count  # unix seconds
    nonce: str = Field(pattern=r"^[0-9a-f]{16,64}$")
    signature: str = Field(pattern=r"^[0-9a-f]{128}$")  # Ed25519 over rollback_message(...), hex


def rollback_message(site: str, device: str, image_version: str, sha256: str, expires: int, nonce: str) -> bytes:
    """The exact bytes a :class:`RollbackGrant` signs: canonical JSON (sorted keys, no spaces) of the command's
    fields that must not change, with ``rollback: true`` so no other signed document can pass for one."""
    doc = {"site": site, "device": device, "image_version": image_version, "sha256": sha256, "rollback": True,
           "expires": expires, "nonce": nonce}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


class OtaCommand(_Body):
    site: Name
    device: Name
    image_version: str = Field(min_length=1, max_length=64)
    url: str = Field(min_length=1, max_length=2048)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    signature: str  # Ed25519 signature of the manifest, hex
    size: Count
    # An explicit rollback to an older image (added within schema version 1; without it a device refuses
    # anything older than what it runs).
    rollback: RollbackGrant | None = None

    def rollback_message(self, expires: int, nonce: str) -> bytes:
        """What a rollback grant for this command signs (:func:`rollback_message`)."""
        return rollback_message(self.site, self.device, self.image_version, self.sha256, expires, nonce)


OtaPhase = Literal[
    "received", "downloading", "downloaded", "verified", "installed", "health_check",
    "committed", "rolled_back", "refused", "failed",
    "deferred",  # the battery is too low for an update now; the device takes it up again when it recovers
]


class OtaStatus(_Body):
    site: Name
    device: Name
    image_version: str
    phase: OtaPhase
    detail: str = ""
    progress: float | None = Field(default=None, ge=0.0, le=1.0)
    slot: str | None = None


Body: TypeAlias = SensorEvent | InferenceRequest | InferenceResult | DeviceState | OtaCommand | OtaStatus

BODY_TYPES: dict[MessageType, type[_Body]] = {
    MessageType.SENSOR_EVENT: SensorEvent,
    MessageType.INFERENCE_REQUEST: InferenceRequest,
    MessageType.INFERENCE_RESULT: InferenceResult,
    MessageType.DEVICE_STATE: DeviceState,
    MessageType.OTA_COMMAND: OtaCommand,
    MessageType.OTA_STATUS: OtaStatus,
}
TYPE_OF_BODY: dict[type[_Body], MessageType] = {cls: t for t, cls in BODY_TYPES.items()}


class _Header(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    v: int
    id: str = Field(min_length=1, max_length=64)
    type: str
    ts: Finite
    sender: str = Field(min_length=1, max_length=128)
    reply_to: str | None = Field(default=None, max_length=512)
    corr: str | None = Field(default=None, max_length=128)
    body: dict[str, Any]


class Envelope(BaseModel):
    """One message on the mesh. ``id`` is unique per message and is what consumers de-duplicate on."""

    model_config = ConfigDict(frozen=True)

    id: str
    type: MessageType
    ts: float
    sender: str
    body: Body
    reply_to: str | None = None
    correlation_id: str | None = None
    version: int = SCHEMA_VERSION


def new_id() -> str:
    return uuid.uuid4().hex


def make(body: Body, *, sender: str, reply_to: str | None = None, correlation_id: str | None = None,
         id: str | None = None) -> Envelope:
    """Wrap a body in a fresh envelope (new id, current time)."""
    return Envelope(id=id or new_id(), type=TYPE_OF_BODY[type(body)], ts=time.time(), sender=sender, body=body,
                    reply_to=reply_to, correlation_id=correlation_id)


def encode(env: Envelope, *, max_bytes: int = DEFAULT_MAX_PAYLOAD) -> bytes:
    """Envelope to msgpack bytes; refuses to produce a payload receivers would reject."""
    wire = {
        "v": env.version, "id": env.id, "type": env.type.value, "ts": env.ts, "sender": env.sender,
        "reply_to": env.reply_to, "corr": env.correlation_id,
        "body": env.body.model_dump(mode="json", exclude_defaults=True),
    }
    data = msgpack.packb(wire, use_bin_type=True)
    if len(data) > max_bytes:
        raise ProtocolError(f"encoded {env.type.value} is {len(data)} bytes, over the {max_bytes}-byte limit")
    return data


def decode(data: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_PAYLOAD) -> Envelope:
    """Bytes to a validated envelope, or :class:`ProtocolError` saying exactly what is wrong."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"payload must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProtocolError(f"payload is {len(data)} bytes, over the {max_bytes}-byte limit")
    if len(data) == 0:
        raise ProtocolError("empty payload")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError, TypeError, OverflowError, RecursionError) as e:
        raise ProtocolError(f"not a msgpack document: {e.__class__.__name__}: {e}") from None
    if not isinstance(raw, dict):
        raise ProtocolError(f"envelope must be a map, got {type(raw).__name__}")
    version = raw.get("v")
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        raise ProtocolError(f"unknown schema version {version!r}; supported: {sorted(SUPPORTED_VERSIONS)}")
    try:
        header = _Header.model_validate(raw)
        msg_type = MessageType(header.type)
    except ValidationError as e:
        raise ProtocolError(f"bad envelope: {_summarise(e)}") from None
    except ValueError:
        raise ProtocolError(f"unknown message type {raw.get('type')!r}") from None
    try:
        body = BODY_TYPES[msg_type].model_validate(header.body)
    except ValidationError as e:
        raise ProtocolError(f"bad {msg_type.value} body: {_summarise(e)}") from None
    return Envelope(id=header.id, type=msg_type, ts=header.ts, sender=header.sender, body=body,
                    reply_to=header.reply_to, correlation_id=header.corr, version=header.v)


def _summarise(e: ValidationError) -> str:
    parts = [f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in e.errors()[:5]]
    more = f" (+{e.error_count() - 5} more)" if e.error_count() > 5 else ""
    return "; ".join(parts) + more
