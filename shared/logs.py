"""Structured logs that carry device and request ids, so one event can be followed across tiers.

``bind(site=…, device=…, request_id=…)`` puts ids into a context variable; every log
record emitted inside it carries them, in JSON lines (``APIARY_LOG_FORMAT=json``,
the default for services) or a compact human format.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import sys
import time
from typing import Any, Iterator

_context: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("apiary_log_context", default={})


@contextlib.contextmanager
def bind(**ids: Any) -> Iterator[None]:
    """Attach ids (device, site, request_id, event_seq, …) to every record logged inside the block."""
    token = _context.set({**_context.get(), **{k: v for k, v in ids.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.ctx = {**_context.get(), **getattr(record, "ctx", {})}
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage(), **getattr(record, "ctx", {})}
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ctx = " ".join(f"{k}={v}" for k, v in getattr(record, "ctx", {}).items())
        t = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = f"{t} {record.levelname[0]} {record.name}: {record.getMessage()}" + (f" [{ctx}]" if ctx else "")
        return line + ("\n" + self.formatException(record.exc_info) if record.exc_info else "")


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is *now*: test runners and daemons swap it, and a handler
    holding the old (closed) stream would print "Logging error" tracebacks instead of the record."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def configure(level: str | None = None, fmt: str | None = None, stream: Any = None) -> None:
    """Install the apiary handler on the root logger (idempotent)."""
    level = (level or os.environ.get("APIARY_LOG_LEVEL", "INFO")).upper()
    fmt = fmt or os.environ.get("APIARY_LOG_FORMAT", "json")
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_apiary", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(stream) if stream is not None else _CurrentStderr()
    handler._apiary = True  # type: ignore[attr-defined]
    handler.addFilter(_ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root.addHandler(handler)
    root.setLevel(level)


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)
