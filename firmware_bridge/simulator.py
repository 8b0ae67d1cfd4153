"""A fleet of virtual beehives emitting real frames, with labelled anomalies.

Each hive follows the daily cycles a real hive monitor records: ambient temperature
peaking mid-afternoon under a per-site weather that drifts day to day; a brood nest the
colony holds near 34.5 °C; foragers leaving at dawn (weight dips) and returning with
nectar (weight climbs through the day); traffic and hum following flight activity; a
solar panel charging a Li-ion cell by day and the logger draining it by night.

Anomalies are injected per device over a time window and label every frame inside it:

* ``heat_stress``  ambient above 38 °C, brood nest climbing past 37-40 °C, fanning hum, bearding
* ``swarming``     pre-swarm piping (dominant frequency 400-550 Hz, louder), then half the
                   colony leaves: a traffic burst and a 1.5-3 kg weight drop within minutes
* ``robbing``      traffic several times normal, steady weight loss, agitated hum
* ``sensor_fault`` a DS18B20 reading its power-on 85 °C or its disconnected -127 °C, a dead
                   humidity sensor, or a load cell reading zero
* ``low_battery``  the panel stops charging (shade, snow, dirt) and the cell runs down

Sim time is decoupled from wall time: every device reports every ``interval_s`` of sim
time; :func:`emit` paces frames to a wall-clock rate. Frames carry no label; the
:class:`Fleet` keeps the ground truth (``truth(device_id, seq)``) and
:func:`labelled_situations` builds a balanced evaluation set through the same
frame -> event mapping the bridge uses.
"""
from __future__ import annotations

import bisect
import calendar
import fcntl
import math
import os
import random
import select
import struct
import termios
import time
import tty
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping

from apiary.shared.protocol import ASSESSMENTS, SensorEvent

from apiary.firmware_bridge.errors import BridgeError
from apiary.firmware_bridge.events import frame_to_event
from apiary.firmware_bridge.frames import decode_frame, encode_frame
from apiary.firmware_bridge.settings import BridgeSettings
from apiary.firmware_bridge.thresholds import DEFAULT_THRESHOLDS

ANOMALIES: tuple[str, ...] = tuple(a for a in ASSESSMENTS if a != "normal")
DEFAULT_START = calendar.timegm((2025, 6, 14, 0, 0, 0))  # a midsummer midnight, sim time (UTC = local solar)
HOUR = 3600.0
DAY = 86400.0
FAULT_MODES = ("temp_85", "temp_disconnected", "humidity_dead", "scale_zero")
_FLIGHT_AREA = 3.2 * math.sqrt(math.pi) * HOUR  # integral of the flight-activity bell over a day, seconds


@dataclass(frozen=True, slots=True)
class AnomalySpec:
    duration_s: float
    ramp_s: float  # time for the signature to build up fully
    evident: tuple[float, float]  # fraction of the window where the label is unmistakable
    start_hours: tuple[float, float]  # when in the day it typically begins (local solar time)


SPECS: dict[str, AnomalySpec] = {
    "heat_stress": AnomalySpec(3 * HOUR, 1 * HOUR, (0.45, 1.0), (12, 15)),
    "swarming": AnomalySpec(80 * 60, 45 * 60, (0.6, 1.0), (10, 13)),
    "robbing": AnomalySpec(3 * HOUR, 30 * 60, (0.3, 1.0), (12, 15)),
    "sensor_fault": AnomalySpec(2 * HOUR, 0.0, (0.0, 1.0), (0, 24)),
    "low_battery": AnomalySpec(8 * HOUR, 4 * HOUR, (0.65, 1.0), (0, 24)),
}
SWARM_DEPARTURE = 0.75  # fraction of the swarming window at which the swarm leaves


