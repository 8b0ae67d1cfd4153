"""Event factories and small helpers shared by the edge tests."""
from __future__ import annotations

from shared.protocol import SensorEvent, Severity

SITE, DEVICE = "north", "hive-01"

NORMAL = dict(hive_temp_c=34.8, hive_humidity_pct=58.0, ambient_temp_c=21.0, hive_weight_kg=41.2, acoustic_db=55.0,
              acoustic_freq_hz=240.0, bee_traffic=1800.0, battery_v=3.95, solar_w=4.0)


def reading(seq: int, *, severity: Severity = Severity.INFO, flags: tuple[str, ...] = (), ts: float | None = None,
            site: str = SITE, device: str = DEVICE, **changes: float) -> SensorEvent:
    return SensorEvent(site=site, device=device, seq=seq, timestamp=ts if ts is not None else 1_700_000_000.0 + 60 * seq,
                       readings={**NORMAL, **changes}, severity=severity, flags=list(flags))


def question(seq: int, text: str = "Should I add a super this week?", *, want_cloud: bool = False,
             site: str = SITE, device: str = DEVICE) -> SensorEvent:
    return SensorEvent(site=site, device=device, seq=seq, timestamp=1_700_000_000.0 + 60 * seq, readings={},
                       kind="question", question=text, want_cloud=want_cloud)


# Situations with an unambiguous expected assessment (as the bridge's thresholds would flag them).
SITUATIONS: dict[str, SensorEvent] = {
    "heat_stress": reading(1, severity=Severity.CRITICAL, flags=("hive_temp_c_high", "ambient_temp_c_high"),
                           hive_temp_c=40.5, ambient_temp_c=38.0),
    "swarming": reading(2, severity=Severity.CRITICAL, flags=("hive_weight_drop", "acoustic_freq_hz_high"),
                        hive_weight_kg=38.9, acoustic_freq_hz=450.0, acoustic_db=76.0),
    "robbing": reading(3, severity=Severity.WARNING, flags=("bee_traffic_high",), bee_traffic=9000.0),
    "sensor_fault": reading(4, severity=Severity.WARNING, flags=("hive_humidity_pct_implausible",),
                            hive_humidity_pct=0.0),
    "low_battery": reading(5, severity=Severity.CRITICAL, flags=("battery_v_low",), battery_v=3.3, solar_w=0.0),
}
