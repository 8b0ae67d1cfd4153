"""The ``[edge]`` configuration section: model, policy, power profile, outbox limits.

Read with ``apiary.shared.config.load_section("edge", EdgeSettings, path)``, so every key
can be overridden from the environment, e.g. ``APIARY__EDGE__POLICY__MIN_CONFIDENCE=-2``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from apiary.shared.config import load_section
from apiary.shared.prompting import PROMPT_STYLES
from apiary.shared.protocol import Severity


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PolicySettings(_Section):
    """When the edge hands an event to the cloud. Every rule that fires is a reason in the answer."""

    # Confidence = a low quantile of the per-token log-probabilities (not the mean, which
    # long answers drag down and short ones inflate). Escalate when it is below this.
    # For the shipped student: its least confident 10 % on the calibration split (`apiary bench edge`,
    # see docs/edge.md); other models need their own.
    min_confidence: float = -0.14
    quantile: float = Field(default=0.1, ge=0.0, le=0.5)
    # "decision": only the tokens of the assessment and urgency values; "all": every generated token.
    confidence_span: Literal["decision", "all"] = "decision"
    # Escalate when the (1 - quantile) entropy quantile of the same tokens is above this (nats); None: off.
    max_entropy: float | None = None
    critical_severities: list[Severity] = Field(default_factory=lambda: [Severity.CRITICAL])
    critical_flags: list[str] = Field(default_factory=list)  # e.g. ["hive_weight_drop"]: always escalate
    critical_kinds: list[Literal["reading", "question"]] = Field(default_factory=list)
    escalate_invalid: bool = True  # the local answer did not validate as an Action
    honour_want_cloud: bool = True  # the operator asked for a cloud answer
    # What a down link means: "queue" escalations in the outbox (store and forward),
    # "online_only" (answer locally instead), "never" (the device has no cloud at all).
    link: Literal["queue", "online_only", "never"] = "queue"
    max_escalations_per_hour: int | None = Field(default=None, ge=0)  # data plan / radio budget
    min_soc_for_radio: float = Field(default=0.0, ge=0.0, le=1.0)  # no transmissions below this charge
    draft_before_escalating: bool = True  # run the local model for critical events so the cloud gets a draft
    draft_when_cloud_asked: bool = False  # ...and when the operator asked for cloud


DEFAULT_BATTERY_CURVE: list[tuple[float, float]] = [
    # Resting open-circuit voltage of one Li-ion cell (NMC) -> state of charge.
    (3.00, 0.00), (3.30, 0.05), (3.50, 0.12), (3.60, 0.20), (3.70, 0.35), (3.80, 0.55),
    (3.90, 0.70), (4.00, 0.80), (4.10, 0.90), (4.20, 1.00),
]


class PowerProfile(_Section):
    """What the device's power looks like, so the agent can price a token in joules."""

    enabled: bool = True
    cpu_watts: float = Field(default=1.5, gt=0)  # extra draw of one fully busy core; energy = CPU seconds x this
    idle_watts: float = Field(default=0.5, ge=0)  # sensors, radio idle, SoC at rest
    battery_wh: float = Field(default=37.0, gt=0)  # e.g. one 10 Ah 3.7 V cell
    reserve_soc: float = Field(default=0.25, ge=0.0, le=1.0)  # below it the battery pays for sensing only
    horizon_h: float = Field(default=12.0, gt=0)  # spend the charge above reserve over this many hours (a night)
    low_soc: float = Field(default=0.4, ge=0.0, le=1.0)  # below it: fewer threads and tokens
    low_threads: int = Field(default=1, ge=1)
    low_max_tokens: int = Field(default=64, ge=8)
    joules_per_token: float = Field(default=0.03, gt=0)  # prior until the first inference is measured
    battery_curve: list[tuple[float, float]] = Field(default_factory=lambda: list(DEFAULT_BATTERY_CURVE))

    @field_validator("battery_curve")
    @classmethod
    def _monotone(cls, curve: list[tuple[float, float]]) -> list[tuple[float, float]]:
        if len(curve) < 2:
            raise ValueError("battery_curve needs at least two (volts, soc) points")
        volts = [v for v, _ in curve]
        socs = [s for _, s in curve]
        if volts != sorted(volts) or socs != sorted(socs) or len(set(volts)) != len(volts):
            raise ValueError("battery_curve must rise in both volts and state of charge")
        if not all(0.0 <= s <= 1.0 for s in socs):
            raise ValueError("battery_curve state of charge must be within 0..1")
        return curve


