"""One cloud process: the engine, the MQTT escalation worker + fleet recorder, and the REST API.

``CloudService(settings).start()`` brings everything up and returns where it listens
and, when no key is configured, a freshly generated API key (shown once, valid for this
process); ``stop()`` takes it down in reverse order. ``apiary cloud serve`` and the demo
both use it, in-process or as a subprocess.

Scale-out: run several of these against one broker (EMQX cluster in production). The
escalation worker uses a shared subscription, so the broker splits escalations across
processes; fleet state, events, answers, escalation results and API keys live in the
store and the key file, so REST replicas behind any load balancer answer alike. Only
the KV cache is private to a process.
"""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from apiary.shared import topics
from apiary.shared.logs import get_logger
from apiary.shared.protocol import DeviceState, make

from apiary.cloud.auth import SCOPES, KeyRing
from apiary.cloud.errors import CloudError
from apiary.cloud.metrics import Metrics
from apiary.cloud.recorder import Recorder
from apiary.cloud.retention import Retention
from apiary.cloud.rollouts import RolloutDriver, publish_command
from apiary.cloud.settings import CloudSettings
from apiary.cloud.store import Store, open_store
from apiary.cloud.worker import EscalationWorker, WorkerConfig

_log = get_logger("apiary.cloud.service")


@dataclass(slots=True)
class ServiceInfo:
    url: str
    api_key: str | None  # generated for this process when no key was configured; None otherwise
    model: str
    broker: str | None
    worker_id: str


def build_engine(settings: CloudSettings):
    """The engine the settings describe, wrapped for asyncio callers."""
    from apiary.cloud.engine import AsyncEngine, EngineConfig, EngineError, LLMEngine

    path = settings.resolve_model_path()
    try:
        engine = LLMEngine(EngineConfig(
            model_path=path, adapter_path=settings.resolve_adapter_path(path), device=settings.device,
            dtype=settings.dtype, weights=settings.weights, head=settings.head, kv_cache_dtype=settings.kv_cache_dtype,
            kv_cache_bytes=settings.kv_cache_mb << 20, max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens, max_waiting=settings.max_waiting,
            max_model_len=settings.max_model_len, num_threads=settings.num_threads, cuda_graphs=settings.cuda_graphs,
            speculative=settings.speculative_config()))
    except EngineError as e:
        raise CloudError(f"cannot load model {path}: {e}") from None
    return AsyncEngine(engine)


