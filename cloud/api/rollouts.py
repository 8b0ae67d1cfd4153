"""Fleet rollouts: ``POST /v1/fleet/rollouts`` takes an image the server holds to a set of devices in waves,
``GET /v1/fleet/rollouts[/{id}]`` shows them (cloud/rollouts.py drives them; the store keeps them)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path as PathParam, Query, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException

from apiary.cloud import rollouts
from apiary.cloud.api.errors import ERROR_RESPONSES
from apiary.cloud.api.fleet import FILENAME_PATTERN, NAME_PATTERN, image_url, operator, safe_image_path
from apiary.cloud.api.schemas import ErrorResponse
from apiary.cloud.auth import ApiKey
from apiary.cloud.errors import CloudError

router = APIRouter(prefix="/v1/fleet/rollouts", tags=["operator"], dependencies=[Depends(operator)],
                   responses=ERROR_RESPONSES)
RolloutId = Annotated[str, PathParam(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class Node(BaseModel):
    model_config = ConfigDict(extra="forbid")

    site: str = Field(pattern=NAME_PATTERN)
    device: str = Field(pattern=NAME_PATTERN)


class NodeGrant(Node):
    """An operator's signed rollback grant for one target device (``apiary image rollback``'s, per device)."""

    expires: int = Field(ge=0)
    nonce: str = Field(pattern=r"^[0-9a-f]{16,64}$")
    signature: str = Field(pattern=r"^[0-9a-f]{128}$")


class RolloutRequest(BaseModel):
    """An image the server holds, one target (``site``, ``devices`` or ``all``), the waves and the abort rule."""

    model_config = ConfigDict(extra="forbid")

    filename: str = Field(pattern=FILENAME_PATTERN, description="a signed image in the server's images directory "
                                                                "(its version and signature are read from it)")
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$",
                               description="refuse unless the archive has this sha256")
    site: str | None = Field(default=None, pattern=NAME_PATTERN, description="every known edge device of a site")
    devices: list[Node] | None = Field(default=None, min_length=1, max_length=10000,
                                       description="these devices, in this order (the first are the canaries)")
    all: bool = Field(default=False, description="every known edge device")
    canary: float = Field(default=0.1, gt=0, le=1, description="fraction of the targets in the first wave "
                                                               "(rounded up, at least one device)")
    wave_size: int | None = Field(default=None, ge=1, description="devices per later wave (default: all the rest "
                                                                  "in one)")
    max_failed_pct: float = Field(default=0, ge=0, le=100, description="abort when more than this % of a wave "
                                                                       "rolled back, was refused, failed or timed out")
    wave_timeout_s: float = Field(default=1800, gt=0, le=30 * 86400, description="a device of a wave that has not "
                                                                                 "committed by then counts as failed")
    rollback: list[NodeGrant] | None = Field(default=None, min_length=1, max_length=10000, description=(
        "a rollback to an older image: one operator-signed grant per target device (`apiary image rollout "
        "--operator-key` signs them), which each device checks against its [edge.ota] operator_keys"))

    @model_validator(mode="after")
    def _one_target(self) -> "RolloutRequest":
        if sum((self.site is not None, self.devices is not None, self.all)) != 1:
            raise ValueError("give exactly one target: site, devices, or all: true")
        return self


class RolloutDevice(BaseModel):
    site: str
    device: str
    wave: int  # 0 = the canary wave
    phase: str  # pending | sent | skipped | an OTA phase (received … committed, rolled_back, refused, failed, deferred)
    detail: str = ""
    progress: float | None = None
    outcome: str | None = None  # committed | failed | timed_out | skipped; null while undecided
    sent_at: float | None = None
    updated_at: float | None = None  # the newest OTA status's


class RolloutSummary(BaseModel):
    id: str
    state: Literal["running", "completed", "aborted"]
    reason: str
    filename: str
    image_version: str
    sha256: str
    size: int
    url: str
    target: dict
    canary: float
    wave_size: int | None
    max_failed_pct: float
    wave_timeout_s: float
    wave: int  # the wave in progress (or the last one), 0 = canary
    waves: int
    wave_started_at: float | None
    created_at: float
    finished_at: float | None
    created_by: str
    counts: dict[str, int]  # devices by phase


class Rollout(RolloutSummary):
    devices: list[RolloutDevice]


def _ctx(request: Request):
    return request.app.state.ctx


@router.post("", status_code=201, summary="Roll an image out to a site, a device list or the whole fleet in waves",
             responses={404: {"model": ErrorResponse, "description": "no such image or no known device"},
                        409: {"model": ErrorResponse, "description": "a target is in a running rollout"},
                        503: {"model": ErrorResponse, "description": "no broker connection"}})
def create_rollout(request: Request, body: RolloutRequest, key: Annotated[ApiKey, Depends(operator)]) -> Rollout:
    ctx = _ctx(request)
    path = safe_image_path(ctx.settings.images, body.filename)
    if path is None:
        raise HTTPException(404, f"image {body.filename!r} is not in the images directory")
    if ctx.rollouts is None or ctx.transport is None or not ctx.transport.connected:
        raise HTTPException(503, "not connected to the MQTT broker; cannot run a rollout")
    try:
        facts = rollouts.image_facts(Path(path))
    except CloudError as e:
        raise HTTPException(422, str(e)) from None
    if body.sha256 is not None and body.sha256 != facts.sha256:
        raise HTTPException(422, f"{body.filename} has sha256 {facts.sha256}, not {body.sha256}")
    target = ({"site": body.site} if body.site is not None else {"all": True} if body.all
              else {"devices": [f"{n.site}/{n.device}" for n in body.devices or []]})
    try:
        targets = rollouts.resolve_targets(
            ctx.store, site=body.site, everything=body.all,
            devices=[(n.site, n.device) for n in body.devices] if body.devices is not None else None)
    except CloudError as e:
        raise HTTPException(404 if isinstance(e, rollouts.NoTargets) else 422, str(e)) from None
    grants = None
    if body.rollback is not None:
        grants = {(g.site, g.device): g.model_dump(include={"expires", "nonce", "signature"}) for g in body.rollback}
        if missing := [f"{s}/{d}" for s, d in targets if (s, d) not in grants]:
            raise HTTPException(422, f"a rollback needs a grant for every target device; none for {', '.join(missing)}")
        target["rollback"] = {f"{s}/{d}": grants[(s, d)] for s, d in targets}
    try:
        rollout_id = rollouts.create(ctx.store, facts, image_url(request, body.filename), targets,
                                     canary=body.canary, wave_size=body.wave_size, max_failed_pct=body.max_failed_pct,
                                     wave_timeout_s=body.wave_timeout_s, target=target, created_by=key.key_id)
    except rollouts.RolloutConflict as e:
        raise HTTPException(409, str(e)) from None
    ctx.rollouts.advance(rollout_id)  # the canary wave's commands go out before the answer
    return rollouts.view(ctx.store, rollout_id)


@router.get("", summary="Rollouts, newest first (without their devices)")
def list_rollouts(request: Request, limit: Annotated[int, Query(ge=1, le=1000)] = 50,
                  state: Annotated[str | None, Query(pattern=r"^(running|completed|aborted)$")] = None,
                  ) -> list[RolloutSummary]:
    store = _ctx(request).store
    return [rollouts.view(store, r["id"], with_devices=False) for r in store.rollouts(limit, state=state)]


@router.get("/{rollout_id}", summary="A rollout's state and each device's phase",
            responses={404: {"model": ErrorResponse, "description": "no such rollout"}})
def get_rollout(request: Request, rollout_id: RolloutId) -> Rollout:
    found = rollouts.view(_ctx(request).store, rollout_id)
    if found is None:
        raise HTTPException(404, f"no rollout {rollout_id!r}")
    return found