class OtaSettings(_Section):
    """Over-the-air updates (``[edge.ota]``): who may sign images, and what an update may cost the device."""

    enabled: bool = True  # subscribe to this device's ota/cmd topic and apply signed images
    # The Ed25519 public key images must be signed with: 64 hex characters, a PEM, or a file holding
    # either. None: the release key shipped beside the edge student (shared/models/edge-student).
    public_key: str | None = None
    # Operators' Ed25519 public keys (same forms): a rollback grant signed by one of them lets an OTA command
    # install an image older than the running one (`apiary image rollback`). Empty: no rollback is accepted.
    operator_keys: list[str] = Field(default_factory=list)
    # Refused before a byte is written, whatever the command announces (and the stream is cut there too).
    max_image_bytes: int = Field(default=256 * 1024 * 1024, ge=1)
    # Left free after the download and the unpacked model: the SQLite store, logs and the OS need it.
    min_free_bytes: int = Field(default=64 * 1024 * 1024, ge=0)
    # Below this battery state of charge an update is deferred (reported "deferred") and taken up
    # again once a reading shows the battery above it; a download in progress stops and resumes later.
    min_soc: float = Field(default=0.4, ge=0.0, le=1.0)
    health_budget_s: float = Field(default=120.0, gt=0)  # the new model must load and answer the probe in it
    download_attempts: int = Field(default=5, ge=1)  # a transfer is resumed this many times within one update


class EdgeSettings(_Section):
    """Everything the edge agent reads from ``[edge]``."""

    model_path: str | None = None  # a GGUF file; None: the named model below
    # A shipped signed edge image (shared.assets.SHIPPED, verified like an OTA image) or a registry
    # model; the default is the INT4 student distilled from the cloud's tuned teacher.
    model_name: str = "edge-student"
    # The shared.prompting style the model is asked in: "auto" (the GGUF's apiary.prompt_style metadata,
    # written by `apiary quantize` for a task-tuned model, else "examples"), "examples" or "short".
    prompt_style: str = "auto"
    threads: int = Field(default=2, ge=1)
    n_ctx: int = Field(default=2048, ge=256)
    max_tokens: int = Field(default=96, ge=16)  # the JSON action needs ~40-90 tokens
    top_k: int = Field(default=40, ge=2)  # grammar is checked on these candidates first; full vocab if none fits
    context_events: int = Field(default=6, ge=0)  # rolling per-device context kept and shown (last 3) in prompts
    state_dir: str = ".apiary/edge"
    outbox_max: int = Field(default=1000, ge=1)
    inbox_max: int = Field(default=1000, ge=1)
    escalation_deadline_s: float = Field(default=300.0, gt=0)  # the cloud answers "expired" after it
    escalation_grace_s: float = Field(default=30.0, ge=0)  # then the edge's draft becomes the final answer
    cloud_max_tokens: int = Field(default=128, ge=16)
    ack_timeout_s: float = Field(default=5.0, gt=0)
    state_interval_s: float = Field(default=60.0, gt=0)  # telemetry update at most this often
    policy: PolicySettings = Field(default_factory=PolicySettings)
    power: PowerProfile = Field(default_factory=PowerProfile)
    ota: OtaSettings = Field(default_factory=OtaSettings)
    # an unanswered escalation goes out again after this (doubling up to 8x) until its deadline, not
    # only after a reconnect: the cloud may lose one while this link stays up (edge.resend)
    escalation_resend_s: float = Field(default=30.0, gt=0)

    @field_validator("prompt_style")
    @classmethod
    def _known_style(cls, style: str) -> str:
        if style != "auto" and style not in PROMPT_STYLES:
            raise ValueError(f"prompt_style must be auto, {' or '.join(PROMPT_STYLES)}, got {style!r}")
        return style

    @property
    def model_prompt_style(self) -> str | None:
        """``prompt_style`` as ``LocalModel`` takes it: None for ``auto`` (the model's own)."""
        return None if self.prompt_style == "auto" else self.prompt_style

    @model_validator(mode="after")
    def _tokens_fit(self) -> "EdgeSettings":
        if self.max_tokens >= self.n_ctx:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be below n_ctx ({self.n_ctx})")
        return self

    def resolve_model_path(self) -> Path:
        """The GGUF to load: ``model_path``, or ``model_name``'s verified file (a shipped edge image,
        unpacked once; a registry model, pulled and hash-checked if missing)."""
        if self.model_path:
            return Path(self.model_path).expanduser()
        from apiary.shared import assets

        return assets.model_file(self.model_name)

    def resolve_ota_key(self) -> str | Path:
        """The key OTA images must be signed with: ``ota.public_key``, else the shipped release key
        (its sha256 checked against the one recorded in ``apiary.shared.assets``)."""
        if self.ota.public_key:
            return self.ota.public_key
        from apiary.shared import assets

        asset = assets.SHIPPED["edge-student"]
        path = assets.MODELS_DIR / asset.folder / assets.RELEASE_KEY_FILE
        expected = dict(asset.files)[assets.RELEASE_KEY_FILE]
        if not path.is_file() or assets.sha256_file(path) != expected:
            raise assets.AssetError(f"the shipped release key {path} is missing or altered; set [edge.ota] public_key")
        return path


def load(path: str | Path | None = None, **explicit: Any) -> EdgeSettings:
    """The ``[edge]`` section of the config file, environment overrides, then ``explicit`` values."""
    return load_section("edge", EdgeSettings, path, **explicit)
