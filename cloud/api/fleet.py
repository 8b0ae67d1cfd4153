"""Operator endpoints: the fleet, per-device events and answers, labels, escalations, and OTA commands.

Everything is read from the store, so any REST replica shows the same fleet. OTA
publishes an ``OtaCommand`` (QoS 1, waiting for the broker's ack) to one device or to
every known device of a site; the URL points at this server's ``/v1/images/{filename}``.
An operator's label (the true assessment of a stored event) is kept with the key that
made it; ``apiary fleet export-labels`` turns the labels into training data.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path as PathParam, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from apiary.shared.logs import get_logger
from apiary.shared.protocol import Assessment, OtaCommand, RollbackGrant

from apiary.cloud.api.errors import ERROR_RESPONSES
from apiary.cloud.api.schemas import ErrorResponse
from apiary.cloud.api.security import require
from apiary.cloud.auth import ApiKey
from apiary.cloud.rollouts import publish_command

# one dependency object, so a route that needs the caller's key gets the router's check (run once)
operator = require("operator")
router = APIRouter(prefix="/v1/fleet", tags=["operator"], dependencies=[Depends(operator)],
                   responses=ERROR_RESPONSES)
_log = get_logger("apiary.cloud.api.fleet")

NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
FILENAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$"
Name = Annotated[str, PathParam(pattern=NAME_PATTERN, max_length=64)]
Limit = Annotated[int, Query(ge=1, le=1000, description="newest first")]
EventId = Annotated[str, PathParam(min_length=1, max_length=64, description="the event's envelope_id")]
NOT_FOUND = {404: {"model": ErrorResponse, "description": "no stored event with this id"}}


class OtaRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    site: str = Field(pattern=NAME_PATTERN)
    device: str | None = Field(default=None, pattern=NAME_PATTERN, description="omit for every known device of the site")
    image_version: str = Field(min_length=1, max_length=64)
    filename: str = Field(pattern=FILENAME_PATTERN, description="a file in the server's images directory")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    signature: str = Field(pattern=r"^[0-9a-f]{128}$", description="Ed25519 signature of the manifest, hex")
    size: int = Field(ge=0)
    rollback: RollbackGrant | None = Field(default=None, description=(
        "an operator's signed rollback grant for this device and image (`apiary image rollback`): lets the device "
        "install an image older than the one it runs; needs device"))


class OtaTarget(BaseModel):
    site: str
    device: str
    topic: str
    acked: bool


class OtaPublished(BaseModel):
    url: str
    targets: list[OtaTarget]


class OtaProgress(BaseModel):
    image_version: str
    phase: str
    detail: str = ""
    progress: float | None = None
    received_at: float


class Device(BaseModel):
    """A node's last known state (from its birth/death/update certificates)."""

    site: str
    device: str
    role: str
    online: bool
    status: str  # the last certificate: birth | death | update
    session: int
    battery_soc: float | None = None
    battery_v: float | None = None
    solar_w: float | None = None
    model_version: str | None = None
    image_version: str | None = None
    budget_tokens_per_hour: float | None = None
    counters: dict[str, int] = {}
    first_seen: float
    last_seen: float
    last_birth: float | None = None
    last_death: float | None = None
    last_ota: OtaProgress | None = None


class OtaReport(OtaProgress):
    envelope_id: str
    site: str
    device: str


class LabelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    assessment: Assessment = Field(description="the true assessment of the event")
    note: str | None = Field(default=None, max_length=500)


class Label(BaseModel):
    assessment: str
    note: str | None = None
    key_id: str  # the operator key that labelled the event
    key_name: str = ""
    labelled_at: float


class Labelled(BaseModel):
    envelope_id: str
    label: Label
    replaced: Label | None = None  # the label this one overwrote


class Escalation(BaseModel):
    key: str  # the request envelope id
    request_id: str
    site: str
    device: str
    priority: int
    reason: str
    worker: str
    state: str  # pending | done
    outcome: str | None  # ok | expired | error | rejected | deferred
    received_at: float
    finished_at: float | None
    latency_ms: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    text: str | None
    action: dict[str, Any] | None
    error: str | None


def _ctx(request: Request):
    return request.app.state.ctx


@router.get("/devices", summary="Every known device with its last state")
def devices(request: Request, site: Annotated[str | None, Query(pattern=NAME_PATTERN)] = None) -> list[Device]:
    return _ctx(request).store.devices(site)


@router.get("/devices/{site}/{device}/events", summary="Recent sensor events of a device (SensorEvent fields "
            "plus envelope_id, received_at and label), newest first")
def events(request: Request, site: Name, device: Name, limit: Limit = 50) -> list[dict[str, Any]]:
    return _ctx(request).store.events(site, device, limit)


