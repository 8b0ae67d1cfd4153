"""The SQLite schema as the code before Alembic made it (ran at every open, no version recorded).

Frozen: revision 0001 creates exactly this on SQLite, and :func:`apiary.cloud.db.migrate.adopt`
replays it on a pre-Alembic file before comparing its tables with revision 0001 and stamping it.
Never edit it; schema changes are new revisions.
"""
from __future__ import annotations

SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS devices (
    site TEXT NOT NULL, device TEXT NOT NULL, role TEXT NOT NULL, online INTEGER NOT NULL,
    status TEXT NOT NULL, session INTEGER NOT NULL, battery_soc REAL, battery_v REAL, solar_w REAL,
    model_version TEXT, image_version TEXT, budget_tokens_per_hour REAL, counters TEXT NOT NULL DEFAULT '{}',
    first_seen REAL NOT NULL, last_seen REAL NOT NULL, last_birth REAL, last_death REAL,
    PRIMARY KEY (site, device)
);
CREATE TABLE IF NOT EXISTS events (
    envelope_id TEXT PRIMARY KEY, site TEXT NOT NULL, device TEXT NOT NULL, seq INTEGER NOT NULL,
    timestamp REAL NOT NULL, severity TEXT NOT NULL, kind TEXT NOT NULL, received_at REAL NOT NULL, body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_device ON events (site, device, received_at);
CREATE TABLE IF NOT EXISTS answers (
    envelope_id TEXT PRIMARY KEY, site TEXT NOT NULL, device TEXT NOT NULL, request_id TEXT NOT NULL,
    tier TEXT NOT NULL, status TEXT NOT NULL, event_seq INTEGER, latency_ms REAL NOT NULL,
    received_at REAL NOT NULL, body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS answers_by_device ON answers (site, device, received_at);
CREATE TABLE IF NOT EXISTS ota_status (
    envelope_id TEXT PRIMARY KEY, site TEXT NOT NULL, device TEXT NOT NULL, image_version TEXT NOT NULL,
    phase TEXT NOT NULL, detail TEXT NOT NULL, progress REAL, received_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS ota_by_device ON ota_status (site, device, received_at);
CREATE TABLE IF NOT EXISTS escalations (
    key TEXT PRIMARY KEY, request_id TEXT NOT NULL, site TEXT NOT NULL, device TEXT NOT NULL,
    priority INTEGER NOT NULL, reason TEXT NOT NULL, worker TEXT NOT NULL,
    state TEXT NOT NULL,               -- 'pending' while a worker computes, 'done' once answered
    outcome TEXT,                      -- the result's status: ok | expired | error | rejected | deferred
    received_at REAL NOT NULL, claimed_at REAL NOT NULL, finished_at REAL, latency_ms REAL,
    prompt_tokens INTEGER, completion_tokens INTEGER, result TEXT,
    topic TEXT, envelope BLOB          -- the request as it arrived, for resuming a claim after a restart
);
CREATE INDEX IF NOT EXISTS escalations_by_request ON escalations (site, device, request_id);
CREATE INDEX IF NOT EXISTS escalations_by_time ON escalations (received_at);
CREATE INDEX IF NOT EXISTS escalations_pending ON escalations (worker) WHERE state = 'pending';
CREATE INDEX IF NOT EXISTS events_by_sensor_time ON events (site, device, timestamp);
CREATE TABLE IF NOT EXISTS labels (
    envelope_id TEXT PRIMARY KEY,      -- the labelled event's
    assessment TEXT NOT NULL, note TEXT,
    key_id TEXT NOT NULL, key_name TEXT NOT NULL,   -- the operator API key that labelled it
    labelled_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS labels_by_time ON labels (labelled_at);
CREATE TABLE IF NOT EXISTS rollouts (
    id TEXT PRIMARY KEY, filename TEXT NOT NULL, image_version TEXT NOT NULL, sha256 TEXT NOT NULL,
    signature TEXT NOT NULL, size INTEGER NOT NULL, url TEXT NOT NULL,
    target TEXT NOT NULL,              -- JSON: {"site": s} | {"devices": [...]} | {"all": true}
    canary REAL NOT NULL, wave_size INTEGER, max_failed_pct REAL NOT NULL, wave_timeout_s REAL NOT NULL,
    waves INTEGER NOT NULL,
    state TEXT NOT NULL,               -- running | completed | aborted
    reason TEXT NOT NULL DEFAULT '',
    wave INTEGER NOT NULL DEFAULT 0,   -- the wave in progress (0: the canary wave)
    wave_started_at REAL, created_at REAL NOT NULL, finished_at REAL, created_by TEXT NOT NULL DEFAULT '',
    driver TEXT, driver_until REAL     -- the cloud process driving it, and until when its lease holds
);
CREATE INDEX IF NOT EXISTS rollouts_by_time ON rollouts (created_at);
CREATE TABLE IF NOT EXISTS rollout_devices (
    rollout_id TEXT NOT NULL, site TEXT NOT NULL, device TEXT NOT NULL, wave INTEGER NOT NULL,
    position INTEGER NOT NULL,
    sent_at REAL,                      -- when its OTA command was published (acknowledged by the broker)
    outcome TEXT,                      -- committed | failed | timed_out | skipped; null while undecided
    outcome_at REAL,
    PRIMARY KEY (rollout_id, site, device)
);
CREATE INDEX IF NOT EXISTS rollout_devices_by_node ON rollout_devices (site, device);
"""
# Every statement is IF NOT EXISTS and the pre-Alembic code ran them at each open, so a database it made
# gained the newer tables and indexes (labels) as it went; newer columns of existing tables came from
# SQLITE_COLUMNS. Adoption (migrate.adopt) replays both before comparing and stamping.
SQLITE_COLUMNS = {"escalations": {"topic": "TEXT", "envelope": "BLOB"}}


def sqlite_statements() -> list[str]:
    """SQLITE_SCHEMA one statement at a time (Alembic's op.execute runs one per call): split at the ``;`` that
    ends a line, as every statement there does (a comment inside one holds a ``;``)."""
    return [s.strip() for s in SQLITE_SCHEMA.split(";\n") if s.strip()]
