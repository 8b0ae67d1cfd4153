"""Prometheus metrics for one cloud process: vLLM's names where the meaning is the same, ours under ``apiary_``.

Each service owns its own registry (several services can live in one test process). Three sources:

* **the engine's counters and gauges** (``LLMEngine.metrics()``), read at scrape time, so they are never
  copied and never stale: ``vllm:num_requests_running|waiting``, ``vllm:kv_cache_usage_perc``,
  ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, ``vllm:num_preemptions_total``,
  ``vllm:prefix_cache_queries_total|hits_total``, ``vllm:spec_decode_num_drafts|draft_tokens|accepted_tokens_total``
  (labels ``model_name`` and ``engine``, as vLLM's), plus every numeric value as an ``apiary_engine_*`` gauge
  except the engine's windowed percentiles and means (no percentile gauges: use the histograms);
* **each finished engine request** (:class:`ObservedEngine`, the engine as the REST API and the MQTT worker see
  it): the histograms ``vllm:time_to_first_token_seconds``, ``vllm:time_per_output_token_seconds``,
  ``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds``,
  ``vllm:request_prefill|decode|inference_time_seconds``, ``vllm:request_prompt|generation_tokens`` (vLLM's
  buckets) and ``vllm:request_success_total{finished_reason}``, from the engine's own timestamps;
* **the fleet, as the recorder sees it** (:meth:`Metrics.watch_fleet`): answers by tier and status, escalation
  reasons by rule and by the tier that answered, OTA reports by phase (counted off the same subscriptions,
  de-duplicated by the transport and identity-checked like the recorder), and at scrape time from the store
  the devices' battery, online state and last OTA phase.

The service's own ``apiary_*`` HTTP, inference-path and escalation-worker series stay as they were.
"""
from __future__ import annotations

import contextlib
import re
import threading
from typing import Any, AsyncIterator, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# vLLM's bucket choices (vllm/v1/metrics/loggers.py), so its dashboards' thresholds read the same here.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)

VLLM_LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"  # one engine per process; vLLM labels each of its engine cores

# Windowed summaries in LLMEngine.metrics() (ttft_p50, e2e_mean, ...): not exported, the histograms replace them.
_WINDOWED = re.compile(r"_(p\d+|mean)$")
_SPEC = re.compile(r"^spec_(?P<method>[a-z0-9]+)_(?P<what>proposed|accepted|verifications)$")

MAX_REASONS = 32  # distinct escalation-reason label values kept per process; the rest count as "other"


def length_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return out
            out.append(mantissa * scale)
        scale *= 10


def _flatten(prefix: str, value: Any) -> Iterator[tuple[str, float]]:
    if isinstance(value, bool):
        yield prefix, float(value)
    elif isinstance(value, (int, float)):
        yield prefix, float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _flatten(f"{prefix}_{k}", v)


def _number(values: dict[str, Any], key: str) -> float | None:
    v = values.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class EngineCollector(Collector):
    """Reads the engine's metrics dict at scrape time: vLLM's engine series, and ``apiary_engine_*`` gauges."""

    def __init__(self, read: Callable[[], dict[str, Any]], model_name: str = "") -> None:
        self._read = read
        self._labels = [model_name, ENGINE_INDEX]

    def collect(self):
        try:
            values = self._read()
        except Exception:  # a scrape must never take the service down
            return
        yield from self._vllm(values)
        for name, value in _flatten("apiary_engine", values):
            if _WINDOWED.search(name):
                continue
            name = re.sub(r"[^a-zA-Z0-9_]", "_", name)
            yield GaugeMetricFamily(name, "engine metric (LLMEngine.metrics())", value=value)

    def _gauge(self, name: str, doc: str, value: float | None):
        if value is not None:
            g = GaugeMetricFamily(name, doc, labels=VLLM_LABELS)
            g.add_metric(self._labels, value)
            yield g

    def _counter(self, name: str, doc: str, value: float | None):
        if value is not None:
            c = CounterMetricFamily(name, doc, labels=VLLM_LABELS)
            c.add_metric(self._labels, value)
            yield c

    def _vllm(self, v: dict[str, Any]):
        yield from self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                               _number(v, "requests_running"))
        yield from self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                               _number(v, "requests_waiting"))
        total, used = _number(v, "kv_blocks_total"), _number(v, "kv_blocks_used")
        yield from self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage "
                               "(blocks held by requests; cached free blocks count as free).",
                               used / total if total and used is not None else None)
        yield from self._counter("vllm:prompt_tokens", "Number of prefill tokens processed (prompt tokens of "
                                 "admitted requests, prefix-cache hits included).", _number(v, "prompt_tokens"))
        yield from self._counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                 _number(v, "generated_tokens"))
        yield from self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                 _number(v, "preemptions"))
        yield from self._counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
                                 "tokens.", _number(v, "prompt_tokens"))
        yield from self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                                 _number(v, "prefix_cached_tokens"))
        spec: dict[str, float] = {}
        for key, value in v.items():
            m = _SPEC.match(key)
            if m and isinstance(value, (int, float)):
                spec[m["what"]] = spec.get(m["what"], 0.0) + float(value)
        if spec:  # summed over the speculation methods the engine ran (ngram, draft)
            yield from self._counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                                     spec.get("verifications"))
            yield from self._counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                                     spec.get("proposed"))
            yield from self._counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                     spec.get("accepted"))


