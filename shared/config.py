"""One typed configuration for every tier: a TOML file plus environment overrides.

Every room reads its own section of the same file through :func:`load_section` with
its own pydantic model, so ``shared`` does not need to know the rooms. Environment
variables override the file: ``APIARY__MQTT__PORT=1884`` sets ``[mqtt] port``; values
are parsed as TOML scalars when they can be (numbers, booleans), strings otherwise.
The file comes from ``--config`` or ``$APIARY_CONFIG``.
"""
from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ENV_PREFIX = "APIARY__"
M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """The configuration file or an override is malformed."""


class MqttConfig(BaseModel):
    """How to reach the broker. ``protocol="auto"`` tries MQTT 5 and falls back to 3.1.1."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=1883, ge=1, le=65535)
    username: str | None = None
    password: str | None = None
    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    keepalive: int = Field(default=30, ge=5)
    protocol: Literal["auto", "5", "3.1.1"] = "auto"
    max_payload: int = Field(default=256 * 1024, ge=1024)
    reconnect_min_s: float = 0.2
    reconnect_max_s: float = 10.0

    @classmethod
    def from_url(cls, url: str, **overrides: Any) -> "MqttConfig":
        """``mqtt://user:pass@host:port`` or ``mqtts://…`` (TLS)."""
        from urllib.parse import urlparse

        u = urlparse(url)
        if u.scheme not in ("mqtt", "mqtts", "tcp", "ssl"):
            raise ConfigError(f"broker URL must start with mqtt:// or mqtts://, got {url!r}")
        tls = u.scheme in ("mqtts", "ssl")
        return cls(host=u.hostname or "127.0.0.1", port=u.port or (8883 if tls else 1883),
                   username=u.username, password=u.password, tls=tls, **overrides)

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


def with_broker_url(section: MqttConfig, broker: str | None) -> MqttConfig:
    """The ``[mqtt]`` section with a broker URL (``--broker``) laid over it: the URL gives host, port, scheme and
    credentials (when it has some); TLS files and the rest stay the section's. So every room reads the broker the
    same way, and ``--broker mqtts://host:8883`` still presents the node's certificate from the config file."""
    if not broker:
        return section
    url = MqttConfig.from_url(broker)
    update: dict[str, Any] = {"host": url.host, "port": url.port, "tls": url.tls}
    if url.username is not None:
        update.update(username=url.username, password=url.password)
    return section.model_copy(update=update)


def mqtt_settings(path: str | Path | None = None, broker: str | None = None, *,
                  environ: dict[str, str] | None = None) -> MqttConfig:
    """``[mqtt]`` (file, then ``APIARY__MQTT__*``) with ``broker`` laid over it: how bridge, edge and cloud all
    find their broker."""
    return with_broker_url(load_section("mqtt", MqttConfig, path, environ=environ), broker)


def read_file(path: str | Path | None = None) -> dict[str, Any]:
    """The raw TOML document (empty when no file is configured)."""
    path = path or os.environ.get("APIARY_CONFIG")
    if not path:
        return {}
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def _parse_scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"x = {text}")["x"]
    except tomllib.TOMLDecodeError:
        return text


def env_overrides(section: str, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Nested overrides for ``section`` from ``APIARY__SECTION__KEY[__SUBKEY]`` variables."""
    environ = os.environ if environ is None else environ
    prefix = f"{ENV_PREFIX}{section.upper()}__"
    out: dict[str, Any] = {}
    for key, value in environ.items():
        if not key.startswith(prefix):
            continue
        path = [p.lower() for p in key[len(prefix):].split("__") if p]
        node = out
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = _parse_scalar(value)
    return out


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in top.items():
        merged[k] = _merge(merged[k], v) if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
    return merged


def load_section(section: str, schema: type[M], path: str | Path | None = None, /, *,
                 environ: dict[str, str] | None = None, **explicit: Any) -> M:
    """Section ``section`` of the config as ``schema``: file, then environment, then ``explicit`` kwargs.

    The first three parameters are positional-only so that any setting name (``model``,
    ``path``, …) can be passed in ``explicit``."""
    raw = read_file(path).get(section, {})
    if not isinstance(raw, dict):
        raise ConfigError(f"[{section}] must be a table")
    data = _merge(_merge(raw, env_overrides(section, environ)), {k: v for k, v in explicit.items() if v is not None})
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"invalid [{section}] configuration: {e}") from None
