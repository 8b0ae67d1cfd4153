"""Liveness, readiness and draining: ``/health``, ``/ready``, and the gate in front of the app.

A process's life: **loading** (the HTTP port answers at once, the model still loads), **serving**,
**draining** (SIGTERM: in-flight requests finish, new ones go elsewhere), then it exits.

* ``GET /health`` is liveness: 200 whenever the process answers HTTP, in every phase.
* ``GET /ready`` is readiness: 200 only while serving with the model loaded and, when a broker is
  configured, connected to it; else 503 with the reasons. A load balancer or Kubernetes sends traffic
  by it, an autoscaler waits for it.
* :class:`Gate` is the ASGI app uvicorn runs: before the app exists (the model loads) and while
  draining it answers every request but the probes (``/health``, ``/healthz``, ``/ready``,
  ``/metrics``) with 503 and ``Retry-After``, so a client retries on another replica; otherwise it
  passes the request to the app and counts it in flight until its last byte (streams included), which
  is what a drain waits for.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

PROBES = frozenset({"/health", "/healthz", "/ready", "/metrics"})
RETRY_AFTER_S = 5
STARTING = "the service is starting (the model loads, then the broker connects): retry shortly"


@dataclass
class Lifecycle:
    """What readiness depends on; the service moves it along, ``/ready`` reads it (any thread)."""

    model_loaded: bool = False
    broker_required: bool = False
    transport: Any | None = None  # shared.transport.MqttTransport once started
    draining: bool = False
    in_flight: int = 0  # HTTP requests in the app, probes excluded (the gate counts them)
    started: float = field(default_factory=time.time)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def phase(self) -> str:
        return "draining" if self.draining else "serving" if self.model_loaded else "loading"

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """(ready, the body ``/ready`` answers)."""
        reasons = []
        if not self.model_loaded:
            reasons.append("the model is loading")
        broker = None
        if self.broker_required:
            broker = "connected" if self.transport is not None and self.transport.connected else "disconnected"
            if broker != "connected":
                reasons.append("not connected to the broker")
        if self.draining:
            reasons.append("draining: finishing in-flight requests before exit")
        ready = not reasons
        body = {"status": "ready" if ready else "not ready", "phase": self.phase, "broker": broker,
                "in_flight": self.in_flight, "reasons": reasons}
        return ready, body

    def enter(self) -> None:
        with self._lock:
            self.in_flight += 1

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1


def liveness(lifecycle: Lifecycle) -> dict[str, Any]:
    return {"status": "ok", "phase": lifecycle.phase, "uptime_s": round(time.time() - lifecycle.started, 3)}


class Gate:
    """ASGI front of the app (see the module docstring); ``app`` is set once the model is loaded."""

    def __init__(self, lifecycle: Lifecycle, metrics: Any | None = None) -> None:
        self.lifecycle = lifecycle
        self.metrics = metrics  # cloud.metrics.Metrics: refusals are counted as apiary_refused_requests
        self.app: Any | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            if self.app is not None:
                await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        life = self.lifecycle
        if path in PROBES:
            if self.app is not None:
                await self.app(scope, receive, send)
            elif path == "/health":
                await _json(send, 200, liveness(life))
            elif path == "/ready":
                await _json(send, 503, life.readiness()[1])
            else:
                await _refuse(send, STARTING, "loading")
            return
        if self.app is None or life.draining:
            why = "draining" if life.draining else "loading"
            if self.metrics is not None:
                self.metrics.refused.labels(reason=why).inc()
            await _discard_body(receive)  # closing with unread bytes would reset the connection (RST, not FIN)
            await _refuse(send, "this replica is shutting down: retry on another" if life.draining else STARTING, why)
            return
        life.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            life.leave()


async def _discard_body(receive: Any) -> None:
    """Read the request body to its end: the refusal closes the connection, and a socket closed with
    unread bytes makes the kernel send a reset, which a client may see before the 503 itself."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


async def _json(send: Any, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": data})


async def _refuse(send: Any, message: str, code: str) -> None:
    """503 in OpenAI's error shape, so OpenAI clients retry it (they retry 503s with Retry-After)."""
    await _json(send, 503, {"error": {"message": message, "type": "service_unavailable", "param": None,
                                      "code": code}},
                [(b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")])