class ObservedEngine:
    """The engine as the REST API and the MQTT worker use it, observing every request that finishes.

    ``stream`` and ``generate`` pass through unchanged (errors included); every other attribute is the engine's.
    A stream left early closes the engine's stream at once, so its request is aborted as before.
    """

    def __init__(self, engine: Any, metrics: "Metrics", model_name: str) -> None:
        self._engine = engine
        self._metrics = metrics
        self._model_name = model_name

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async with contextlib.aclosing(self._engine.stream(*args, **kwargs)) as outputs:
            async for out in outputs:
                if out.finished:
                    self._metrics.observe_request(out, self._model_name)
                yield out

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        last = None
        async with contextlib.aclosing(self.stream(*args, **kwargs)) as outputs:
            async for last in outputs:
                pass
        assert last is not None and last.finished
        return last


def reason_rules(reason: str | None) -> list[str]:
    """The rules named in an answer's ``escalation_reason``, without their values, as a bounded label:
    "low confidence: p10 logprob -2.31 < -1.50; flag swarm_risk is critical" -> ["low confidence",
    "critical flag"]. What follows a rule in parentheses (why it was not escalated) is left out."""
    rules = []
    for part in (reason or "").split(";"):
        head = part.split("(", 1)[0].split(":", 1)[0].strip().lower()
        critical = re.fullmatch(r"(severity|kind|flag) .+ is critical", head)
        if critical:
            head = f"critical {critical.group(1)}"
        else:  # "no cloud answer within 300 s": the words that carry a value are left out
            head = " ".join(w for w in head.split() if not re.search(r"\d", w))
        if head and head not in rules:
            rules.append(head[:64])
    return rules


