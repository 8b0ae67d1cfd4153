"""The bridge's own configuration: the ``[bridge]`` section of the shared config file.

Example::

    [bridge]
    name = "bridge-north"
    default_site = "north-field"
    buffer_size = 20000
    [bridge.sites]          # device id -> site; unlisted devices go to default_site
    7 = "orchard"
    [bridge.thresholds.limits.hive_temp_c]
    warn_high = 37.5        # merged over the defaults, field by field

Every key can be overridden from the environment, e.g. ``APIARY__BRIDGE__BUFFER_SIZE=500``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from apiary.shared.config import load_section
from apiary.shared.hostname import host_name
from apiary.shared.topics import DEFAULT_SITE

from apiary.firmware_bridge.thresholds import Thresholds

DEFAULT_STATE_DIR = ".apiary/bridge"
DURABLE_ROLES = ("serial", "udp")  # a capture file is replayed on purpose, so `replay` keeps no windows by default

Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class BridgeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # the bridge's node name on the state topic and its MQTT client id; the CLI's default is default_name(role)
    name: Name = "bridge-0"
    default_site: Name = DEFAULT_SITE
    sites: dict[int, Name] = Field(default_factory=dict)  # device id -> site
    node_prefix: Annotated[str, Field(max_length=58, pattern=r"^[A-Za-z0-9_.-]*$")] = "hive-"
    buffer_size: int = Field(default=10_000, ge=1)  # events held while the broker is unreachable
    max_in_flight: int = Field(default=100, ge=1)  # unacknowledged QoS 1 publishes before the bridge waits
    state_interval_s: float = Field(default=10.0, gt=0)  # how often counters are published
    idle_timeout_s: float = Field(default=0.25, gt=0)  # serial: a line this quiet ends any partial frame
    thresholds: Thresholds = Field(default_factory=Thresholds)
    # where the bridge keeps sequence windows and spilled frames (<state_dir>/<name>.db); None: memory only.
    # The serial and UDP commands default it to DEFAULT_STATE_DIR.
    state_dir: str | None = None
    spill_budget_mb: float = Field(default=256.0, gt=0)  # disk for frames past buffer_size; oldest dropped beyond

    def site_of(self, device_id: int) -> str:
        return self.sites.get(device_id, self.default_site)

    def node_of(self, device_id: int) -> str:
        """The device's node name in topics and events, e.g. ``hive-0007``."""
        return f"{self.node_prefix}{device_id:04d}"


def default_name(role: str) -> str:
    """``bridge-<host>-<role>``: a serial and a UDP bridge on one host never share a client id (each would knock
    the other off the broker), and a bridge restarted on its host gets its session back."""
    return f"bridge-{host_name()}-{role}"


def load_settings(path: str | Path | None = None, *, environ: dict[str, str] | None = None, role: str | None = None,
                  **explicit: Any) -> BridgeSettings:
    """``[bridge]`` from the config file, then ``APIARY__BRIDGE__*`` variables (``environ``, default
    ``os.environ``), then ``explicit`` (``None`` values ignored); a name set by none of them is
    ``default_name(role)`` when a ``role`` is given, and ``state_dir`` set by none of them is
    ``DEFAULT_STATE_DIR`` for the serial and UDP roles. Raises ``apiary.shared.config.ConfigError``."""
    settings = load_section("bridge", BridgeSettings, path, environ=environ, **explicit)
    update: dict[str, Any] = {}
    if role is not None and "name" not in settings.model_fields_set:
        update["name"] = default_name(role)
    if role in DURABLE_ROLES and "state_dir" not in settings.model_fields_set:
        update["state_dir"] = DEFAULT_STATE_DIR
    return settings.model_copy(update=update) if update else settings
