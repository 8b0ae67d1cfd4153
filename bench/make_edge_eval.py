"""Writes the edge evaluation set: labelled sensor situations from the simulator, in three splits.

Run ``python -m apiary.bench.make_edge_eval`` to regenerate ``bench/data/edge_eval_{calibration,test,shift}.jsonl``.
Each line is one situation: the event to judge (with the simulator's ground truth in
``event.truth`` and ``label``), and the device's preceding events as context, exactly as the
bridge publishes them (severity, ``_high``/``_low``/``_implausible``/``_missing`` flags and the
watch-level ``_elevated`` flags). The splits come from different seeds (different simulated
hives), so thresholds chosen on calibration are scored on hives they never saw:

* ``calibration`` (60, seed 101) and ``test`` (120, seed 202): the simulator's default
  conditions, the ones everything is tuned on;
* ``shift`` (120, seed 505): a distribution shift — a hot climate (every day's mean temperature
  +8 °C, so afternoons often pass the 35 °C ambient warning during any anomaly or none) and
  noisier sensors (every reading's noise x3, so a quiet hive's hum now and then crosses its
  260 Hz watch level), through ``labelled_situations``' ``climate_c`` and ``noise_scale``.

Seeds are disjoint from ``apiary finetune``'s (303 train, 404 validation) and the distillation's.
Deterministic: the same seeds give byte-identical files.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True, slots=True)
class Split:
    n: int
    seed: int
    conditions: dict[str, float] = field(default_factory=dict)  # keywords of labelled_situations


SPLITS: dict[str, Split] = {
    "calibration": Split(60, 101),
    "test": Split(120, 202),
    "shift": Split(120, 505, {"climate_c": 8.0, "noise_scale": 3.0}),
}


def path_of(split: str) -> Path:
    return DATA_DIR / f"edge_eval_{split}.jsonl"


def build(n: int, seed: int, **conditions: float) -> list[dict[str, Any]]:
    from apiary.firmware_bridge.simulator import labelled_situations

    rows = []
    for i, s in enumerate(labelled_situations(n, seed, **conditions)):
        rows.append({"id": f"s{seed}-{i:03d}", "label": s.label, "event": s.event.model_dump(mode="json"),
                     "context": [c.model_dump(mode="json") for c in s.context]})
    return rows


def load(split: str) -> list[dict[str, Any]]:
    """The rows of one split, as written by :func:`main`."""
    with open(path_of(split)) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    for name, split in SPLITS.items():
        rows = build(split.n, split.seed, **split.conditions)
        with open(path_of(name), "w") as f:
            for row in rows:
                f.write(json.dumps(row, sort_keys=True) + "\n")
        print(f"wrote {len(rows)} situations to {path_of(name)}")


if __name__ == "__main__":
    main()
