"""Battery state of charge, the token budget, and per-answer energy accounting."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from apiary.edge.energy import EnergyBudget, soc_from_voltage
from apiary.edge.settings import DEFAULT_BATTERY_CURVE, PowerProfile

CURVE = DEFAULT_BATTERY_CURVE


@pytest.mark.parametrize("volts, soc", [(2.5, 0.0), (3.0, 0.0), (3.65, 0.275), (3.8, 0.55), (4.2, 1.0), (4.4, 1.0)])
def test_soc_curve(volts: float, soc: float) -> None:
    assert soc_from_voltage(volts, CURVE) == pytest.approx(soc)


def test_soc_is_monotone() -> None:
    socs = [soc_from_voltage(2.9 + i * 0.01, CURVE) for i in range(140)]
    assert socs == sorted(socs)


def test_bad_curve_is_refused() -> None:
    with pytest.raises(ValidationError):
        PowerProfile(battery_curve=[(3.0, 0.0)])
    with pytest.raises(ValidationError):
        PowerProfile(battery_curve=[(3.0, 0.5), (4.0, 0.2)])


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def budget(**profile) -> tuple[EnergyBudget, Clock]:
    clock = Clock()
    return EnergyBudget(PowerProfile(**profile), clock=clock), clock


def test_unknown_until_battery_reading() -> None:
    b, _ = budget()
    assert b.tokens_per_hour is None and not b.short(10_000)
    b.observe({"solar_w": 3.0})
    assert b.tokens_per_hour is None


def test_tokens_per_hour_from_solar_and_battery() -> None:
    b, _ = budget(battery_wh=40, reserve_soc=0.2, horizon_h=10, idle_watts=0.5, joules_per_token=0.05)
    b.observe({"battery_v": 3.8, "solar_w": 2.0})  # soc 0.55
    battery_w = (0.55 - 0.2) * 40 / 10
    assert b.available_w == pytest.approx(2.0 + battery_w - 0.5)
    assert b.tokens_per_hour == pytest.approx((2.0 + battery_w - 0.5) * 3600 / 0.05)


def test_flat_battery_at_night_affords_nothing() -> None:
    b, _ = budget(reserve_soc=0.25)
    b.observe({"battery_v": 3.55, "solar_w": 0.0})  # soc 0.16 < reserve
    assert b.tokens_per_hour == 0.0 and b.short(1)


def test_spending_is_tracked_over_a_sliding_hour() -> None:
    b, clock = budget(battery_wh=10, reserve_soc=0.5, horizon_h=10, idle_watts=0.0, joules_per_token=1.0, cpu_watts=1.0)
    b.observe({"battery_v": 3.9, "solar_w": 0.0})  # (0.7 - 0.5) * 10 Wh / 10 h = 0.2 W = 720 J/h = 720 tokens/h
    assert b.tokens_per_hour == pytest.approx(720)
    b.record(cpu_s=600.0, tokens=600)  # exactly 1 J/token: the price does not move
    assert b.spent_last_hour() == 600
    assert not b.short(100) and b.short(121)
    clock.t += 3601
    assert b.spent_last_hour() == 0 and not b.short(700)


def test_price_per_token_is_measured() -> None:
    b, _ = budget(cpu_watts=2.0, joules_per_token=0.05)
    j = b.record(cpu_s=1.5, tokens=60)  # 3 J / 60 tokens = 0.05... then something pricier
    assert j == pytest.approx(3.0)
    b.record(cpu_s=6.0, tokens=60)  # 0.2 J/token
    assert 0.05 < b.joules_per_token < 0.2
    assert b.energy_j == pytest.approx(15.0)
    assert b.joules_per_answer is None
    b.answered_event()
    b.answered_event()
    assert b.joules_per_answer == pytest.approx(7.5)


def test_low_battery_lowers_threads_and_tokens() -> None:
    b, _ = budget(low_soc=0.4, low_threads=1, low_max_tokens=64)
    b.observe({"battery_v": 4.0})
    assert b.knobs(4, 96) == (4, 96)
    b.observe({"battery_v": 3.65})
    assert b.knobs(4, 96) == (1, 64)


def test_disabled_profile_never_limits() -> None:
    b, _ = budget(enabled=False)
    b.observe({"battery_v": 3.1, "solar_w": 0.0})
    assert b.tokens_per_hour is None and not b.short(10**9) and b.knobs(2, 96) == (2, 96)


def test_nan_readings_are_ignored() -> None:
    b, _ = budget()
    b.observe({"battery_v": float("nan"), "solar_w": float("nan")})
    assert b.battery_soc is None and b.solar_w is None


def test_an_update_waits_for_the_battery_not_for_a_missing_reading() -> None:
    b, _ = budget()
    assert b.defers_update(0.4) is None  # no battery reading: mains power or no gauge, never deferred
    b.observe({"battery_v": 3.5})  # soc 0.12
    assert b.defers_update(0.4) == "battery at 12%, below the 40% an update needs"
    b.observe({"battery_v": 3.8})  # soc 0.55
    assert b.defers_update(0.4) is None and b.defers_update(0.6) is not None