@dataclass(slots=True)
class Anomaly:
    """One injected anomaly: ``kind`` on ``device_id`` over ``[start, start + duration_s)`` (sim time)."""

    kind: str
    device_id: int
    start: float
    duration_s: float
    mode: str = ""  # sensor_fault: which fault
    magnitude: float = 1.0  # scales the signature (0.7-1.3 gives variety)
    applied: bool = False  # swarming/robbing: weight already taken from the hive state

    @property
    def end(self) -> float:
        return self.start + self.duration_s

    def active(self, t: float) -> bool:
        return self.start <= t < self.end

    def strength(self, t: float) -> float:
        ramp = SPECS[self.kind].ramp_s
        return 1.0 if ramp <= 0 else min(1.0, max(0.0, (t - self.start) / ramp))


@dataclass(slots=True)
class HiveProfile:
    """Constants of one hive, drawn once: colony strength, stores, panel, battery, microclimate."""

    colony: float
    base_weight_kg: float
    nectar_kg_per_day: float
    panel_w: float
    battery_wh: float
    load_w: float
    brood_temp_c: float
    temp_offset_c: float

    @classmethod
    def draw(cls, rng: random.Random) -> "HiveProfile":
        return cls(colony=rng.uniform(0.7, 1.3), base_weight_kg=rng.uniform(32, 55),
                   nectar_kg_per_day=rng.uniform(0.2, 1.6), panel_w=rng.uniform(5, 10), battery_wh=rng.uniform(12, 20),
                   load_w=rng.uniform(0.2, 0.35), brood_temp_c=rng.uniform(34.2, 35.0),
                   temp_offset_c=rng.uniform(-1.0, 1.0))


