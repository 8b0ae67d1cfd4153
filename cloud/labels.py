"""Operators' labels as training data: ``apiary fleet export-labels``.

An operator labels a stored event with its true assessment (``POST
/v1/fleet/events/{id}/label``); the export writes one JSON line per labelled event in the
row format of the benchmark's labelled eval set (``bench/make_edge_eval.py``):
``{"id", "label", "event", "context"}`` with SensorEvent dicts, ``context`` being the
device's up to six events before it in sensor time, oldest first (the context the edge
agent keeps per device), plus the label's provenance (``note``, ``labelled_by``,
``labelled_at``). The file is written to a temporary name and renamed, so a reader never
sees half an export.
"""
from __future__ import annotations

import json
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from apiary.cloud.errors import CloudError
from apiary.cloud.store import Store

CONTEXT_EVENTS = 6  # the edge agent's default context (edge settings' context_events) and the eval set's


def parse_since(text: str) -> float:
    """Unix seconds, or an ISO 8601 date / date-time (UTC unless it names an offset)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise CloudError(f"--since {text!r} is neither unix seconds nor an ISO 8601 date/time") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


def label_rows(store: Store, *, since: float | None = None, context: int = CONTEXT_EVENTS) -> list[dict]:
    """The rows of an export, oldest event first."""
    rows = []
    for item in store.labelled_events(since=since, context=context):
        label = item["label"]
        rows.append({"id": item["envelope_id"], "label": label["assessment"], "event": item["event"],
                     "context": item["context"], "note": label["note"],
                     "labelled_by": label["key_name"] or label["key_id"], "labelled_at": label["labelled_at"]})
    return rows


def export_labels(store: Store, out: str | Path, *, since: float | None = None,
                  context: int = CONTEXT_EVENTS) -> int:
    """Write the labelled events to ``out`` (JSON lines, atomically); returns how many."""
    out = Path(out)
    rows = label_rows(store, since=since, context=context)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    except OSError as e:
        raise CloudError(f"cannot write {out}: {e}") from None
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the training data from a training job's user
        with os.fdopen(fd, "w") as f:
            for row in rows:
                f.write(json.dumps(row, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise CloudError(f"cannot write {out}: {e}") from None
        raise
    return len(rows)