@router.get("/events/{event_id}", summary="One stored event (SensorEvent fields plus envelope_id, received_at "
            "and its label, null when unlabelled)", responses=NOT_FOUND)
def event(request: Request, event_id: EventId) -> dict[str, Any]:
    found = _ctx(request).store.event(event_id)
    if found is None:
        raise HTTPException(404, f"no stored event {event_id!r}")
    return found


@router.post("/events/{event_id}/label", summary="Record the true assessment of a stored event "
             "(a new label replaces the old one, which is returned as 'replaced')", responses=NOT_FOUND)
def label_event(request: Request, event_id: EventId, body: LabelRequest,
                key: Annotated[ApiKey, Depends(operator)]) -> Labelled:
    done = _ctx(request).store.label_event(event_id, body.assessment, note=body.note, key_id=key.key_id,
                                           key_name=key.name)
    if done is None:
        raise HTTPException(404, f"no stored event {event_id!r}")
    label, replaced = done
    if replaced is not None:
        _log.info("event %s relabelled %s -> %s by key %s", event_id, replaced["assessment"], body.assessment,
                  key.key_id)
    return Labelled(envelope_id=event_id, label=Label(**label), replaced=Label(**replaced) if replaced else None)


@router.get("/devices/{site}/{device}/answers", summary="Recent answers, edge or cloud (InferenceResult fields "
            "plus envelope_id and received_at), newest first")
def answers(request: Request, site: Name, device: Name, limit: Limit = 50) -> list[dict[str, Any]]:
    return _ctx(request).store.answers(site, device, limit)


@router.get("/devices/{site}/{device}/ota", summary="Recent OTA progress reports of a device")
def ota_progress(request: Request, site: Name, device: Name, limit: Limit = 50) -> list[OtaReport]:
    return _ctx(request).store.ota_statuses(site, device, limit)


@router.get("/escalations", summary="Escalations with outcome and latency, newest first")
def escalations(request: Request, limit: Limit = 50,
                site: Annotated[str | None, Query(pattern=NAME_PATTERN)] = None,
                outcome: Annotated[str | None, Query(pattern=r"^(ok|expired|error|rejected|deferred)$")] = None,
                ) -> list[Escalation]:
    return _ctx(request).store.escalations(limit, site=site, outcome=outcome)


@router.post("/ota", response_model=OtaPublished, summary="Send an OTA command to a device or a whole site",
             responses={404: {"model": ErrorResponse, "description": "no such image or no known device"},
                        503: {"model": ErrorResponse, "description": "no broker connection"}})
def publish_ota(request: Request, body: OtaRequest) -> OtaPublished:
    ctx = _ctx(request)
    image = Path(ctx.settings.images) / body.filename
    if not image.is_file():
        raise HTTPException(404, f"image {body.filename!r} is not in the images directory")
    if image.stat().st_size != body.size:
        raise HTTPException(422, f"size {body.size} does not match {body.filename} ({image.stat().st_size} bytes)")
    if body.rollback is not None and not body.device:
        raise HTTPException(422, "a rollback grant is signed for one device: give device")
    if ctx.transport is None or not ctx.transport.connected:
        raise HTTPException(503, "not connected to the MQTT broker; cannot publish the OTA command")
    if body.device:
        targets = [body.device]
    else:
        targets = [d["device"] for d in ctx.store.devices(body.site) if d["role"] != "cloud"]
        if not targets:
            raise HTTPException(404, f"no known devices at site {body.site!r}")
    url = image_url(request, body.filename)
    published = []
    for device in targets:
        cmd = OtaCommand(site=body.site, device=device, image_version=body.image_version, url=url,
                         sha256=body.sha256, signature=body.signature, size=body.size, rollback=body.rollback)
        topic, acked = publish_command(ctx.transport, cmd, sender=ctx.settings.worker_id)
        published.append(OtaTarget(site=body.site, device=device, topic=topic, acked=acked))
    return OtaPublished(url=url, targets=published)


def image_url(request: Request, filename: str) -> str:
    """Where devices download ``filename``: this server's image route, at ``public_url`` when configured."""
    base = (_ctx(request).settings.public_url or str(request.base_url)).rstrip("/")
    return f"{base}/v1/images/{filename}"


def safe_image_path(images_dir: str | Path, filename: str) -> Path | None:
    """The file in ``images_dir`` named ``filename``; None for anything else (traversal, dirs, links out)."""
    if not re.fullmatch(FILENAME_PATTERN, filename):
        return None
    root = Path(images_dir).resolve()
    path = (root / filename).resolve()
    return path if path.parent == root and path.is_file() else None
