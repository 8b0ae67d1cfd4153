"""Prometheus metrics for one cloud process: HTTP, inference latencies, escalations, engine gauges.

Each service owns its own registry (several services can live in one test process), and
the engine's own ``metrics()`` dict is exported on scrape as ``apiary_engine_*`` gauges,
so the numbers are never copied and never stale.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _flatten(prefix: str, value: Any) -> Iterator[tuple[str, float]]:
    if isinstance(value, bool):
        yield prefix, float(value)
    elif isinstance(value, (int, float)):
        yield prefix, float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _flatten(f"{prefix}_{k}", v)


class EngineCollector(Collector):
    """Reads the engine's metrics dict at scrape time; every numeric leaf becomes a gauge."""

    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self._read = read

    def collect(self):
        try:
            values = self._read()
        except Exception:  # a scrape must never take the service down
            return
        for name, value in _flatten("apiary_engine", values):
            name = re.sub(r"[^a-zA-Z0-9_]", "_", name)
            yield GaugeMetricFamily(name, "engine metric (LLMEngine.metrics())", value=value)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter("apiary_http_requests", "HTTP requests by route and status",
                                     ["route", "method", "status"], registry=r)
        self.http_latency = Histogram("apiary_http_request_duration_seconds", "HTTP request latency (to last byte)",
                                      ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("apiary_inference_ttft_seconds", "time to first token", ["path"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("apiary_inference_e2e_seconds", "request end-to-end latency", ["path"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("apiary_tokens", "prompt and completion tokens", ["path", "kind"], registry=r)
        self.refused = Counter("apiary_refused_requests", "requests refused before inference", ["reason"],
                               registry=r)
        self.escalations = Counter("apiary_escalations", "MQTT escalations by outcome", ["outcome"], registry=r)
        self.escalation_latency = Histogram("apiary_escalation_latency_seconds", "escalation receive-to-reply",
                                            ["outcome"], buckets=LATENCY_BUCKETS, registry=r)
        self.recorded = Counter("apiary_recorded_messages", "fleet messages seen by the recorder: kind is the "
                                "message type when stored, <type>_ignored when stale or repeated, "
                                "<type>_refused when its body names another node than its topic",
                                ["kind"], registry=r)

    def watch_engine(self, read: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(EngineCollector(read))

    def render(self) -> bytes:
        return generate_latest(self.registry)
