"""The API's guards: scoped API keys, a request-size limit, and per-route HTTP metrics.

Keys come as ``Authorization: Bearer <key>`` (what OpenAI clients send) or ``X-API-Key``.
The size limit is enforced on the bytes actually received, not only on Content-Length,
so a chunked upload cannot get around it.
"""
from __future__ import annotations

import time
from typing import Callable

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from apiary.cloud.api.errors import BodyTooLarge, error_body
from apiary.cloud.auth import ApiKey

_bearer = HTTPBearer(auto_error=False, description="API key as a bearer token")
_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="API key header")


def require(scope: str) -> Callable[..., ApiKey]:
    """A dependency admitting only keys that carry ``scope`` (401 without a valid key, 403 out of scope)."""

    def check(request: Request, bearer: HTTPAuthorizationCredentials | None = Depends(_bearer),
              header: str | None = Depends(_header)) -> ApiKey:
        ctx = request.app.state.ctx
        presented = bearer.credentials if bearer is not None else header
        if not presented:
            ctx.metrics.refused.labels(reason="unauthenticated").inc()
            raise HTTPException(401, "missing API key: send 'Authorization: Bearer <key>'",
                                headers={"WWW-Authenticate": "Bearer"})
        key = ctx.keys.verify(presented)
        if key is None:
            ctx.metrics.refused.labels(reason="unauthenticated").inc()
            raise HTTPException(401, "invalid API key", headers={"WWW-Authenticate": "Bearer"})
        if scope not in key.scopes:
            ctx.metrics.refused.labels(reason="forbidden").inc()
            raise HTTPException(403, f"this API key lacks the '{scope}' scope (it has: {', '.join(sorted(key.scopes))})")
        return key

    check.__name__ = f"require_{scope}"
    return check


class BodyLimit:
    """ASGI middleware: 413 for bodies over ``max_bytes`` (declared or actually sent)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self._refuse(scope, send)
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if started:
                raise
            await self._refuse(scope, send)

    async def _refuse(self, scope: Scope, send: Send) -> None:
        import json

        ctx = getattr(scope.get("app"), "state", None)
        if ctx is not None and hasattr(ctx, "ctx"):
            ctx.ctx.metrics.refused.labels(reason="too_large").inc()
        body = json.dumps(error_body(413, f"request body over the {self.max_bytes}-byte limit")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class HttpMetrics:
    """ASGI middleware: request count by route template and status, latency to the last byte."""

    def __init__(self, app: ASGIApp, metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.http_requests.labels(route=route, method=scope["method"], status=str(status)).inc()
            self.metrics.http_latency.labels(route=route).observe(time.perf_counter() - start)
