"""Writes the edge evaluation set: labelled sensor situations from the simulator, calibration and test splits.

Run ``python -m bench.make_edge_eval`` to regenerate ``bench/data/edge_eval_{calibration,test}.jsonl``.
Each line is one situation: the event to judge (with the simulator's ground truth in
``event.truth`` and ``label``), and the device's preceding events as context. The two
splits come from different seeds (different simulated hives), so thresholds chosen on
calibration are scored on hives they never saw. Deterministic: the same seeds give
byte-identical files.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data"
SPLITS: dict[str, tuple[int, int]] = {"calibration": (60, 101), "test": (120, 202)}  # name: (n, seed)


def path_of(split: str) -> Path:
    return DATA_DIR / f"edge_eval_{split}.jsonl"


def build(n: int, seed: int) -> list[dict[str, Any]]:
    from firmware_bridge.simulator import labelled_situations

    rows = []
    for i, s in enumerate(labelled_situations(n, seed)):
        rows.append({"id": f"s{seed}-{i:03d}", "label": s.label, "event": s.event.model_dump(mode="json"),
                     "context": [c.model_dump(mode="json") for c in s.context]})
    return rows


def load(split: str) -> list[dict[str, Any]]:
    """The rows of one split, as written by :func:`main`."""
    with open(path_of(split)) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    for split, (n, seed) in SPLITS.items():
        rows = build(n, seed)
        with open(path_of(split), "w") as f:
            for row in rows:
                f.write(json.dumps(row, sort_keys=True) + "\n")
        print(f"wrote {len(rows)} situations to {path_of(split)}")


if __name__ == "__main__":
    main()
