"""The store's tables as SQLAlchemy Core objects: what :class:`apiary.cloud.store.SqlStore` queries.

The DDL that creates them lives in the Alembic revisions (``migrations/versions``), frozen per
revision; this module must describe the schema at the newest revision (a test compares the two).

``rowid`` breaks ties in "newest first" listings (rows recorded in the same instant). On SQLite
it is every table's implicit rowid, never declared (the pre-Alembic schema had none and a
declared ``rowid`` would shadow it); on PostgreSQL it is a real identity column. Inserts never
give it, so both backends number rows in insertion order.
"""
from __future__ import annotations

from sqlalchemy import BigInteger, Column, Double, Identity, Integer, LargeBinary, MetaData, Table, Text

metadata = MetaData()


def _rowid() -> Column:
    return Column("rowid", BigInteger, Identity(), nullable=False)


devices = Table(
    "devices", metadata,
    Column("site", Text, primary_key=True), Column("device", Text, primary_key=True),
    Column("role", Text, nullable=False), Column("online", Integer, nullable=False),
    Column("status", Text, nullable=False), Column("session", BigInteger, nullable=False),
    Column("battery_soc", Double), Column("battery_v", Double), Column("solar_w", Double),
    Column("model_version", Text), Column("image_version", Text), Column("budget_tokens_per_hour", Double),
    Column("counters", Text, nullable=False, server_default="{}"),
    Column("first_seen", Double, nullable=False), Column("last_seen", Double, nullable=False),
    Column("last_birth", Double), Column("last_death", Double),
)

events = Table(
    "events", metadata,
    Column("envelope_id", Text, primary_key=True), Column("site", Text, nullable=False),
    Column("device", Text, nullable=False), Column("seq", BigInteger, nullable=False),
    Column("timestamp", Double, nullable=False), Column("severity", Text, nullable=False),
    Column("kind", Text, nullable=False), Column("received_at", Double, nullable=False),
    Column("body", Text, nullable=False), _rowid(),
)

answers = Table(
    "answers", metadata,
    Column("envelope_id", Text, primary_key=True), Column("site", Text, nullable=False),
    Column("device", Text, nullable=False), Column("request_id", Text, nullable=False),
    Column("tier", Text, nullable=False), Column("status", Text, nullable=False), Column("event_seq", BigInteger),
    Column("latency_ms", Double, nullable=False), Column("received_at", Double, nullable=False),
    Column("body", Text, nullable=False), _rowid(),
)

ota_status = Table(
    "ota_status", metadata,
    Column("envelope_id", Text, primary_key=True), Column("site", Text, nullable=False),
    Column("device", Text, nullable=False), Column("image_version", Text, nullable=False),
    Column("phase", Text, nullable=False), Column("detail", Text, nullable=False), Column("progress", Double),
    Column("received_at", Double, nullable=False), _rowid(),
)

escalations = Table(
    "escalations", metadata,
    Column("key", Text, primary_key=True), Column("request_id", Text, nullable=False),
    Column("site", Text, nullable=False), Column("device", Text, nullable=False),
    Column("priority", Integer, nullable=False), Column("reason", Text, nullable=False),
    Column("worker", Text, nullable=False),
    Column("state", Text, nullable=False),  # 'pending' while a worker computes, 'done' once answered
    Column("outcome", Text),  # the result's status: ok | expired | error | rejected | deferred
    Column("received_at", Double, nullable=False), Column("claimed_at", Double, nullable=False),
    Column("finished_at", Double), Column("latency_ms", Double), Column("prompt_tokens", Integer),
    Column("completion_tokens", Integer), Column("result", Text),
    Column("topic", Text), Column("envelope", LargeBinary),  # the request as it arrived, to resume a claim
)

labels = Table(
    "labels", metadata,
    Column("envelope_id", Text, primary_key=True),  # the labelled event's
    Column("assessment", Text, nullable=False), Column("note", Text),
    Column("key_id", Text, nullable=False), Column("key_name", Text, nullable=False),  # the labelling API key
    Column("labelled_at", Double, nullable=False),
)

rollouts = Table(
    "rollouts", metadata,
    Column("id", Text, primary_key=True), Column("filename", Text, nullable=False),
    Column("image_version", Text, nullable=False), Column("sha256", Text, nullable=False),
    Column("signature", Text, nullable=False), Column("size", BigInteger, nullable=False),
    Column("url", Text, nullable=False),
    Column("target", Text, nullable=False),  # JSON: {"site": s} | {"devices": [...]} | {"all": true}
    Column("canary", Double, nullable=False), Column("wave_size", Integer),
    Column("max_failed_pct", Double, nullable=False), Column("wave_timeout_s", Double, nullable=False),
    Column("waves", Integer, nullable=False),
    Column("state", Text, nullable=False),  # running | completed | aborted
    Column("reason", Text, nullable=False, server_default=""),
    Column("wave", Integer, nullable=False, server_default="0"),  # the wave in progress (0: the canary wave)
    Column("wave_started_at", Double), Column("created_at", Double, nullable=False), Column("finished_at", Double),
    Column("created_by", Text, nullable=False, server_default=""),
    Column("driver", Text), Column("driver_until", Double),  # the process driving it, until its lease ends
    _rowid(),
)

rollout_devices = Table(
    "rollout_devices", metadata,
    Column("rollout_id", Text, primary_key=True), Column("site", Text, primary_key=True),
    Column("device", Text, primary_key=True), Column("wave", Integer, nullable=False),
    Column("position", Integer, nullable=False),
    Column("sent_at", Double),  # when its OTA command was published (acknowledged by the broker)
    Column("outcome", Text),  # committed | failed | timed_out | skipped; null while undecided
    Column("outcome_at", Double),
)

TABLES = ("devices", "events", "answers", "ota_status", "escalations", "labels", "rollouts", "rollout_devices")
