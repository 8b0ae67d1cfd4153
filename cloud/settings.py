"""The cloud service's configuration: the ``[cloud]`` section of the apiary config file.

Precedence: file (``--config`` / ``$APIARY_CONFIG``), then ``APIARY__CLOUD__KEY``
environment variables, then explicit values (CLI flags). Everything has a default that
runs on one laptop: loopback HTTP on 8000, SQLite under ``.apiary/``, the registry model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from apiary.cloud.errors import CloudError
from apiary.shared.config import ConfigError, MqttConfig, load_section, with_broker_url
from apiary.shared.hostname import host_name
from apiary.shared.model_ids import aliases, model_id
from apiary.shared.topics import DEFAULT_SHARE_GROUP


def default_worker_id() -> str:
    """``cloud-<host>``: the same in every process on a machine, so a restarted worker gets its broker session
    (escalations queued while it was away) and its unfinished claims back. Give each worker on one machine
    its own ``worker_id``: two processes with one id take the MQTT session from each other."""
    return f"cloud-{host_name()}"


class CloudSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # HTTP
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0: pick a free port
    # HTTPS: the server certificate and key (PEM; `apiary pki issue HOST --server`); both or neither
    tls_cert: str | None = None
    tls_key: str | None = None
    public_url: str | None = None  # how devices reach this server (OTA image URLs); default: the request's base URL
    max_body_bytes: int = Field(default=1 << 20, ge=1024)  # larger request bodies get 413
    api_key_file: str | None = ".apiary/cloud-keys.jsonl"
    # auto: when no key is configured, make a process-local key with both scopes and print it once
    generate_key: Literal["auto", "always", "never"] = "auto"
    default_priority: int = Field(default=5, ge=0, le=9)  # REST requests without a priority
    default_max_tokens: int = Field(default=256, ge=1)  # chat requests without max_tokens (capped to the context)
    max_tokens_limit: int = Field(default=4096, ge=1)  # larger max_tokens are refused with 400
    retry_after_s: int = Field(default=1, ge=1)  # Retry-After on 429

    # MQTT
    broker: str | None = None  # mqtt://host:port; None runs the REST API only
    share_group: str = DEFAULT_SHARE_GROUP
    worker_id: str = Field(default_factory=default_worker_id)
    worker_concurrency: int = Field(default=32, ge=1)  # escalations in flight per worker
    claim_lease_s: float = Field(default=60.0, gt=0)  # another worker may take over an unfinished claim after this
    overload_retry_s: float = Field(default=10.0, ge=0)  # an escalation retries a full engine queue this long
    # the broker keeps the worker's subscriptions and queues escalations while it is away (restart, crash);
    # keyed by worker_id. To retire a worker for good, run it once with this off (its session ends)
    persistent_session: bool = True
    # ...for this long after it left (MQTT 5): the edge's escalation deadline, past which a queued request
    # is answered "expired" anyway; a shared subscription keeps handing an absent member its share till then
    session_expiry_s: int = Field(default=300, ge=0)
    record: bool = True  # run the fleet recorder (state, events, answers, OTA status)
    escalations: bool = True  # run the escalation worker

    # model + engine
    model: str = "smollm2-135m-q4"  # a path (GGUF file or HF folder) or a shared.assets registry name
    # a LoRA adapter merged into the model at load (apiary finetune), the task-tuned teacher: a folder, a
    # shipped name (shared.assets.SHIPPED), "none", or "auto" = the shipped teacher when `model` is its base
    adapter: str = "auto"
    # the id clients send as "model"; default: the registry name, also when `model` is that model's file
    served_model_name: str | None = None
    device: str = "cpu"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # decoder weights: auto (bf16-held where `dtype` auto is float32 on a CPU without native bf16), in `dtype`, or int8 (W8A8 + SmoothQuant, CPU only; docs/engine.md "int8 weights"), or bf16
    # (a float32 engine's weights held in bf16, float32 sums, CPU only; docs/engine.md "bf16 weights, float32 sums")
    weights: Literal["auto", "dtype", "int8", "bf16"] = "auto"
    # the LM head: auto ranks in int8 with the logits that can win exact, for bf16, int8 and bf16-weight engines on CPU
    # (docs/engine.md "The LM head ranks in int8"); dtype: in `dtype`
    head: Literal["auto", "dtype"] = "auto"
    # KV cache rows: auto (bf16 where `weights` resolved to bf16-held under float32 rows, else `dtype`), in `dtype`, in
    # bf16 (CPU only under float32; docs/engine.md "bf16 KV rows under float32"), or int8 with per-token scales (CPU
    # only; docs/engine.md "int8 KV cache")
    kv_cache_dtype: Literal["auto", "dtype", "bf16", "int8"] = "auto"
    # on CUDA, decode steps replay captured graphs (docs/engine.md "CUDA graphs"); false: every step eager
    cuda_graphs: bool = True
    kv_cache_mb: int = Field(default=512, ge=1)
    max_num_seqs: int = Field(default=32, ge=1)
    max_num_batched_tokens: int = Field(default=1024, ge=16)
    max_waiting: int = Field(default=256, ge=1)  # beyond this the API answers 429
    max_model_len: int | None = Field(default=None, ge=16)
    num_threads: int | None = Field(default=None, ge=1)
    # speculative decoding (docs/speculative.md): off, ngram (prompt lookup, no model) or draft (a small model);
    # outputs never change, only speed, and the engine switches it off by itself when it does not pay
    speculative: Literal["off", "ngram", "draft"] = "off"
    spec_k: int = Field(default=8, ge=1, le=32)  # most proposals per sequence and step
    draft_model: str | None = None  # draft checkpoint path or registry name (required for "draft")
    draft_layers: int | None = Field(default=None, ge=1)  # use only the draft's first n layers

    # who answers escalations: "engine" (this process runs the model) or "openai" (an OpenAI-compatible server
    # at upstream_url: vLLM, SGLang, llama.cpp's server, Ollama, another apiary cloud; this process then loads
    # no model and no torch). docs/cloud.md "Any OpenAI-compatible upstream"
    backend: Literal["engine", "openai"] = "engine"
    upstream_url: str | None = None  # the OpenAI base URL, e.g. http://vllm:8000/v1
    upstream_model: str | None = None  # the "model" of each request (required with backend = "openai")
    upstream_key_file: str | None = None  # a file holding the upstream's API key (never the key in this file)
    upstream_key_env: str | None = None  # ... or the name of an environment variable holding it
    upstream_prompt_style: Literal["examples", "short"] = "examples"  # "short" for a task-tuned upstream model
    upstream_timeout_s: float = Field(default=120.0, gt=0)  # one request, connect to last byte
    upstream_retry_s: float = Field(default=300.0, ge=0)  # retry 5xx/429/connection errors this long
    upstream_priority: bool = True  # send vLLM's "priority" (vLLM needs --scheduling-policy priority for it)
    upstream_logprobs: bool = True  # ask for logprobs (the answer's confidence)
    upstream_probe_s: float = Field(default=10.0, gt=0)  # /ready re-probes the upstream this often

    # storage: postgresql://user:pass@host/db (replicas on several machines; run `apiary cloud db upgrade`
    # first), sqlite:///path, or a plain path = SQLite, the embedded default (upgraded at start)
    db: str = ".apiary/cloud.db"
    # prune events, answers, OTA statuses and finished escalations older than this (labelled events and
    # unfinished claims stay); 0 or "none": keep everything
    retention_days: float = Field(default=0.0, ge=0)
    retention_interval_s: float = Field(default=3600.0, gt=0)  # how often the service prunes
    images: str = ".apiary/images"

    @field_validator("share_group", "worker_id")
    @classmethod
    def _name(cls, v: str) -> str:
        import re

        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", v):
            raise ValueError(f"{v!r} must be 1-64 of [A-Za-z0-9_.-]")
        return v

    @field_validator("db")
    @classmethod
    def _db(cls, v: str) -> str:
        from apiary.cloud.db.engine import database_url

        database_url(v)  # an unsupported URL scheme is a CloudError, i.e. a ValueError: a validation error
        return v

    @field_validator("retention_days", mode="before")
    @classmethod
    def _retention(cls, v: Any) -> Any:
        return 0.0 if v is None or (isinstance(v, str) and v.strip().lower() in ("none", "")) else v

    @model_validator(mode="after")
    def _tls_pair(self) -> "CloudSettings":
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both for HTTPS, or neither")
        for path in (self.tls_cert, self.tls_key):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS file not found: {path}")
        return self

    @model_validator(mode="after")
    def _upstream(self) -> "CloudSettings":
        if self.backend == "openai":
            if not self.upstream_url or not self.upstream_url.startswith(("http://", "https://")):
                raise ValueError(f"backend = 'openai' needs upstream_url, an http(s) base URL such as "
                                 f"http://host:8000/v1 (got {self.upstream_url!r})")
            if not self.upstream_model:
                raise ValueError("backend = 'openai' needs upstream_model, the model name the upstream serves")
            if self.upstream_key_file and self.upstream_key_env:
                raise ValueError("give the upstream key as upstream_key_file or upstream_key_env, not both")
        return self

    @field_validator("broker")
    @classmethod
    def _broker(cls, v: str | None) -> str | None:
        if v:
            MqttConfig.from_url(v)  # ConfigError is a ValueError: reported as a validation error
        return v or None

    _mqtt_section: MqttConfig = PrivateAttr(default_factory=MqttConfig)  # [mqtt], set by load_settings

    @property
    def mqtt(self) -> MqttConfig | None:
        """The broker URL over the ``[mqtt]`` section (its TLS files: the cloud's client certificate)."""
        return with_broker_url(self._mqtt_section, self.broker) if self.broker else None

    @property
    def model_name(self) -> str:
        """The id clients send as ``model``: ``served_model_name``, else the model's one id (shared.model_ids)."""
        return self.served_model_name or model_id(self.model)

    @property
    def model_aliases(self) -> frozenset[str]:
        """Other names a request may give for the model (its id and file names), served rather than a 404."""
        return (aliases(self.model) | {model_id(self.model)}) - {self.model_name}

    def speculative_config(self) -> Any:
        """The engine's SpeculativeConfig for these settings (None when off)."""
        if self.speculative == "off":
            return None
        from apiary.cloud.engine import SpeculativeConfig

        if self.speculative == "ngram":
            return SpeculativeConfig(method="ngram", k=self.spec_k)
        if not self.draft_model:
            # The model's own first layers are a valid draft but a useless one (0% acceptance measured):
            # a draft has to be trained for the job (apiary distill).
            raise CloudError("speculative = 'draft' needs draft_model: a same-tokenizer checkpoint such as a "
                             "distilled student (apiary distill); or use speculative = 'ngram'")
        return SpeculativeConfig(method="draft", k=self.spec_k, draft_num_layers=self.draft_layers,
                                 draft_model_path=self.resolve_model_path(self.draft_model))

    def resolve_adapter_path(self, model_path: Path) -> Path | None:
        """The adapter folder to merge into ``model_path`` (None: serve the model as it is)."""
        from apiary.shared import assets

        if self.adapter == "none":
            return None
        if self.adapter == "auto":
            try:
                return assets.adapter_for(model_path)
            except assets.AssetError as e:
                raise CloudError(f"the shipped teacher adapter is damaged: {e}") from None
        path = Path(self.adapter).expanduser()
        if path.is_dir():
            return path
        try:
            return assets.shipped(self.adapter)
        except assets.AssetError as e:
            raise CloudError(f"adapter {self.adapter!r} is neither a folder nor a usable shipped name: {e}") from None

    def resolve_model_path(self, name: str | None = None) -> Path:
        """A path the engine can load (``name``, default: ``model``): existing paths as is, registry names
        pulled via shared.assets."""
        name = self.model if name is None else name
        path = Path(name).expanduser()
        if path.exists():
            return path
        from apiary.shared import assets

        try:
            return assets.ensure(name)
        except assets.AssetError as e:
            raise CloudError(f"model {name!r} is neither an existing path nor a usable registry name: {e}") from None


def load_settings(path: str | Path | None = None, **explicit: Any) -> CloudSettings:
    """``[cloud]`` from the config file, environment, then ``explicit`` (None values are ignored)."""
    try:
        # explicit values are merged here, not passed to load_section: "model" is one of its own parameter names
        base = load_section("cloud", CloudSettings, path)
        merged = {**base.model_dump(exclude_unset=True), **{k: v for k, v in explicit.items() if v is not None}}
        settings = CloudSettings.model_validate(merged)
        settings._mqtt_section = load_section("mqtt", MqttConfig, path)
        return settings
    except ConfigError as e:
        raise CloudError(str(e)) from None
    except ValidationError as e:
        raise CloudError(f"invalid [cloud] configuration: {e}") from None