class FleetCollector(Collector):
    """Per-device gauges read from the store at scrape time: what the recorder stored, whichever replica did."""

    def __init__(self, devices: Callable[[], list[dict[str, Any]]]) -> None:
        self._devices = devices

    def collect(self):
        try:
            devices = self._devices()
        except Exception:  # the database went away for a moment: no fleet series in this scrape
            return
        battery = GaugeMetricFamily("apiary_device_battery_soc", "a device's last reported battery state of charge "
                                    "(0..1)", labels=["site", "device"])
        online = GaugeMetricFamily("apiary_device_online", "1 while a node's session is alive (birth seen, no "
                                   "death)", labels=["site", "device", "role"])
        phases: dict[str, int] = {}
        for d in devices:
            site, device = str(d.get("site")), str(d.get("device"))
            online.add_metric([site, device, str(d.get("role") or "edge")], 1.0 if d.get("online") else 0.0)
            if isinstance(d.get("battery_soc"), (int, float)):
                battery.add_metric([site, device], float(d["battery_soc"]))
            last = d.get("last_ota")
            if last and last.get("phase"):
                phases[last["phase"]] = phases.get(last["phase"], 0) + 1
        ota = GaugeMetricFamily("apiary_devices_ota_phase", "devices by the phase of their last OTA report",
                                labels=["phase"])
        for phase, n in sorted(phases.items()):
            ota.add_metric([phase], n)
        yield battery
        yield online
        yield ota


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
        # vLLM's per-request series (observed by ObservedEngine from the engine's own timestamps)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in "
                                   "seconds.", VLLM_LABELS, buckets=TTFT_BUCKETS, registry=r)
        self.vllm_tpot = Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in "
                                   "seconds (one observation per request: its mean after the first token).",
                                   VLLM_LABELS, buckets=TPOT_BUCKETS, registry=r)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                                  VLLM_LABELS, buckets=REQUEST_BUCKETS, registry=r)
        self.vllm_queue = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase "
                                    "for request.", VLLM_LABELS, buckets=REQUEST_BUCKETS, registry=r)
        self.vllm_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                    VLLM_LABELS + ("finished_reason",), registry=r)
        self.vllm_phases = {phase: Histogram(f"vllm:request_{phase}_time_seconds", doc, VLLM_LABELS,
                                             buckets=REQUEST_BUCKETS, registry=r)
                            for phase, doc in (("prefill", "Histogram of time spent in PREFILL phase for request."),
                                               ("decode", "Histogram of time spent in DECODE phase for request."),
                                               ("inference", "Histogram of time spent in RUNNING phase for "
                                                             "request."))}
        self.vllm_lengths: dict[str, Histogram] = {}  # prompt / generation tokens per request: see observed()
        # the fleet, from the messages the recorder sees
        self.answers = Counter("apiary_answers", "final answers published by the fleet, by the tier that answered "
                               "and their status (tier=edge: the edge answers)", ["tier", "status"], registry=r)
        self.escalation_reasons = Counter("apiary_escalation_reasons", "answers whose escalation named this rule, "
                                          "by the tier that gave the final answer (one answer counts once per rule)",
                                          ["reason", "tier"], registry=r)
        self.ota_reports = Counter("apiary_ota_reports", "OTA progress reports by phase", ["phase"], registry=r)
        self._reasons: set[str] = set()
        self._lock = threading.Lock()

    def watch_engine(self, read: Callable[[], dict[str, Any]], model_name: str = "") -> None:
        self.registry.register(EngineCollector(read, model_name))

    def observe_request(self, out: Any, model_name: str) -> None:
        """One finished engine request (a ``RequestOutput`` with ``finished=True``)."""
        labels = (model_name, ENGINE_INDEX)
        m = out.metrics
        self.vllm_success.labels(*labels, out.finish_reason or "stop").inc()
        if out.finish_reason == "abort":
            return
        if m.ttft is not None:
            self.vllm_ttft.labels(*labels).observe(m.ttft)
        if m.queue_time is not None:
            self.vllm_queue.labels(*labels).observe(m.queue_time)
        phases = {"prefill": (m.first_scheduled_time, m.first_token_time),
                  "decode": (m.first_token_time, m.finish_time),
                  "inference": (m.first_scheduled_time, m.finish_time)}
        for phase, (start, end) in phases.items():
            if start is not None and end is not None:
                self.vllm_phases[phase].labels(*labels).observe(end - start)
        if self.vllm_lengths:
            self.vllm_lengths["prompt"].labels(*labels).observe(len(out.prompt_token_ids))
            self.vllm_lengths["generation"].labels(*labels).observe(len(out.output_token_ids))
        if m.finish_time is not None:
            self.vllm_e2e.labels(*labels).observe(m.finish_time - m.arrival_time)
            n = len(out.output_token_ids)
            if m.first_token_time is not None and n > 1:
                self.vllm_tpot.labels(*labels).observe((m.finish_time - m.first_token_time) / (n - 1))

    def observed(self, engine: Any, model_name: str) -> ObservedEngine:
        """``engine`` as the API and the worker should use it: every finished request lands in the histograms."""
        self.request_lengths(int(engine.max_model_len))
        return ObservedEngine(engine, self, model_name)

    def request_lengths(self, max_model_len: int) -> None:
        """Make the request-length histograms (once), their buckets 1, 2, 5, 10, ... up to ``max_model_len`` as
        vLLM's are."""
        if not self.vllm_lengths:
            buckets = length_buckets(max_model_len)
            for kind, what in (("prompt", "prefill"), ("generation", "generation")):
                self.vllm_lengths[kind] = Histogram(f"vllm:request_{kind}_tokens", f"Number of {what} tokens "
                                                    "processed.", VLLM_LABELS, buckets=buckets, registry=self.registry)

    # ---- the fleet ----------------------------------------------------------------------------
    def watch_fleet(self, transport: Any, devices: Callable[[], list[dict[str, Any]]]) -> None:
        """Count answers and OTA reports off ``transport`` (beside the recorder, on the same topics) and export
        the devices ``devices()`` lists (the store's fleet) at scrape time."""
        from apiary.shared import topics

        transport.subscribe(topics.all_of("answer"), self.observe_fleet_message, qos=1)
        transport.subscribe(topics.all_of("ota/status"), self.observe_fleet_message, qos=1)
        self.registry.register(FleetCollector(devices))

    def observe_fleet_message(self, topic: str, env: Any) -> None:
        """One answer or OTA report as the recorder gets it; a body speaking for another node is not counted."""
        from apiary.shared import identity
        from apiary.shared.protocol import InferenceResult, OtaStatus

        try:
            identity.check(topic, env)
        except identity.IdentityError:
            return
        body = env.body
        if isinstance(body, InferenceResult):
            self.answers.labels(body.tier, body.status).inc()
            for rule in reason_rules(body.escalation_reason):
                self.escalation_reasons.labels(self._bounded(rule), body.tier).inc()
        elif isinstance(body, OtaStatus):
            self.ota_reports.labels(body.phase).inc()

    def _bounded(self, rule: str) -> str:
        with self._lock:
            if rule in self._reasons:
                return rule
            if len(self._reasons) < MAX_REASONS:
                self._reasons.add(rule)
                return rule
        return "other"

    def render(self) -> bytes:
        return generate_latest(self.registry)
