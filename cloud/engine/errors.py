"""The one exception family the engine raises, so API tiers can map it to a status code."""
from __future__ import annotations


class EngineError(Exception):
    """Anything the engine refuses or cannot do: bad model files, bad requests, overload."""


class RequestRejected(EngineError, ValueError):
    """The request is invalid or can never fit (too long for the model or the KV pool): don't retry as is."""


class EngineOverloaded(EngineError):
    """The waiting queue is full right now: retry later (HTTP 503 / MQTT busy)."""


class StepInterrupted(Exception):
    """Internal: a forward pass was cut short at a layer boundary because a more urgent request
    arrived. The engine catches it and discards the step (nothing was committed); never escapes."""