class SiteWeather:
    """Per-site day-to-day weather: a mean temperature that drifts and a cloud cover.

    ``climate_c`` shifts every day's mean temperature (0: a temperate midsummer around 19 °C;
    +6: a hot-climate apiary whose afternoons pass 35 °C)."""

    def __init__(self, seed: int, climate_c: float = 0.0) -> None:
        self._seed = seed
        self.climate_c = climate_c
        self._days: dict[int, tuple[float, float]] = {}

    def day(self, t: float) -> tuple[float, float]:
        """(mean temperature °C, cloud cover 0-1) for the sim day containing ``t``."""
        d = int(t // DAY)
        if d not in self._days:
            rng = random.Random(self._seed * 1_000_003 + d)
            self._days[d] = (rng.gauss(19.0, 3.0) + self.climate_c, min(1.0, max(0.0, rng.betavariate(1.4, 2.6))))
        return self._days[d]


def _hour(t: float) -> float:
    return (t % DAY) / HOUR


def flight_activity(hour: float, ambient_c: float, cloud: float) -> float:
    """0-1: how many foragers are out (a midday bell, none below ~11 °C, less under cloud)."""
    bell = math.exp(-((hour - 13.0) / 3.2) ** 2)
    warm = min(1.0, max(0.0, (ambient_c - 11.0) / 8.0))
    return bell * warm * (1.0 - 0.5 * cloud)


def daylight(hour: float) -> float:
    return max(0.0, math.sin(math.pi * (hour - 6.0) / 12.0)) if 6.0 < hour < 18.0 else 0.0


_OCV = ((0.0, 3.0), (0.05, 3.4), (0.1, 3.55), (0.2, 3.68), (0.5, 3.8), (0.8, 4.0), (1.0, 4.18))


def cell_voltage(soc: float) -> float:
    """Open-circuit voltage of a 1S Li-ion cell at a state of charge (piecewise linear)."""
    soc = min(1.0, max(0.0, soc))
    for (s0, v0), (s1, v1) in zip(_OCV, _OCV[1:]):
        if soc <= s1:
            return v0 + (v1 - v0) * (soc - s0) / (s1 - s0)
    return _OCV[-1][1]


class VirtualHive:
    """One hive monitor: a profile, a little state (stores, battery), a sequence counter.

    ``noise_scale`` multiplies the Gaussian noise of every sensor reading (1: the calibrated
    sensors; 2.5: cheaper or ageing sensors)."""

    def __init__(self, device_id: int, site: str, weather: SiteWeather, rng: random.Random, *,
                 noise_scale: float = 1.0) -> None:
        self.device_id = device_id
        self.noise_scale = noise_scale
        self.site = site
        self.weather = weather
        self.rng = rng
        self.profile = HiveProfile.draw(rng)
        self.stores_kg = self.profile.base_weight_kg
        self.soc = rng.uniform(0.6, 0.95)
        self.seq = rng.randrange(0, 1 << 20)  # firmware starts from a persisted counter, not always 0
        self.last_t: float | None = None

    def step(self, t: float, anomaly: Anomaly | None = None) -> dict[str, float | None]:
        """Advance the hive to sim time ``t`` and return what its sensors read."""
        p, rng, k = self.profile, self.rng, self.noise_scale
        dt = 0.0 if self.last_t is None else min(max(0.0, t - self.last_t), 6 * HOUR)
        self.last_t = t
        hour = _hour(t)
        mean_c, cloud = self.weather.day(t)
        ambient = mean_c + p.temp_offset_c + 7.0 * math.cos(2 * math.pi * (hour - 15.0) / 24.0) + rng.gauss(0, 0.3 * k)
        activity = flight_activity(hour, ambient, cloud)
        sun = daylight(hour) * (1.0 - 0.75 * cloud)

        # state: nectar in by day, evaporation and consumption always; charge by day, drain always
        self.stores_kg += p.nectar_kg_per_day * p.colony * activity * dt / _FLIGHT_AREA - 0.3 * dt / DAY
        solar_w = p.panel_w * sun * rng.uniform(0.9, 1.0)
        self.soc = min(1.0, max(0.0, self.soc + (0.85 * solar_w - p.load_w) * dt / HOUR / p.battery_wh))

        r: dict[str, float | None] = {
            "hive_temp_c": p.brood_temp_c + 0.04 * (ambient - 20.0) + rng.gauss(0, 0.12 * k),
            "hive_humidity_pct": 60.0 - 4.0 * math.cos(2 * math.pi * (hour - 15.0) / 24.0) + rng.gauss(0, 1.2 * k),
            "ambient_temp_c": ambient,
            "hive_weight_kg": self.stores_kg - 0.45 * p.colony * activity + rng.gauss(0, 0.01 * k),
            "acoustic_db": 47.0 + 9.0 * activity + 3.0 * p.colony + rng.gauss(0, 0.8 * k),
            "acoustic_freq_hz": 225.0 + 30.0 * activity + rng.gauss(0, 6.0 * k),
            "bee_traffic": max(0.0, round(2600.0 * p.colony * activity
                                          + rng.gauss(0, (8.0 + 0.05 * 2600 * activity) * k))),
            "battery_v": (cell_voltage(self.soc) + (0.06 if solar_w > 0.85 * p.load_w else 0.0)
                          + rng.gauss(0, 0.005 * k)),
            "solar_w": solar_w,
        }
        if anomaly is not None and anomaly.active(t):
            self._apply(anomaly, t, dt, hour, r)
        return _quantise(r)

    def _apply(self, a: Anomaly, t: float, dt: float, hour: float, r: dict[str, float | None]) -> None:
        s, m, rng, p = a.strength(t), a.magnitude, self.rng, self.profile
        if a.kind == "heat_stress":
            ambient = r["ambient_temp_c"]
            r["ambient_temp_c"] = max(ambient, ambient + s * (38.5 + 2.5 * m - ambient))
            r["hive_temp_c"] = r["hive_temp_c"] + s * (3.5 + 2.0 * m)
            r["hive_humidity_pct"] = r["hive_humidity_pct"] - s * 18.0
            r["acoustic_db"] = r["acoustic_db"] + s * 6.0
            r["acoustic_freq_hz"] = r["acoustic_freq_hz"] + s * 45.0
            r["bee_traffic"] = round(r["bee_traffic"] * (1.0 - 0.6 * s))  # bearding, not foraging
            r["solar_w"] = max(r["solar_w"], s * 0.9 * p.panel_w * daylight(hour))  # heat waves are cloudless
        elif a.kind == "swarming":
            frac = (t - a.start) / a.duration_s
            leaving = SWARM_DEPARTURE <= frac < SWARM_DEPARTURE + 10 * 60 / a.duration_s
            if frac >= SWARM_DEPARTURE and not a.applied:
                self.stores_kg -= (1.2 + 1.2 * m) * p.colony  # half the bees and their honey-filled crops
                r["hive_weight_kg"] -= (1.2 + 1.2 * m) * p.colony
                a.applied = True
            pre = s if frac < SWARM_DEPARTURE else 0.6
            r["acoustic_freq_hz"] = r["acoustic_freq_hz"] + pre * (190.0 + 90.0 * m + rng.gauss(0, 10))
            r["acoustic_db"] = r["acoustic_db"] + pre * (9.0 + 4.0 * m)
            r["hive_temp_c"] = r["hive_temp_c"] + 1.2 * s
            if leaving:
                r["bee_traffic"] = round(r["bee_traffic"] + 9000 * p.colony * m)
        elif a.kind == "robbing":
            loss = s * (0.4 + 0.4 * m) * dt / HOUR
            self.stores_kg -= loss
            r["hive_weight_kg"] -= loss
            r["bee_traffic"] = round(r["bee_traffic"] + s * (5500 + 3000 * m) * max(0.3, daylight(hour)))
            r["acoustic_db"] = r["acoustic_db"] + s * 5.0
            r["acoustic_freq_hz"] = r["acoustic_freq_hz"] + s * (55.0 + rng.gauss(0, 8))
            r["hive_temp_c"] = r["hive_temp_c"] + 0.5 * s
        elif a.kind == "sensor_fault":
            if a.mode == "temp_85":
                r["hive_temp_c"] = 85.0
            elif a.mode == "temp_disconnected":
                r["hive_temp_c"] = -127.0
            elif a.mode == "humidity_dead":
                r["hive_humidity_pct"] = None
            else:  # scale_zero: the load cell's amplifier lost power
                r["hive_weight_kg"] = abs(rng.gauss(0, 0.05))
        elif a.kind == "low_battery":
            soc = self.soc * (1.0 - 0.985 * s)
            r["solar_w"] = r["solar_w"] * (1.0 - 0.97 * s)
            r["battery_v"] = cell_voltage(soc) + rng.gauss(0, 0.005)


_DECIMALS = {"hive_temp_c": 2, "hive_humidity_pct": 2, "ambient_temp_c": 2, "hive_weight_kg": 3, "acoustic_db": 2,
             "acoustic_freq_hz": 1, "bee_traffic": 0, "battery_v": 3, "solar_w": 2}
_BOUNDS = {"hive_humidity_pct": (0.0, 100.0), "acoustic_db": (0.0, 140.0), "acoustic_freq_hz": (0.0, 6000.0),
           "bee_traffic": (0.0, 65000.0), "battery_v": (0.0, 6.0), "solar_w": (0.0, 600.0)}


def _quantise(r: Mapping[str, float | None]) -> dict[str, float | None]:
    """Round to the frame's resolution and clamp to what the sensors can physically report."""
    out: dict[str, float | None] = {}
    for name, v in r.items():
        if v is not None:
            lo, hi = _BOUNDS.get(name, (-float("inf"), float("inf")))
            v = round(min(hi, max(lo, v)), _DECIMALS[name])
        out[name] = v
    return out


@dataclass(frozen=True, slots=True)
class SimFrame:
    """One emitted frame and its ground truth (which never travels in the frame)."""

    device_id: int
    site: str
    seq: int
    timestamp: int
    readings: dict[str, float | None]
    label: str
    data: bytes


class Fleet:
    """``sites`` x ``devices_per_site`` hives; device ids run from ``first_device_id``.
    ``climate_c`` and ``noise_scale``: see :class:`SiteWeather` and :class:`VirtualHive` (the
    defaults are the conditions everything is tuned and tested on)."""

    def __init__(self, sites: int = 2, devices_per_site: int = 4, *, seed: int = 0, start: float = DEFAULT_START,
                 interval_s: float = 300.0, first_device_id: int = 1, climate_c: float = 0.0,
                 noise_scale: float = 1.0, boot: int | None = None) -> None:
        """``boot``: the boot counter every frame carries (firmware keeps one in flash; ``apiary simulate run``
        uses its start time, so a bridge that remembers earlier runs sees a reboot, not a replay)."""
        if sites < 1 or devices_per_site < 1:
            raise BridgeError("a fleet needs at least one site and one device per site")
        if not 0 <= first_device_id or first_device_id + sites * devices_per_site - 1 > 0xFFFF:
            raise BridgeError("device ids must fit in u16 (0..65535)")
        if interval_s <= 0:
            raise BridgeError("interval_s must be positive")
        if noise_scale < 0:
            raise BridgeError("noise_scale must be >= 0")
        self.rng = random.Random(seed)
        self.boot = boot
        self.interval_s = interval_s
        self.t = float(start)
        self.hives: list[VirtualHive] = []
        for si in range(sites):
            weather = SiteWeather(seed * 7919 + si, climate_c)
            for di in range(devices_per_site):
                dev = first_device_id + si * devices_per_site + di
                self.hives.append(VirtualHive(dev, f"site-{si}", weather, random.Random(self.rng.random()),
                                              noise_scale=noise_scale))
        self.by_id = {h.device_id: h for h in self.hives}
        self.anomalies: list[Anomaly] = []
        self._truth: dict[int, tuple[list[int], list[int], list[str]]] = {}  # dev -> label runs (start, end, kind)
        self._seen: dict[int, tuple[int, int]] = {}  # dev -> (first seq, last seq) emitted

    def sites(self) -> dict[int, str]:
        """Device id -> site, for the bridge's ``[bridge.sites]``."""
        return {h.device_id: h.site for h in self.hives}

    def describe_sites(self, node_of: Callable[[int], str] = str) -> str:
        """Where each site's hives are, e.g. ``site-0 (hive-0001..hive-0004), site-1 (hive-0005..hive-0008)``."""
        by_site: dict[str, list[int]] = {}
        for h in self.hives:
            by_site.setdefault(h.site, []).append(h.device_id)
        return ", ".join(f"{site} ({node_of(min(ids))}..{node_of(max(ids))})" if len(ids) > 1
                         else f"{site} ({node_of(ids[0])})" for site, ids in by_site.items())

    def inject(self, kind: str, device_id: int, at: float, duration_s: float | None = None, *, mode: str | None = None,
               magnitude: float | None = None) -> Anomaly:
        """Schedule ``kind`` on ``device_id`` starting at sim time ``at``."""
        if kind not in SPECS:
            raise BridgeError(f"unknown anomaly {kind!r}; choose from {', '.join(ANOMALIES)}")
        if device_id not in self.by_id:
            raise BridgeError(f"no device {device_id} in this fleet (ids {min(self.by_id)}..{max(self.by_id)})")
        if mode is not None and kind == "sensor_fault" and mode not in FAULT_MODES:
            raise BridgeError(f"unknown sensor fault {mode!r}; choose from {', '.join(FAULT_MODES)}")
        dur = SPECS[kind].duration_s if duration_s is None else duration_s
        if dur <= 0:
            raise BridgeError("anomaly duration must be positive")
        a = Anomaly(kind, device_id, float(at), float(dur),
                    mode=mode or (self.rng.choice(FAULT_MODES) if kind == "sensor_fault" else ""),
                    magnitude=self.rng.uniform(0.7, 1.3) if magnitude is None else magnitude)
        self.anomalies.append(a)
        return a

    def inject_random(self, count: int, horizon_s: float, *, first_at_s: float | None = None) -> list[Anomaly]:
        """``count`` anomalies on random devices over the next ``horizon_s`` of sim time, each at a
        typical hour for its kind, never overlapping another on the same device.

        ``first_at_s``: the first one starts exactly then (whatever the hour; it may run past the
        horizon) and the others after it, so that a short watch sees an anomaly early."""
        out: list[Anomaly] = []
        earliest = self.t
        if count > 0 and first_at_s is not None and first_at_s < horizon_s:
            earliest = self.t + first_at_s
            kind = self.rng.choice(ANOMALIES)
            free = [h.device_id for h in self.hives if self._free(h.device_id, earliest, SPECS[kind].duration_s)]
            if free:
                out.append(self.inject(kind, self.rng.choice(free), earliest))
        tries = 0
        while len(out) < count and tries < 100 * max(1, count):
            tries += 1
            kind = self.rng.choice(ANOMALIES)
            spec = SPECS[kind]
            dev = self.rng.choice(self.hives).device_id
            day0 = self.t - self.t % DAY
            day = day0 + DAY * self.rng.randrange(0, max(1, int(math.ceil(horizon_s / DAY))))
            at = day + HOUR * self.rng.uniform(*spec.start_hours)
            if not earliest <= at <= self.t + horizon_s - spec.duration_s:
                continue
            if self._free(dev, at, spec.duration_s):
                out.append(self.inject(kind, dev, at))
        return out

    def _free(self, device_id: int, at: float, duration_s: float) -> bool:
        """No anomaly on ``device_id`` within an hour of ``[at, at + duration_s)``."""
        return not any(b.device_id == device_id and at < b.end + HOUR and b.start < at + duration_s + HOUR
                       for b in self.anomalies)

    def _anomaly_at(self, device_id: int, t: float) -> Anomaly | None:
        for a in self.anomalies:
            if a.device_id == device_id and a.active(t):
                return a
        return None

    def tick(self) -> list[SimFrame]:
        """Every hive reports once at the current sim time; then time advances one interval."""
        out = [self._frame(h, self.t) for h in self.hives]
        self.t += self.interval_s
        return out

    def frames(self) -> Iterator[SimFrame]:
        """An endless stream of frames, device by device, tick by tick."""
        while True:
            yield from self.tick()

    def _frame(self, hive: VirtualHive, t: float) -> SimFrame:
        anomaly = self._anomaly_at(hive.device_id, t)
        readings = hive.step(t, anomaly)
        hive.seq = (hive.seq + 1) & 0xFFFFFFFF
        label = anomaly.kind if anomaly is not None else "normal"
        self._record(hive.device_id, hive.seq, label)
        data = encode_frame(hive.device_id, hive.seq, int(t), readings, boot=self.boot)
        return SimFrame(hive.device_id, hive.site, hive.seq, int(t), readings, label, data)

    def _record(self, dev: int, seq: int, label: str) -> None:
        first, _ = self._seen.get(dev, (seq, seq))
        self._seen[dev] = (first, seq)
        if label == "normal":
            return
        starts, ends, kinds = self._truth.setdefault(dev, ([], [], []))
        if kinds and kinds[-1] == label and ends[-1] == (seq - 1) & 0xFFFFFFFF:
            ends[-1] = seq
        else:
            starts.append(seq)
            ends.append(seq)
            kinds.append(label)

    def truth(self, device_id: int, seq: int) -> str | None:
        """Ground-truth label of an emitted frame, ``None`` for one this fleet never emitted.
        Pass as the bridge's ``truth_lookup`` when the simulator drives it in-process."""
        seen = self._seen.get(device_id)
        if seen is None or (seq - seen[0]) % (1 << 32) > (seen[1] - seen[0]) % (1 << 32):
            return None  # outside the (possibly wrapped) range this device emitted
        runs = self._truth.get(device_id)
        if runs:
            starts, ends, kinds = runs
            i = bisect.bisect_right(starts, seq) - 1
            if i >= 0 and seq <= ends[i]:
                return kinds[i]
        return "normal"


# -- emitting frames ------------------------------------------------------------------------------

Sink = Callable[[bytes], None]


@dataclass(slots=True)
class EmitStats:
    frames: int = 0
    bytes: int = 0
    corrupted: int = 0  # frames deliberately damaged (a flipped bit or cut short): the bridge must reject them
    garbage: int = 0  # intact frames sent after a burst of garbage: the bridge must still recover them
    labels: dict[str, int] = field(default_factory=dict)


def emit(frames: Iterable[SimFrame], sink: Sink, *, rate: float, count: int | None = None,
         duration_s: float | None = None, noise: float = 0.0, seed: int = 0,
         on_frame: Callable[[SimFrame], None] | None = None, stop: Callable[[], bool] | None = None) -> EmitStats:
    """Send frames to ``sink`` at ``rate`` frames/s (0 = as fast as possible) until ``count``
    frames or ``duration_s`` seconds. With ``noise`` > 0, that fraction of frames is preceded by
    garbage or damaged (a flipped bit or a cut), to exercise the bridge's resync."""
    if rate < 0 or noise < 0 or noise > 1:
        raise BridgeError("rate must be >= 0 and noise within 0..1")
    rng = random.Random(seed)
    stats = EmitStats()
    t0 = time.perf_counter()
    interval = 1.0 / rate if rate > 0 else 0.0
    for f in frames:
        if (count is not None and stats.frames >= count) or (stop is not None and stop()):
            break
        now = time.perf_counter() - t0
        if duration_s is not None and now >= duration_s:
            break
        if interval:
            due = stats.frames * interval
            if due > now:
                time.sleep(due - now)
        data = f.data
        if noise and rng.random() < noise:
            data, intact = _damage(data, rng)
            stats.garbage += intact
            stats.corrupted += not intact
        sink(data)
        stats.frames += 1
        stats.bytes += len(data)
        stats.labels[f.label] = stats.labels.get(f.label, 0) + 1
        if on_frame is not None:
            on_frame(f)
    return stats


def _damage(data: bytes, rng: random.Random) -> tuple[bytes, bool]:
    """Noise for one frame; returns the bytes to send and whether the frame itself is still intact."""
    how = rng.randrange(3)
    if how == 0:  # boot-loader chatter before an intact frame
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 24))) + data, True
    if how == 1:  # one flipped bit
        i = rng.randrange(len(data))
        return data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:], False
    return data[:rng.randrange(1, len(data))], False  # cut short by a reset


