"""Severity and flags from thresholds; the [bridge] configuration section."""
from __future__ import annotations

import pytest

from apiary.firmware_bridge.settings import BridgeSettings, load_settings
from apiary.firmware_bridge.thresholds import Limits, Thresholds, assess
from apiary.shared.config import ConfigError
from apiary.shared.protocol import Severity

NORMAL = {"hive_temp_c": 34.6, "hive_humidity_pct": 58.0, "ambient_temp_c": 21.0, "hive_weight_kg": 41.2,
          "acoustic_db": 55.0, "acoustic_freq_hz": 245.0, "bee_traffic": 1800.0, "battery_v": 3.95, "solar_w": 4.0}


def test_normal_readings_are_info_without_flags():
    assert assess(NORMAL) == (Severity.INFO, [])


@pytest.mark.parametrize("changes,severity,flags", [
    ({"hive_temp_c": 37.5}, Severity.WARNING, ["hive_temp_c_high"]),
    ({"hive_temp_c": 39.5, "ambient_temp_c": 41.0}, Severity.CRITICAL, ["hive_temp_c_high", "ambient_temp_c_high"]),
    ({"hive_temp_c": 85.0}, Severity.WARNING, ["hive_temp_c_implausible"]),  # DS18B20 power-on value, not a fire
    ({"hive_temp_c": -127.0}, Severity.WARNING, ["hive_temp_c_implausible"]),
    ({"battery_v": 3.45}, Severity.WARNING, ["battery_v_low"]),
    ({"battery_v": 3.2}, Severity.CRITICAL, ["battery_v_low"]),
    ({"acoustic_freq_hz": 450.0}, Severity.WARNING, ["acoustic_freq_hz_high"]),
    ({"bee_traffic": 9000.0}, Severity.WARNING, ["bee_traffic_high"]),
])
def test_limits(changes, severity, flags):
    assert assess({**NORMAL, **changes}) == (severity, flags)


def test_missing_sensor_is_flagged():
    readings = {k: v for k, v in NORMAL.items() if k != "hive_humidity_pct"}
    assert assess(readings, missing=("hive_humidity_pct",)) == (Severity.WARNING, ["hive_humidity_pct_missing"])


def test_weight_drop_needs_a_recent_previous_reading():
    prev = (1000.0, {**NORMAL, "hive_weight_kg": 43.5})
    assert assess(NORMAL, previous=prev, timestamp=1300.0) == (Severity.CRITICAL, ["hive_weight_drop"])
    assert assess({**NORMAL, "hive_weight_kg": 42.4}, previous=prev, timestamp=1300.0) == (
        Severity.WARNING, ["hive_weight_drop"])
    assert assess(NORMAL, previous=prev, timestamp=1000.0 + 7200) == (Severity.INFO, [])  # too far apart
    assert assess(NORMAL, previous=prev, timestamp=900.0) == (Severity.INFO, [])  # older than the previous
    broken_scale = (1000.0, {**NORMAL, "hive_weight_kg": 0.02})
    assert assess({**NORMAL, "hive_weight_kg": 0.0}, previous=broken_scale, timestamp=1300.0)[1] == [
        "hive_weight_kg_implausible"]


def test_critical_limit_alone_still_fires():
    t = Thresholds(limits={"solar_w": {"crit_high": 50}})
    assert assess({"solar_w": 60.0}, thresholds=t) == (Severity.CRITICAL, ["solar_w_high"])


def test_config_limits_merge_over_defaults_field_by_field():
    t = Thresholds(limits={"hive_temp_c": {"warn_high": 36.0}})
    assert t.limits["hive_temp_c"] == Limits(valid_min=-30, valid_max=70, warn_low=30, crit_low=20, warn_high=36,
                                             crit_high=39)
    assert t.limits["battery_v"].crit_low == 3.35
    assert assess({"hive_temp_c": 36.2}, thresholds=t) == (Severity.WARNING, ["hive_temp_c_high"])


def test_settings_from_toml_and_environment(tmp_path):
    path = tmp_path / "apiary.toml"
    path.write_text("""
[bridge]
name = "bridge-north"
default_site = "north-field"
[bridge.sites]
7 = "orchard"
[bridge.thresholds]
weight_drop_crit_kg = 2.0
[bridge.thresholds.limits.hive_temp_c]
warn_high = 37.5
""")
    s = load_settings(path, environ={"APIARY__BRIDGE__BUFFER_SIZE": "500"})
    assert (s.name, s.default_site, s.buffer_size) == ("bridge-north", "north-field", 500)
    assert s.site_of(7) == "orchard" and s.site_of(8) == "north-field"
    assert s.node_of(7) == "hive-0007" and s.node_of(65535) == "hive-65535"
    assert s.thresholds.weight_drop_crit_kg == 2.0 and s.thresholds.limits["hive_temp_c"].warn_high == 37.5
    assert s.thresholds.limits["hive_temp_c"].crit_high == 39


@pytest.mark.parametrize("toml,match", [
    ('[bridge]\nbuffer_size = 0', "buffer_size"),
    ('[bridge]\nname = "has space"', "name"),
    ('[bridge.sites]\n7 = "a/b"', "sites"),
    ('[bridge.thresholds.limits.nectar]\nwarn_high = 1', "unknown reading"),
    ('[bridge]\ncolour = "blue"', "colour"),
])
def test_bad_settings_are_one_clear_error(tmp_path, toml, match):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=match):
        load_settings(path, environ={})


def test_default_settings():
    s = BridgeSettings()
    assert s.site_of(1) == "site-0" and s.name == "bridge-0"


def test_watch_levels_flag_elevated_readings_without_raising_severity() -> None:
    from apiary.firmware_bridge.thresholds import assess

    severity, flags = assess({"bee_traffic": 4500.0, "acoustic_freq_hz": 270.0, "acoustic_db": 50.0})
    assert severity.value == "info" and sorted(flags) == ["acoustic_freq_hz_elevated", "bee_traffic_elevated"]
    severity, flags = assess({"bee_traffic": 7000.0})
    assert severity.value == "warning" and flags == ["bee_traffic_high"]  # the warning replaces the watch flag
    assert assess({"bee_traffic": 1200.0}) == (severity.__class__("info"), [])
