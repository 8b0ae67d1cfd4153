"""One error shape for every failure (OpenAI's ``{"error": {...}}``) and the status each cause maps to.

400 a request the engine can never serve (e.g. longer than the context) and, on the OpenAI
routes (:class:`OpenAIRoute`), a body that fails validation, as OpenAI answers; 401 no or
unknown key, 403 key without the scope, 404 unknown thing, 413 body too large, 422
validation on the other routes (the message names every bad field), 429 engine queue full
(with ``Retry-After``), 503 a dependency (broker) is not available. Nothing else escapes as
a bare 500.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Coroutine

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from apiary.shared.logs import get_logger

from apiary.cloud.api.schemas import ErrorResponse

_log = get_logger("apiary.cloud.api")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error", 413: "request_too_large",
               416: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable"}
# ``code`` is always a string, as OpenAI's is (clients switch on it): the cause where one is known
# (``validation_error``, ``model_not_found``, ``overloaded`` …), else this one per status.
ERROR_CODES = {400: "invalid_request", 401: "invalid_api_key", 403: "insufficient_scope", 404: "not_found",
               405: "method_not_allowed", 409: "conflict", 413: "request_too_large", 416: "range_not_satisfiable",
               422: "invalid_request", 429: "overloaded", 499: "client_disconnected", 500: "internal_error",
               503: "service_unavailable"}

# For the OpenAPI document: routes list the errors they can return with this body.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text} for code, text in {
        401: "missing or unknown API key", 403: "API key lacks the scope", 413: "request body too large",
        422: "invalid request (the message names the fields)"}.items()
}


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "api_error"), "param": param,
                      "code": code or ERROR_CODES.get(status, f"http_{status}")}}


def error_response(status: int, message: str, *, headers: dict[str, str] | None = None, **kw: Any) -> JSONResponse:
    return JSONResponse(error_body(status, message, **kw), status_code=status, headers=headers)


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body over the {limit}-byte limit")


class ModelNotFound(HTTPException):
    """A 404 for a ``model`` this server does not serve (OpenAI's ``model_not_found``)."""

    code = "model_not_found"

    def __init__(self, name: str, served: str) -> None:
        super().__init__(404, f"model {name!r} not found; this server serves {served!r}")


class InvalidParam(HTTPException):
    """A 400 about one request field (``param`` in the error object), for rules between fields."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(400, message if message.startswith(param) else f"{param}: {message}")
        self.param = param


class InvalidRequest(RequestValidationError):
    """A body that failed validation on an OpenAI route: 400 ``invalid_request_error``, as OpenAI answers."""


class OpenAIRoute(APIRoute):
    """A route whose validation errors are OpenAI's 400s instead of FastAPI's 422s."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                raise InvalidRequest(e.errors(), body=e.body) from None

        return route


def _location(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if p not in ("body",)) or "body"


def _problem(error: dict) -> tuple[str, str]:
    if error.get("type") == "json_invalid":  # loc is ("body", character position)
        return "body", f"invalid JSON at character {error['loc'][-1]}: {error.get('ctx', {}).get('error', error['msg'])}"
    return _location(error["loc"]), error["msg"].removeprefix("Value error, ")


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    problems = [_problem(e) for e in errors]
    parts = [f"{where}: {what}" for where, what in problems[:8]]
    more = f" (+{len(errors) - 8} more)" if len(errors) > 8 else ""
    first = problems[0][0] if problems else None
    return "invalid request: " + "; ".join(parts) + more, first


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        status = 400 if isinstance(exc, InvalidRequest) else 422
        return error_response(status, message, param=param, code="validation_error")

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None),
                              param=getattr(exc, "param", None), code=getattr(exc, "code", None))

    if "apiary.cloud.engine" in sys.modules:  # else no engine runs here (backend "openai": torch is never loaded)
        _install_engine(app)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        _log.exception("unhandled error on %s", request.url.path)
        return error_response(500, "internal error", code="internal_error")


def _install_engine(app: FastAPI) -> None:
    from apiary.cloud.engine import EngineError, EngineOverloaded, RequestRejected

    @app.exception_handler(EngineOverloaded)
    async def _overloaded(request: Request, exc: EngineOverloaded) -> JSONResponse:
        retry = str(request.app.state.ctx.settings.retry_after_s)
        request.app.state.ctx.metrics.refused.labels(reason="overloaded").inc()
        return error_response(429, f"the engine's queue is full, retry later: {exc}", headers={"Retry-After": retry},
                              code="overloaded")

    @app.exception_handler(RequestRejected)
    async def _rejected(request: Request, exc: RequestRejected) -> JSONResponse:
        return error_response(400, str(exc), code="rejected")

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError) -> JSONResponse:
        _log.error("engine error on %s: %s", request.url.path, exc)
        return error_response(500, f"engine error: {exc}", code="engine_error")