class CloudService:
    def __init__(self, settings: CloudSettings, *, engine: Any | None = None, store: Store | None = None) -> None:
        """``engine``: an existing AsyncEngine to share (not shut down on stop); default: built from settings."""
        self.settings = settings
        self.engine = engine
        self._own_engine = engine is None
        self.store = store
        self._own_store = store is None
        self.keys: KeyRing | None = None
        self.metrics = Metrics()
        from apiary.cloud.api.health import Lifecycle

        if settings.backend == "openai":  # no model: ready while the upstream answers its probe
            from apiary.cloud.upstream import UpstreamLifecycle

            self.lifecycle = UpstreamLifecycle(broker_required=bool(settings.broker))
        else:
            self.lifecycle = Lifecycle(broker_required=bool(settings.broker))  # what /ready answers; drain() moves it
        self.gate = None  # cloud.api.health.Gate: what uvicorn serves (probes while the model loads, then the app)
        self._served = None  # the engine as the API and the worker use it (its requests observed for metrics)
        self.transport = None
        self.worker: EscalationWorker | None = None
        self.recorder: Recorder | None = None
        self.rollouts: RolloutDriver | None = None
        self.retention: Retention | None = None
        self.app = None
        self.info: ServiceInfo | None = None
        self._server = None
        self._thread: threading.Thread | None = None
        self._session = int(time.time() * 1000)

    @property
    def url(self) -> str:
        if self.info is None:
            raise CloudError("the service is not started")
        return self.info.url

    def start(self, timeout: float = 30.0) -> ServiceInfo:
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> ServiceInfo:
        from apiary.cloud.api import AppContext, create_app
        from apiary.cloud.api.health import Gate

        s = self.settings
        # Fail fast: what can be wrong in a moment is checked before the model load (a minute on a busy CPU).
        sock = self._listen()
        try:
            if s.broker:
                self._preflight_broker(timeout)
            self.store = self.store or open_store(s.db)
            self.retention = Retention(self.store, s.retention_days, interval_s=s.retention_interval_s,
                                       first_after_s=min(30.0, s.retention_interval_s)).start()
            self.keys = KeyRing(s.api_key_file)
            api_key = None
            if s.generate_key == "always" or (s.generate_key == "auto" and len(self.keys) == 0):
                api_key = self.keys.create(SCOPES, name="generated", persist=False)
            self.gate = Gate(self.lifecycle, self.metrics)
            url = self._start_http(sock, timeout)  # /health and /ready answer while the model loads
            if s.backend == "openai":  # escalations go to the upstream; torch and the engine are never imported
                from apiary.cloud.upstream import build_upstream

                self._served = self.engine = self.engine or build_upstream(s)
                self.engine.watch(self.lifecycle, s.upstream_probe_s)
            else:
                self.engine = self.engine or build_engine(s)
                self.metrics.watch_engine(self.engine.metrics, s.model_name)
                self._served = self.metrics.observed(self.engine, s.model_name)
            self.lifecycle.model_loaded = True
            if s.broker:
                self._start_mqtt(timeout)
            self.lifecycle.transport = self.transport
            ctx = AppContext(settings=s, engine=self._served, store=self.store, keys=self.keys, metrics=self.metrics,
                             model_name=s.model_name, transport=self.transport, rollouts=self.rollouts)
            ctx.lifecycle = self.lifecycle
            self.app = create_app(ctx)
            if s.backend == "openai":
                from apiary.cloud.upstream import InferenceElsewhere

                self.app = InferenceElsewhere(self.app, s.upstream_url)
            self.gate.app = self.app
        except BaseException:
            if self._server is None or not self._server.started:
                sock.close()  # the server never started on it: free the port (else stop() ends the server and it)
            raise
        self.info = ServiceInfo(url=url, api_key=api_key, model=s.model_name, broker=s.broker, worker_id=s.worker_id)
        _log.info("cloud service up at %s (model %s, broker %s)", url, s.model_name, s.broker or "none")
        return self.info

    def _state(self, status: str) -> DeviceState:
        return DeviceState(site=topics.CLOUD_SITE, device=self.settings.worker_id, status=status,
                           online=status != "death", session=self._session, role="cloud",
                           model_version=self.settings.model_name)

    def _start_mqtt(self, timeout: float) -> None:
        from apiary.shared.transport import MqttTransport, TransportError

        s = self.settings
        state_topic = topics.state(topics.CLOUD_SITE, s.worker_id)
        self.transport = MqttTransport(s.mqtt, s.worker_id, persistent=s.persistent_session,
                                       session_expiry_s=s.session_expiry_s,
                                       will=(state_topic, make(self._state("death"), sender=s.worker_id)))
        transport = self.transport
        self.rollouts = RolloutDriver(self.store, lambda cmd: publish_command(transport, cmd, sender=s.worker_id)[1],
                                      owner=s.worker_id)
        if s.record:
            self.recorder = Recorder(self.store, self.metrics, on_ota_status=self.rollouts.notify)
            self.recorder.attach(self.transport)
            self.metrics.watch_fleet(self.transport, self.store.devices)
        if s.escalations:
            self.worker = EscalationWorker(self._served, self.store, WorkerConfig(
                worker_id=s.worker_id, share_group=s.share_group,
                model_name=f"openai:{s.upstream_model}" if s.backend == "openai" else s.model_name,
                concurrency=s.worker_concurrency, claim_lease_s=s.claim_lease_s,
                overload_retry_s=s.overload_retry_s, backend=s.backend), self.metrics)
            self.worker.start(self.transport)
        try:
            self.transport.start(timeout=timeout)
        except TransportError as e:
            raise CloudError(f"cannot reach the broker {s.broker}: {e}") from None
        self.transport.publish(state_topic, make(self._state("birth"), sender=s.worker_id), retain=True)
        self.rollouts.start()  # resumes the running rollouts this process drove before a restart

    def _listen(self) -> socket.socket:
        """The HTTP socket, bound now: a taken port is reported before anything slow starts."""
        s = self.settings
        try:
            return socket.create_server((s.host, s.port), reuse_port=False)
        except OSError as e:
            raise CloudError(f"cannot listen on {s.host}:{s.port}: {e}") from None

    def _preflight_broker(self, timeout: float) -> None:
        """Say at once when the broker does not answer, and what happens next; the real connection (after the
        model load, once the worker's handlers are in place) still retries, as a broker started alongside needs."""
        mqtt = self.settings.mqtt
        try:
            socket.create_connection((mqtt.host, mqtt.port), timeout=min(timeout, 5.0)).close()
        except OSError as e:
            _log.warning("broker %s does not answer (%s: %s); loading the model, then connecting, retrying every "
                         "%g s for up to %g s", mqtt.url, type(e).__name__, e, mqtt.reconnect_min_s, timeout)

    def _start_http(self, sock: socket.socket, timeout: float) -> str:
        import uvicorn

        s = self.settings
        port = sock.getsockname()[1]
        config = uvicorn.Config(self.gate, log_level="warning", lifespan="off", access_log=False,
                                timeout_graceful_shutdown=5, ssl_certfile=s.tls_cert, ssl_keyfile=s.tls_key)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="cloud-http",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise CloudError(f"the HTTP server did not start on {s.host}:{port}")
            time.sleep(0.02)
        host = s.host if s.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return f"{'https' if s.tls_cert else 'http'}://{host}:{port}"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def drain(self, timeout: float, cancel: threading.Event | None = None) -> bool:
        """Stop taking work and wait up to ``timeout`` s (or until ``cancel`` is set) for what is in flight;
        True when nothing was left. ``/ready`` answers 503 from now on and new HTTP requests get 503 with
        ``Retry-After`` (a load balancer sends them to another replica); HTTP requests in flight run to their
        last byte and engine requests (REST and MQTT) to their end. Escalations the broker still hands this
        worker meanwhile are taken; what ``stop()`` then cancels keeps its claim with the lease ended, so
        another worker takes it over at the edge's re-send."""
        self.lifecycle.draining = True
        deadline = time.monotonic() + timeout
        while not self._idle():
            if time.monotonic() >= deadline or (cancel is not None and cancel.is_set()):
                return False
            time.sleep(0.05)
        return True

    def _idle(self) -> bool:
        if self.lifecycle.in_flight:
            return False
        if self.engine is None:
            return True
        m = self.engine.metrics()
        return not m.get("requests_running") and not m.get("requests_waiting")

    def stop(self) -> None:
        """Stop accepting, finish or cancel what runs, say goodbye on the broker, release the engine."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(15)
            self._thread = None
        if self.retention is not None:
            self.retention.stop()
            self.retention = None
        if self.rollouts is not None:
            self.rollouts.stop()
            self.rollouts = None
        if self.worker is not None:
            self.worker.stop()
            self.worker = None
        if self.transport is not None:
            try:
                if self.transport.connected:
                    state_topic = topics.state(topics.CLOUD_SITE, self.settings.worker_id)
                    self.transport.publish(state_topic, make(self._state("death"), sender=self.settings.worker_id),
                                           retain=True, timeout=2.0)
            finally:
                self.transport.stop()
                self.transport = None
        if self._own_engine and self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self._own_store and self.store is not None:
            self.store.close()
            self.store = None

    def __enter__(self) -> "CloudService":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
