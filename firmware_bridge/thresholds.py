"""Readings to a severity and flags, from configurable thresholds.

Each reading may have a plausible range (outside it the sensor is broken, not the
hive: ``<name>_implausible``), warning and critical limits on either side
(``<name>_high`` / ``<name>_low``), and a missing sensor is ``<name>_missing``. A watch
level below the warning (``<name>_elevated``, severity info) marks readings that are no
alarm by themselves but outside what a quiet hive shows: the edge looks at those with its
model instead of logging them as routine (early robbing raises traffic and the hum well
before traffic crosses its warning limit). One
rule looks at two consecutive readings of a device: a sudden weight drop (a swarm
leaving takes kilograms in minutes) is ``hive_weight_drop``. The severity is the worst
rule that fired. The bridge and the simulator's labelled situations share
:func:`assess`, so evaluation data carries exactly what the bridge would publish.
"""
from __future__ import annotations

from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator

from apiary.shared.protocol import Severity

from apiary.firmware_bridge.frames import READING_NAMES

_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}
_SEVERITY = {v: k for k, v in _RANK.items()}


class Limits(BaseModel):
    """Thresholds for one reading; ``None`` disables that side."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    valid_min: float | None = None
    valid_max: float | None = None
    warn_low: float | None = None
    warn_high: float | None = None
    crit_low: float | None = None
    crit_high: float | None = None
    watch_high: float | None = None  # at or above: ``<name>_elevated`` (severity info), below warn_high


# Watch levels sit at the edge of what the simulator's quiet hives reach in a brood-season day
# (hum <= ~265 Hz; traffic <= ~2,900 bees/min at the busiest hour): robbing raises the hum to
# 260-330 Hz from its start, often before traffic crosses its warning limit. Measured on a
# normal fleet week, 0.5% of readings are flagged elevated and get a look from the model.

# Sensible for a managed Apis mellifera colony in the brood season (see docs/frames.md).
DEFAULT_LIMITS: dict[str, dict[str, float]] = {
    "hive_temp_c": dict(valid_min=-30, valid_max=70, warn_low=30, crit_low=20, warn_high=37, crit_high=39),
    "hive_humidity_pct": dict(valid_min=0.5, valid_max=99.9, warn_low=35, warn_high=85),
    "ambient_temp_c": dict(valid_min=-40, valid_max=60, warn_high=35, crit_high=40, warn_low=-5),
    "hive_weight_kg": dict(valid_min=1, valid_max=200),
    "acoustic_db": dict(valid_min=10, valid_max=120, warn_high=72),
    "acoustic_freq_hz": dict(valid_min=20, valid_max=4000, warn_high=380, watch_high=260),
    "bee_traffic": dict(valid_max=20000, warn_high=6000, watch_high=4000),
    "battery_v": dict(valid_min=2.0, valid_max=4.5, warn_low=3.5, crit_low=3.35),
    "solar_w": dict(valid_min=0, valid_max=100),
}


class Thresholds(BaseModel):
    """All rules. Limits given in config are merged field by field over the defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    limits: dict[str, Limits] = Field(default_factory=lambda: {k: Limits(**v) for k, v in DEFAULT_LIMITS.items()})
    weight_drop_warn_kg: float = Field(default=0.8, gt=0)
    weight_drop_crit_kg: float = Field(default=1.5, gt=0)
    weight_drop_window_s: float = Field(default=3600.0, gt=0)  # only compare readings this close in time
    missing_severity: Severity = Severity.WARNING
    implausible_severity: Severity = Severity.WARNING

    @field_validator("limits", mode="before")
    @classmethod
    def _merge_defaults(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value
        merged: dict[str, Any] = {k: dict(v) for k, v in DEFAULT_LIMITS.items()}
        for name, lim in value.items():
            if name not in READING_NAMES:
                raise ValueError(f"unknown reading {name!r}; known: {', '.join(READING_NAMES)}")
            merged[name] = {**merged.get(name, {}), **(lim.model_dump(exclude_unset=True) if isinstance(lim, Limits)
                                                      else dict(lim))}
        return merged


DEFAULT_THRESHOLDS = Thresholds()


_INF = float("inf")
_Row = tuple[float, float, float, float, float, float, float]
_compiled: dict[int, tuple[Thresholds, dict[str, _Row]]] = {}


def _table(thresholds: Thresholds) -> dict[str, _Row]:
    """Limits as plain floats (None -> +-inf), computed once per Thresholds: assess runs per frame."""
    hit = _compiled.get(id(thresholds))
    if hit is not None and hit[0] is thresholds:
        return hit[1]

    def f(v: float | None, default: float) -> float:
        return default if v is None else float(v)

    table = {}
    for name, lim in thresholds.limits.items():
        crit_low, crit_high = f(lim.crit_low, -_INF), f(lim.crit_high, _INF)
        # a critical limit alone also starts the flag: the warning side is never looser than it
        warn_high = min(f(lim.warn_high, _INF), crit_high)
        table[name] = (f(lim.valid_min, -_INF), f(lim.valid_max, _INF), crit_low, max(f(lim.warn_low, -_INF), crit_low),
                       warn_high, crit_high, min(f(lim.watch_high, _INF), warn_high))
    if len(_compiled) > 64:
        _compiled.clear()
    _compiled[id(thresholds)] = (thresholds, table)
    return table


def assess(readings: Mapping[str, float], *, missing: tuple[str, ...] | list[str] = (),
           previous: tuple[float, Mapping[str, float]] | None = None, timestamp: float | None = None,
           thresholds: Thresholds = DEFAULT_THRESHOLDS) -> tuple[Severity, list[str]]:
    """Severity and flags for one frame's readings. ``previous`` is the device's last
    ``(timestamp, readings)``, used by the weight-drop rule."""
    table = _table(thresholds)
    flags: list[str] = []
    rank = 0
    for name in missing:
        flags.append(f"{name}_missing")
        rank = max(rank, _RANK[thresholds.missing_severity])
    for name, value in readings.items():
        lim = table.get(name)
        if lim is None:
            continue
        vmin, vmax, crit_low, warn_low, warn_high, crit_high, watch_high = lim
        if value < vmin or value > vmax:
            flags.append(f"{name}_implausible")
            rank = max(rank, _RANK[thresholds.implausible_severity])
        elif value >= warn_high:
            flags.append(f"{name}_high")
            rank = max(rank, 2 if value >= crit_high else 1)
        elif value <= warn_low:
            flags.append(f"{name}_low")
            rank = max(rank, 2 if value <= crit_low else 1)
        elif value >= watch_high:
            flags.append(f"{name}_elevated")
    if previous is not None and timestamp is not None and "hive_weight_kg" in readings:
        prev_ts, prev = previous
        before, now = prev.get("hive_weight_kg"), readings["hive_weight_kg"]
        lim = table.get("hive_weight_kg", (-_INF, _INF))
        if (before is not None and 0 < timestamp - prev_ts <= thresholds.weight_drop_window_s
                and lim[0] <= before <= lim[1] and lim[0] <= now <= lim[1]):
            drop = before - now
            if drop >= thresholds.weight_drop_warn_kg or drop >= thresholds.weight_drop_crit_kg:
                flags.append("hive_weight_drop")
                rank = max(rank, 2 if drop >= thresholds.weight_drop_crit_kg else 1)
    return _SEVERITY[rank], flags

