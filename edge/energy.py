"""The energy budget: how many local tokens per hour a solar device can afford, and what each answer cost.

Power in: the solar panel's ``solar_w`` plus a share of the battery - the charge above
``reserve_soc`` spread over ``horizon_h`` hours (a night without sun). Power out first
pays ``idle_watts`` (sensing, radio); what is left, in joules per hour, divided by the
measured joules per generated token, is the token budget. The battery's state of
charge comes from its resting voltage through a piecewise-linear curve (default: one
Li-ion NMC cell, 3.0 V empty .. 4.2 V full; configurable).

Energy per inference is CPU time x ``cpu_watts`` (the extra draw of a busy core), so
an answer's price is measured, not guessed; the per-token price is a running average.
Below ``low_soc`` the agent runs fewer threads and a shorter answer.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Mapping

from apiary.edge.settings import PowerProfile

EMA = 0.2  # weight of the newest inference in the joules-per-token average
WINDOW_S = 3600.0


def soc_from_voltage(volts: float, curve: list[tuple[float, float]]) -> float:
    """State of charge (0..1) for a resting battery voltage, interpolated on ``curve``; clamped at its ends."""
    if volts <= curve[0][0]:
        return curve[0][1]
    for (v0, s0), (v1, s1) in zip(curve, curve[1:]):
        if volts <= v1:
            return s0 + (s1 - s0) * (volts - v0) / (v1 - v0)
    return curve[-1][1]


class EnergyBudget:
    """Tracks battery, solar and spending; answers "can we afford a local inference now?"."""

    def __init__(self, profile: PowerProfile | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.profile = profile or PowerProfile()
        self.clock = clock
        self.battery_v: float | None = None
        self.battery_soc: float | None = None
        self.solar_w: float | None = None
        self.joules_per_token = self.profile.joules_per_token
        self.energy_j = 0.0  # all local inference so far
        self.answered = 0  # events answered (any tier) - for joules per answered event
        self._spent: deque[tuple[float, int]] = deque()  # (time, tokens) within the last hour

    def observe(self, readings: Mapping[str, float]) -> None:
        """Take battery voltage and solar power from a sensor event's readings (either may be absent)."""
        v = readings.get("battery_v")
        if v is not None and v == v:
            self.battery_v = float(v)
            self.battery_soc = soc_from_voltage(float(v), self.profile.battery_curve)
        w = readings.get("solar_w")
        if w is not None and w == w:
            self.solar_w = max(0.0, float(w))

    @property
    def available_w(self) -> float | None:
        """Watts the device may spend on inference now; None until a battery reading arrived."""
        if self.battery_soc is None:
            return None
        p = self.profile
        battery_w = max(0.0, self.battery_soc - p.reserve_soc) * p.battery_wh / p.horizon_h
        return max(0.0, (self.solar_w or 0.0) + battery_w - p.idle_watts)

    @property
    def tokens_per_hour(self) -> float | None:
        """Local generated tokens per hour the device can afford; None while unknown (budget not enforced)."""
        if not self.profile.enabled:
            return None
        w = self.available_w
        return None if w is None else w * 3600.0 / self.joules_per_token

    def spent_last_hour(self) -> int:
        cutoff = self.clock() - WINDOW_S
        while self._spent and self._spent[0][0] < cutoff:
            self._spent.popleft()
        return sum(n for _, n in self._spent)

    def short(self, expected_tokens: int) -> bool:
        """True when ``expected_tokens`` more would exceed this hour's budget."""
        budget = self.tokens_per_hour
        return budget is not None and self.spent_last_hour() + expected_tokens > budget

    def knobs(self, threads: int, max_tokens: int) -> tuple[int, int]:
        """Threads and max tokens for the next inference: fewer of both when the battery is low."""
        p = self.profile
        if p.enabled and self.battery_soc is not None and self.battery_soc < p.low_soc:
            return min(threads, p.low_threads), min(max_tokens, p.low_max_tokens)
        return threads, max_tokens

    def defers_update(self, min_soc: float) -> str | None:
        """Why an OTA update must wait now (the battery is below ``min_soc``), or None when it may go on.

        A download and a health check draw the radio and the CPU for minutes, which a battery near its
        reserve pays for with the night's sensing. No battery reading yet: not deferred (mains power, or
        a device that does not report one)."""
        if self.battery_soc is None or self.battery_soc >= min_soc:
            return None
        return f"battery at {self.battery_soc:.0%}, below the {min_soc:.0%} an update needs"

    def joules(self, cpu_s: float) -> float:
        return cpu_s * self.profile.cpu_watts

    def record(self, cpu_s: float, tokens: int) -> float:
        """Account one inference (CPU seconds, tokens generated); returns its energy in joules."""
        j = self.joules(cpu_s)
        self.energy_j += j
        if tokens > 0:
            self.joules_per_token = (1 - EMA) * self.joules_per_token + EMA * (j / tokens)
            self._spent.append((self.clock(), tokens))
        return j

    def answered_event(self) -> None:
        self.answered += 1

    @property
    def joules_per_answer(self) -> float | None:
        return self.energy_j / self.answered if self.answered else None