class UdpSink:
    """Each frame as one datagram, as a Wi-Fi/LoRa gateway would forward it."""

    def __init__(self, host: str, port: int) -> None:
        import socket

        self.addr = (host, port)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    def __call__(self, data: bytes) -> None:
        self.sock.sendto(data, self.addr)

    def close(self) -> None:
        self.sock.close()


class FdSink:
    """Bytes to a file descriptor: a pty master, a serial device, a capture file."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __call__(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]


class PtySink(FdSink):
    """A pseudo-terminal standing in for a serial line: frames go into the master side and a
    bridge reads the slave at ``path``. Writes wait while no reader has the slave open (the
    reader's open would flush them anyway), so no frame is written into the void."""

    def __init__(self, stop: Callable[[], bool] | None = None) -> None:
        master, slave = os.openpty()
        tty.setraw(slave)
        self.path = os.ttyname(slave)
        os.close(slave)  # with no slave open the master polls POLLHUP: that is how a reader is noticed
        super().__init__(master)
        self.stop = stop
        self._poll = select.poll()
        self._poll.register(master, select.POLLHUP)

    def reader_present(self) -> bool:
        return not any(ev & select.POLLHUP for _, ev in self._poll.poll(0))

    def wait_for_reader(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.reader_present():
            if (self.stop is not None and self.stop()) or (deadline is not None and time.monotonic() > deadline):
                return False
            time.sleep(0.05)
        time.sleep(0.2)  # let the reader finish configuring (pyserial flushes input on open)
        return True

    def __call__(self, data: bytes) -> None:
        if not self.reader_present() and not self.wait_for_reader():
            raise BridgeError(f"no reader on {self.path}")
        super().__call__(data)

    def close(self, linger_s: float = 30.0) -> None:
        """Wait (up to ``linger_s``) until the reader has taken every byte, then close."""
        try:
            probe = os.open(self.path, os.O_RDWR | os.O_NOCTTY)
        except OSError:
            probe = None
        try:
            deadline = time.monotonic() + linger_s
            empty = 0  # bytes reach the slave's queue asynchronously: trust "empty" only when seen twice
            while probe is not None and self.reader_present() and time.monotonic() < deadline and empty < 2:
                time.sleep(0.05)
                queued = struct.unpack("i", fcntl.ioctl(probe, termios.FIONREAD, b"\0\0\0\0"))[0]
                empty = empty + 1 if queued == 0 else 0
        finally:
            if probe is not None:
                os.close(probe)
            os.close(self.fd)


# -- labelled situations for evaluation -----------------------------------------------------------

@dataclass(frozen=True, slots=True)
class LabelledSituation:
    """One evaluation case: the event to judge, the device's preceding events, and the truth."""

    event: SensorEvent
    context: list[SensorEvent]
    label: str


def labelled_situations(n: int, seed: int = 0, *, context: int = 6, interval_s: float = 300.0,
                        climate_c: float = 0.0, noise_scale: float = 1.0) -> list[LabelledSituation]:
    """``n`` situations, labels balanced over ``ASSESSMENTS`` and shuffled. Each comes from its own
    simulated hive, run for a day to settle, then through encode -> decode -> the bridge's
    frame-to-event mapping with default thresholds. Deterministic for a given ``seed``.

    ``climate_c`` (added to every day's mean temperature) and ``noise_scale`` (multiplies every
    sensor's noise) make situations under conditions other than the defaults everything is tuned
    on, for distribution-shift evaluation (``bench/make_edge_eval.py``'s ``shift`` split); the
    defaults reproduce the earlier situations exactly."""
    if n < 0 or context < 0:
        raise BridgeError("n and context must be >= 0")
    rng = random.Random(seed)
    labels = [ASSESSMENTS[i % len(ASSESSMENTS)] for i in range(n)]
    rng.shuffle(labels)
    return [_situation(label, rng.randrange(1 << 30), context, interval_s, climate_c, noise_scale)
            for label in labels]


def _situation(label: str, seed: int, context: int, interval_s: float, climate_c: float = 0.0,
               noise_scale: float = 1.0) -> LabelledSituation:
    rng = random.Random(seed)
    fleet = Fleet(1, 1, seed=seed, interval_s=interval_s, first_device_id=rng.randrange(1, 10_000),
                  start=DEFAULT_START + DAY * rng.randrange(0, 60), climate_c=climate_c, noise_scale=noise_scale)
    hive = fleet.hives[0]
    if label == "normal":
        event_t = fleet.t + DAY + rng.uniform(0, DAY)
    else:
        spec = SPECS[label]
        at = fleet.t + DAY + HOUR * rng.uniform(*spec.start_hours)
        anomaly = fleet.inject(label, hive.device_id, at)
        lo, hi = spec.evident
        event_t = at + spec.duration_s * rng.uniform(lo, hi) - 1.0
        if label == "swarming" and rng.random() < 0.5:  # half of them caught right as the swarm leaves
            event_t = at + spec.duration_s * SWARM_DEPARTURE + interval_s * rng.randrange(0, 2)
        event_t = min(event_t, anomaly.end - 1.0)
    steps = int((event_t - fleet.t) // interval_s)
    fleet.t = event_t - steps * interval_s  # land exactly on event_t
    frames = [f for _ in range(steps + 1) for f in fleet.tick()]
    node = BridgeSettings().node_of(hive.device_id)
    events: list[SensorEvent] = []
    previous: tuple[float, dict[str, float]] | None = None
    for f in frames[-(context + 2):]:  # one frame before the context, for the trend rule
        decoded = decode_frame(f.data)
        events.append(frame_to_event(decoded, site=f.site, node=node, previous=previous,
                                     thresholds=DEFAULT_THRESHOLDS, truth=f.label))
        previous = (float(decoded.timestamp), decoded.readings)
    events = events[-(context + 1):]
    return LabelledSituation(event=events[-1], context=events[:-1], label=frames[-1].label)
