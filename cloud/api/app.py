"""The FastAPI application: inference, operator, images, health and metrics on one app.

The app holds no state of its own: everything lives in :class:`AppContext` (engine,
store, keys, metrics, broker link), built by :class:`apiary.cloud.service.CloudService`, so a
test can build an app around any context and replicas differ only in their engine.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import FastAPI, Path as PathParam
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from apiary.cloud.api import errors
from apiary.cloud.api.fleet import FILENAME_PATTERN, router as fleet_router, safe_image_path
from apiary.cloud.api.health import Lifecycle, liveness
from apiary.cloud.api.inference import router as inference_router
from apiary.cloud.api.rollouts import router as rollouts_router
from apiary.cloud.api.schemas import ErrorResponse
from apiary.cloud.api.security import BodyLimit, HttpMetrics
from apiary.cloud.auth import KeyRing
from apiary.cloud.metrics import CONTENT_TYPE, Metrics
from apiary.cloud.settings import CloudSettings
from apiary.cloud.store import Store

DESCRIPTION = """Apiary Mesh cloud tier.

* **inference** scope: OpenAI-compatible `/v1/chat/completions`, `/v1/completions`, `/v1/models`
  (`n`, `seed`, `stop`, `logprobs`, penalties, `logit_bias`, `response_format`; vLLM's extensions
  `top_k`, `min_p`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `repetition_penalty`, `guided_*`;
  ours: `priority`, 0 = most urgent .. 9). Invalid values are 400s in OpenAI's error shape; unknown
  fields are ignored and named in the `X-Apiary-Ignored-Fields` response header.
* **operator** scope: `/v1/fleet/...` (devices, events and their labels, answers, escalations, OTA,
  rollouts).
* open: `/health` (liveness), `/ready` (readiness: 503 while the model loads, without the broker, or
  draining), `/healthz` (liveness with a status summary), `/metrics` (Prometheus),
  `/v1/images/{filename}` (signed images, HTTP Range).

Authenticate with `Authorization: Bearer <key>` or `X-API-Key: <key>`.
"""


@dataclass(slots=True)
class AppContext:
    settings: CloudSettings
    engine: Any  # cloud.engine.AsyncEngine
    store: Store
    keys: KeyRing
    metrics: Metrics
    model_name: str
    transport: Any | None = None  # shared.transport.MqttTransport when a broker is configured
    rollouts: Any | None = None  # cloud.rollouts.RolloutDriver when a broker is configured
    started: float = field(default_factory=time.time)
    lifecycle: Lifecycle | None = None  # readiness and draining (CloudService's); None: loaded, never draining


class Health(BaseModel):
    status: str
    model: str
    broker: str | None
    uptime_s: float
    engine: dict[str, Any]


def create_app(ctx: AppContext) -> FastAPI:
    from importlib.metadata import PackageNotFoundError, version

    try:
        app_version = version("apiary-mesh")
    except PackageNotFoundError:
        app_version = "0"
    app = FastAPI(title="Apiary Mesh cloud", version=app_version, description=DESCRIPTION)
    app.state.ctx = ctx
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=ctx.settings.max_body_bytes)
    app.add_middleware(HttpMetrics, metrics=ctx.metrics)
    app.include_router(inference_router)
    app.include_router(rollouts_router)  # before the fleet router: /v1/fleet/rollouts is not a fleet sub-path
    app.include_router(fleet_router)

    lifecycle = ctx.lifecycle or Lifecycle(model_loaded=True, broker_required=ctx.transport is not None,
                                           transport=ctx.transport, started=ctx.started)

    @app.get("/health", tags=["service"], summary="Liveness: 200 while the process answers, in every phase")
    def health() -> dict[str, Any]:
        return liveness(lifecycle)

    @app.get("/ready", tags=["service"], summary="Readiness: 200 when the model is loaded, the broker (if any) "
             "connected and the process not draining; else 503 with the reasons",
             responses={503: {"description": "not ready: the body names why"}})
    def ready() -> Response:
        ok, body = lifecycle.readiness()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/healthz", response_model=Health, tags=["service"], summary="Liveness and a short status")
    def healthz() -> Health:
        try:
            engine = _engine_metrics(ctx)
        except Exception as e:
            engine = {"error": str(e)}
        broker = None
        if ctx.transport is not None:
            broker = "connected" if ctx.transport.connected else "disconnected"
        return Health(status="ok", model=ctx.model_name, broker=broker, uptime_s=time.time() - ctx.started,
                      engine={k: v for k, v in engine.items() if isinstance(v, (int, float, str, bool))})

    @app.get("/metrics", tags=["service"], summary="Prometheus metrics",
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
    def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/images/{filename}", tags=["ota"], summary="Download an OTA image (supports HTTP Range)",
             response_class=FileResponse,
             responses={200: {"content": {"application/octet-stream": {}}, "description": "the image"},
                        206: {"description": "the requested byte range"},
                        404: {"model": ErrorResponse, "description": "no such image"},
                        416: {"description": "range not satisfiable"}})
    def image(filename: Annotated[str, PathParam(pattern=FILENAME_PATTERN)]) -> FileResponse:
        path = safe_image_path(ctx.settings.images, filename)
        if path is None:
            raise HTTPException(404, f"no image named {filename!r}")
        return FileResponse(path, media_type="application/octet-stream", filename=filename)

    return app


def _engine_metrics(ctx: AppContext) -> dict[str, Any]:
    return ctx.engine.metrics()
