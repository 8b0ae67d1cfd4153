"""Operators' labels: POST /v1/fleet/events/{id}/label on the live service, `apiary fleet export-labels`."""
from __future__ import annotations

import json
import sqlite3

import httpx
import pytest
from typer.testing import CliRunner

from apiary.cli import app
from apiary.cloud.store import SqliteStore, open_store
from apiary.shared.protocol import ASSESSMENTS, SensorEvent


def reading(device: str, seq: int, **kw) -> SensorEvent:
    return SensorEvent(site="meadow", device=device, seq=seq, timestamp=1000.0 + 60 * seq,
                       readings={"hive_temp_c": 34.0 + seq, "hum_hz": 240.0}, **kw)


def export(*args: str):
    return CliRunner().invoke(app, ["fleet", "export-labels", *args])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_label_relabel_and_export_as_training_rows(make_service, keys, tmp_path):
    service = make_service()
    operator = keys.create(["operator"], name="anna")
    inference = keys.create(["inference"])
    # hive-1's events arrive out of sensor order (a store-and-forward replay): context follows sensor time
    for seq in (3, 0, 1, 2, 8, 4, 5, 6, 7, 9):
        assert service.store.record_event(f"h1-{seq}", reading("hive-1", seq, flags=["hive_temp_high"] if seq == 8
                                                               else []))
    for seq in range(2):
        assert service.store.record_event(f"h2-{seq}", reading("hive-2", seq, severity="warning"))

    http = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {operator}"}, timeout=30)
    try:
        r = http.post("/v1/fleet/events/h1-8/label", json={"assessment": "swarming", "note": "queen cells seen"})
        assert r.status_code == 200, r.text
        first = r.json()
        assert first["envelope_id"] == "h1-8" and first["replaced"] is None
        assert first["label"]["assessment"] == "swarming" and first["label"]["note"] == "queen cells seen"
        assert first["label"]["key_name"] == "anna" and operator.startswith(f"apk_{first['label']['key_id']}_")
        assert http.post("/v1/fleet/events/h2-1/label", json={"assessment": "normal"}).status_code == 200
        # re-labelling overwrites and says what it replaced
        r = http.post("/v1/fleet/events/h1-8/label", json={"assessment": "heat_stress"})
        assert r.status_code == 200, r.text
        assert r.json()["label"]["assessment"] == "heat_stress" and r.json()["label"]["note"] is None
        assert r.json()["replaced"]["assessment"] == "swarming" and r.json()["replaced"]["note"] == "queen cells seen"

        shown = http.get("/v1/fleet/events/h1-8").json()
        assert shown["seq"] == 8 and shown["flags"] == ["hive_temp_high"] and shown["envelope_id"] == "h1-8"
        assert shown["label"]["assessment"] == "heat_stress" and shown["label"]["key_name"] == "anna"
        assert http.get("/v1/fleet/events/h1-7").json()["label"] is None
        listed = {e["envelope_id"]: e["label"] for e in http.get("/v1/fleet/devices/meadow/hive-1/events").json()}
        assert listed["h1-8"]["assessment"] == "heat_stress" and listed["h1-9"] is None

        # errors: unknown event 404, bad body 422 (FastAPI's, as on every fleet route), scopes 401/403
        assert http.post("/v1/fleet/events/nope/label", json={"assessment": "normal"}).status_code == 404
        assert http.get("/v1/fleet/events/nope").status_code == 404
        for bad in ({"assessment": "on_fire"}, {}, {"assessment": "normal", "note": "x" * 501},
                    {"assessment": "normal", "who": "me"}, {"assessment": 3}):
            assert http.post("/v1/fleet/events/h1-1/label", json=bad).status_code == 422, bad
        assert http.get("/v1/fleet/events/h1-1").json()["label"] is None  # nothing stored by the refusals
        r = httpx.post(f"{service.url}/v1/fleet/events/h1-1/label", json={"assessment": "normal"},
                       headers={"Authorization": f"Bearer {inference}"})
        assert r.status_code == 403 and "operator" in r.json()["error"]["message"]
        assert httpx.post(f"{service.url}/v1/fleet/events/h1-1/label", json={"assessment": "normal"}).status_code == 401
        assert http.get("/v1/fleet/events/h1-1").json()["label"] is None
        assert {"/v1/fleet/events/{event_id}", "/v1/fleet/events/{event_id}/label"} <= set(
            http.get("/openapi.json").json()["paths"])
    finally:
        http.close()

    # the export, while the service still runs on the same database (WAL)
    out = tmp_path / "train" / "labels.jsonl"
    out.parent.mkdir()
    out.write_text("stale\n")
    result = export("--db", service.settings.db, "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "wrote 2 labelled events" in result.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["h2-1", "h1-8"]  # oldest event first
    for row in rows:
        assert {"id", "label", "event", "context"} <= set(row) and row["label"] in ASSESSMENTS
        event = SensorEvent.model_validate(row["event"])
        context = [SensorEvent.model_validate(c) for c in row["context"]]
        assert all(c.device == event.device and c.timestamp < event.timestamp for c in context)
        assert [c.timestamp for c in context] == sorted(c.timestamp for c in context)
    h2, h1 = rows
    assert h1["label"] == "heat_stress" and h1["event"]["seq"] == 8 and h1["labelled_by"] == "anna"
    assert [c["seq"] for c in h1["context"]] == [2, 3, 4, 5, 6, 7]  # six before it in sensor time, not arrival
    assert h2["label"] == "normal" and [c["seq"] for c in h2["context"]] == [0] and h2["note"] is None
    assert sorted(p.name for p in out.parent.iterdir()) == ["labels.jsonl"]  # renamed into place, no temp left

    assert export("--db", service.settings.db, "--out", str(out), "--context", "2").exit_code == 0
    assert [c["seq"] for c in json.loads(out.read_text().splitlines()[1])["context"]] == [6, 7]
    later = export("--db", service.settings.db, "--out", str(out), "--since", "2999-01-01")
    assert later.exit_code == 0 and "wrote 0" in later.stdout and out.read_text() == ""


def test_export_since_and_errors(tmp_path, store_url):
    """On SQLite and on PostgreSQL: --db takes a path or a database URL."""
    db = store_url
    store = open_store(db)
    for seq in range(3):
        store.record_event(f"e-{seq}", reading("hive-1", seq))
    store.label_event("e-1", "robbing", note=None, key_id="k1", labelled_at=1_700_000_000.0)
    store.label_event("e-2", "normal", note="fine", key_id="k2", key_name="ben", labelled_at=1_800_000_000.0)
    assert store.label_event("missing", "normal", note=None, key_id="k1") is None
    store.close()

    out = tmp_path / "l.jsonl"
    for since in ("1750000000", "2025-06-15", "2025-06-15T00:00:00+00:00"):  # between the two labels
        result = export("--db", str(db), "--out", str(out), "--since", since)
        assert result.exit_code == 0, result.output
        (row,) = [json.loads(line) for line in out.read_text().splitlines()]
        assert row["id"] == "e-2" and row["labelled_by"] == "ben" and row["note"] == "fine"
    assert export("--db", str(db), "--out", str(out)).stdout.startswith("wrote 2 ")

    bad = export("--db", str(db), "--out", str(out), "--since", "last tuesday")
    assert bad.exit_code == 2 and "--since" in bad.output
    missing = export("--db", str(tmp_path / "nope.db"), "--out", str(out))
    assert missing.exit_code == 2 and "no database" in missing.output
    assert not (tmp_path / "nope.db").exists()  # not created by looking for it


def test_a_database_from_before_labels_gains_the_table(tmp_path):
    db = tmp_path / "old.db"
    store = SqliteStore(db)
    store.record_event("e-0", reading("hive-1", 0))
    store.close()
    with sqlite3.connect(db) as old:  # what an older version left behind: no labels table, no schema version
        old.execute("DROP TABLE labels")
        old.execute("DROP TABLE alembic_version")
    store = SqliteStore(db)
    try:
        assert store.event("e-0")["label"] is None and store.event("e-0")["seq"] == 0
        label, replaced = store.label_event("e-0", "sensor_fault", note="probe fell", key_id="k")
        assert replaced is None and store.event("e-0")["label"]["assessment"] == "sensor_fault"
    finally:
        store.close()
