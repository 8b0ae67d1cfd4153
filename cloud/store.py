"""Durable cloud state: fleet, events, answers, OTA progress, escalation results, operators' labels and rollouts.

Everything a replica needs to answer correctly lives here, never only in one worker's
memory: an escalation answered by one worker is found by any other worker (or the same
one after a restart) when the edge re-sends it. :class:`Store` is the contract;
:class:`SqliteStore` implements it on SQLite in WAL mode (several processes on one
machine share the file). The SQL is plain enough for a PostgreSQL backend to follow.

Every write keyed by an envelope id is idempotent, so several replicas recording the
same broadcast message (or a QoS 1 redelivery) store it once.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from apiary.cloud.errors import CloudError
from apiary.shared.protocol import DeviceState, InferenceResult, OtaStatus, SensorEvent

ClaimState = Literal["claimed", "answered", "busy"]


@dataclass(slots=True)
class Claim:
    """Outcome of trying to take an escalation: compute it, re-send a stored answer, or leave it."""

    state: ClaimState
    result: InferenceResult | None = None  # set when state == "answered"


@dataclass(slots=True)
class Unfinished:
    """A claimed escalation not answered yet, with what its worker needs to take it up again after a restart."""

    key: str
    topic: str | None  # the escalation topic it arrived on (None: claimed by an older version)
    envelope: bytes | None  # the encoded request envelope, as it arrived
    received_at: float


class Store(ABC):
    """What the recorder, the escalation worker and the operator API need from storage."""

    # fleet
    @abstractmethod
    def record_state(self, state: DeviceState, *, received_at: float | None = None) -> bool:
        """Apply a birth/death/update by the Sparkplug rule; False when it does not count.

        A birth always counts and starts the node's session (whatever its number, so a huge
        spoofed session cannot outlive the node's next real birth); a death counts only for the
        current session, an update only while that session is alive. A node not seen yet is
        learnt from whatever arrives first (e.g. a retained update). Model and image versions: a
        birth states them (an absent one is cleared), an update may leave them out, and a death
        never changes them (a Last Will is composed at connect time: an edge may have switched
        models since)."""

    @abstractmethod
    def devices(self, site: str | None = None) -> list[dict[str, Any]]: ...

    # events, answers, OTA progress
    @abstractmethod
    def record_event(self, envelope_id: str, event: SensorEvent, *, received_at: float | None = None) -> bool: ...

    @abstractmethod
    def events(self, site: str, device: str, limit: int = 50) -> list[dict[str, Any]]:
        """Newest first: SensorEvent fields plus envelope_id, received_at and label (None when unlabelled)."""

    @abstractmethod
    def event(self, envelope_id: str) -> dict[str, Any] | None:
        """One stored event (as in :meth:`events`), None when unknown."""

    # operators' labels: the true assessment of a stored event
    @abstractmethod
    def label_event(self, envelope_id: str, assessment: str, *, note: str | None, key_id: str, key_name: str = "",
                    labelled_at: float | None = None) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
        """Record (or overwrite) the label of a stored event: (the label, the one it replaced or None);
        None when no such event is stored."""

    @abstractmethod
    def labelled_events(self, *, since: float | None = None, context: int = 6) -> list[dict[str, Any]]:
        """Every labelled event (labelled at or after ``since``), oldest event first, each as
        ``{"envelope_id", "label", "event", "context"}``: ``context`` is the device's up to ``context``
        stored events before it in sensor time, oldest first (what the edge agent gives its model)."""

    @abstractmethod
    def record_answer(self, envelope_id: str, result: InferenceResult, *, received_at: float | None = None) -> bool: ...

    @abstractmethod
    def answers(self, site: str, device: str, limit: int = 50) -> list[dict[str, Any]]: ...

    @abstractmethod
    def record_ota_status(self, envelope_id: str, status: OtaStatus, *, received_at: float | None = None) -> bool: ...

    @abstractmethod
    def ota_statuses(self, site: str, device: str, limit: int = 50) -> list[dict[str, Any]]: ...

    # escalations
    @abstractmethod
    def claim_escalation(self, key: str, *, request_id: str, site: str, device: str, priority: int, reason: str,
                         worker: str, lease_s: float, now: float | None = None, topic: str | None = None,
                         envelope: bytes | None = None) -> Claim:
        """Take ``key`` for computing, or return its stored answer, or say another worker holds a live claim.

        The claim is durable before anything is computed and keeps ``topic`` and ``envelope``, so the
        worker can resume it after a crash. A worker id is one process at a time (its fixed MQTT client
        id): a pending claim under ``worker``'s own id is a dead predecessor's and is taken back at once."""

    @abstractmethod
    def renew_escalations(self, worker: str, *, now: float | None = None) -> int:
        """Extend the lease of every pending claim of ``worker`` (it is still computing them); how many."""

    @abstractmethod
    def unfinished_escalations(self, worker: str) -> list[Unfinished]:
        """``worker``'s pending claims, oldest first: what a restarted worker resumes."""

    @abstractmethod
    def finish_escalation(self, key: str, result: InferenceResult, *, finished_at: float | None = None) -> None: ...

    @abstractmethod
    def release_escalation(self, key: str) -> None:
        """End an unfinished claim's lease (e.g. shutdown mid-request): any worker may take it over now, and
        the same worker resumes it when it starts again."""

    @abstractmethod
    def escalations(self, limit: int = 50, *, site: str | None = None, outcome: str | None = None) -> list[dict[str, Any]]: ...

    # fleet rollouts (driven by cloud.rollouts.RolloutDriver)
    @abstractmethod
    def create_rollout(self, rollout: dict[str, Any], devices: list[tuple[str, str, int]]) -> None:
        """Store a new rollout (the columns of ``rollouts``) and its devices as (site, device, wave)."""

    @abstractmethod
    def rollout(self, rollout_id: str) -> dict[str, Any] | None:
        """One rollout's row, None when unknown."""

    @abstractmethod
    def rollouts(self, limit: int = 50, *, state: str | None = None) -> list[dict[str, Any]]:
        """Rollouts, newest first."""

    @abstractmethod
    def rollout_devices(self, rollout_id: str) -> list[dict[str, Any]]:
        """The rollout's devices in wave order, each with the newest OTA status of the rollout's image version
        received since its command was sent (``ota_phase``, ``ota_detail``, ``ota_progress``, ``ota_at``; None
        before the first)."""

    @abstractmethod
    def busy_devices(self, devices: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
        """Which of ``devices`` belong to a running rollout, and to which."""

    @abstractmethod
    def claim_rollout(self, rollout_id: str, owner: str, lease_s: float, *, now: float | None = None) -> bool:
        """Take (or renew) the right to drive a running rollout: free, held by ``owner`` (a restart of the same
        process), or its holder's lease ran out. False when another owner holds it or it is no longer running."""

    @abstractmethod
    def release_rollouts(self, owner: str) -> None:
        """End ``owner``'s leases (a clean stop): any driver may take its rollouts over at once."""

    @abstractmethod
    def update_rollout(self, rollout_id: str, **fields: Any) -> None:
        """Set the given columns of a rollout (state, reason, wave, wave_started_at, finished_at)."""

    @abstractmethod
    def update_rollout_device(self, rollout_id: str, site: str, device: str, **fields: Any) -> None:
        """Set the given columns of one device of a rollout (sent_at, outcome, outcome_at)."""

    @abstractmethod
    def close(self) -> None: ...


_SCHEMA = """
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
# Every statement is IF NOT EXISTS and runs at each open, so a database made by an older
# version gains the newer tables and indexes (labels) without losing anything; newer columns
# of existing tables are added by _COLUMNS.
_COLUMNS = {"escalations": {"topic": "TEXT", "envelope": "BLOB"}}


def _counts(state: DeviceState, session: int, status: str) -> bool:
    """Sparkplug: a birth resets the session; a death or update must be of the current one, an update alive."""
    if state.status == "birth":
        return True
    return state.session == session and (state.status == "death" or status != "death")


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), default=str)


class SqliteStore(Store):
    """SQLite in WAL mode; one connection guarded by a lock (writes are tiny, reads are indexed)."""

    def __init__(self, path: str | Path = ":memory:") -> None:
        self.path = str(path)
        if self.path != ":memory:":
            try:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise CloudError(f"cannot create the database directory for {self.path}: {e}") from None
        try:
            self._db = sqlite3.connect(self.path, timeout=10.0, check_same_thread=False, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            if self.path != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA busy_timeout=10000")
            self._db.executescript(_SCHEMA)
            self._add_columns()
        except sqlite3.DatabaseError as e:
            raise CloudError(f"cannot open database {self.path}: {e}") from None
        self._lock = threading.Lock()

    def _add_columns(self) -> None:
        for table, columns in _COLUMNS.items():
            have = {r["name"] for r in self._db.execute(f"PRAGMA table_info({table})")}
            for name, kind in columns.items():
                if name not in have:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")

    @property
    def journal_mode(self) -> str:
        return self._query("PRAGMA journal_mode")[0][0]

    def _query(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _write(self, sql: str, args: tuple = ()) -> int:
        with self._lock:
            return self._db.execute(sql, args).rowcount

    # ---- fleet -----------------------------------------------------------------------------
    def record_state(self, state: DeviceState, *, received_at: float | None = None) -> bool:
        now = received_at or time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT session, status FROM devices WHERE site=? AND device=?",
                                       (state.site, state.device)).fetchone()
                if row is not None and not _counts(state, row["session"], row["status"]):
                    self._db.execute("COMMIT")
                    return False
                online = bool(state.online) and state.status != "death"
                self._db.execute(
                    """INSERT INTO devices (site, device, role, online, status, session, battery_soc, battery_v,
                           solar_w, model_version, image_version, budget_tokens_per_hour, counters, first_seen,
                           last_seen, last_birth, last_death)
                       VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)
                       ON CONFLICT (site, device) DO UPDATE SET
                           role=excluded.role, online=excluded.online, status=excluded.status,
                           session=excluded.session,
                           battery_soc=COALESCE(excluded.battery_soc, devices.battery_soc),
                           battery_v=COALESCE(excluded.battery_v, devices.battery_v),
                           solar_w=COALESCE(excluded.solar_w, devices.solar_w),
                           model_version=CASE excluded.status WHEN 'birth' THEN excluded.model_version
                               WHEN 'death' THEN devices.model_version
                               ELSE COALESCE(excluded.model_version, devices.model_version) END,
                           image_version=CASE excluded.status WHEN 'birth' THEN excluded.image_version
                               WHEN 'death' THEN devices.image_version
                               ELSE COALESCE(excluded.image_version, devices.image_version) END,
                           budget_tokens_per_hour=COALESCE(excluded.budget_tokens_per_hour,
                                                           devices.budget_tokens_per_hour),
                           counters=CASE WHEN excluded.counters = '{}' THEN devices.counters
                                         ELSE excluded.counters END,
                           last_seen=excluded.last_seen,
                           last_birth=COALESCE(excluded.last_birth, devices.last_birth),
                           last_death=COALESCE(excluded.last_death, devices.last_death)""",
                    (state.site, state.device, state.role, int(online), state.status, state.session,
                     state.battery_soc, state.battery_v, state.solar_w, state.model_version, state.image_version,
                     state.budget_tokens_per_hour, _json(state.counters), now, now,
                     now if state.status == "birth" else None, now if state.status == "death" else None))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return True

    def devices(self, site: str | None = None) -> list[dict[str, Any]]:
        sql = "SELECT * FROM devices" + (" WHERE site=?" if site else "") + " ORDER BY site, device"
        rows = self._query(sql, (site,) if site else ())
        out = []
        for r in rows:
            d = dict(r)
            d["online"] = bool(d["online"])
            d["counters"] = json.loads(d["counters"])
            last_ota = self._query("SELECT image_version, phase, detail, progress, received_at FROM ota_status "
                                   "WHERE site=? AND device=? ORDER BY received_at DESC, rowid DESC LIMIT 1",
                                   (d["site"], d["device"]))
            d["last_ota"] = dict(last_ota[0]) if last_ota else None
            out.append(d)
        return out

    # ---- events, answers, OTA progress -----------------------------------------------------
    def record_event(self, envelope_id: str, event: SensorEvent, *, received_at: float | None = None) -> bool:
        return self._write(
            "INSERT OR IGNORE INTO events VALUES (?,?,?,?,?,?,?,?,?)",
            (envelope_id, event.site, event.device, event.seq, event.timestamp, str(event.severity), event.kind, received_at or time.time(),
             _json(event.model_dump(mode="json")))) == 1

    _EVENT_WITH_LABEL = ("SELECT e.envelope_id, e.received_at, e.body, l.assessment, l.note, l.key_id, l.key_name, "
                         "l.labelled_at FROM events e LEFT JOIN labels l ON l.envelope_id = e.envelope_id")

    @staticmethod
    def _label(r: sqlite3.Row) -> dict[str, Any] | None:
        if r["assessment"] is None:
            return None
        return {"assessment": r["assessment"], "note": r["note"], "key_id": r["key_id"], "key_name": r["key_name"],
                "labelled_at": r["labelled_at"]}

    def _event_row(self, r: sqlite3.Row) -> dict[str, Any]:
        return {"envelope_id": r["envelope_id"], "received_at": r["received_at"], **json.loads(r["body"]),
                "label": self._label(r)}

    def events(self, site: str, device: str, limit: int = 50) -> list[dict[str, Any]]:
        rows = self._query(self._EVENT_WITH_LABEL + " WHERE e.site=? AND e.device=? "
                           "ORDER BY e.received_at DESC, e.rowid DESC LIMIT ?", (site, device, limit))
        return [self._event_row(r) for r in rows]

    def event(self, envelope_id: str) -> dict[str, Any] | None:
        rows = self._query(self._EVENT_WITH_LABEL + " WHERE e.envelope_id=?", (envelope_id,))
        return self._event_row(rows[0]) if rows else None

    # ---- labels ----------------------------------------------------------------------------
    def label_event(self, envelope_id: str, assessment: str, *, note: str | None, key_id: str, key_name: str = "",
                    labelled_at: float | None = None) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
        label = {"assessment": assessment, "note": note, "key_id": key_id, "key_name": key_name,
                 "labelled_at": labelled_at or time.time()}
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if self._db.execute("SELECT 1 FROM events WHERE envelope_id=?", (envelope_id,)).fetchone() is None:
                    self._db.execute("COMMIT")
                    return None
                old = self._db.execute("SELECT assessment, note, key_id, key_name, labelled_at FROM labels "
                                       "WHERE envelope_id=?", (envelope_id,)).fetchone()
                self._db.execute(
                    "INSERT INTO labels (envelope_id, assessment, note, key_id, key_name, labelled_at) "
                    "VALUES (?,?,?,?,?,?) ON CONFLICT (envelope_id) DO UPDATE SET assessment=excluded.assessment, "
                    "note=excluded.note, key_id=excluded.key_id, key_name=excluded.key_name, "
                    "labelled_at=excluded.labelled_at",
                    (envelope_id, assessment, note, key_id, key_name, label["labelled_at"]))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return label, dict(old) if old is not None else None

    def labelled_events(self, *, since: float | None = None, context: int = 6) -> list[dict[str, Any]]:
        rows = self._query(self._EVENT_WITH_LABEL.replace("LEFT JOIN", "JOIN")
                           + (" WHERE l.labelled_at >= ?" if since is not None else "")
                           + " ORDER BY e.timestamp, e.site, e.device, e.seq, e.envelope_id",
                           (since,) if since is not None else ())
        out = []
        for r in rows:
            event = json.loads(r["body"])
            earlier = self._query(
                "SELECT body FROM events WHERE site=? AND device=? AND timestamp < ? "
                "ORDER BY timestamp DESC, seq DESC LIMIT ?",
                (event["site"], event["device"], event["timestamp"], context)) if context > 0 else []
            out.append({"envelope_id": r["envelope_id"], "label": self._label(r), "event": event,
                        "context": [json.loads(c["body"]) for c in reversed(earlier)]})
        return out

    def record_answer(self, envelope_id: str, result: InferenceResult, *, received_at: float | None = None) -> bool:
        return self._write(
            "INSERT OR IGNORE INTO answers VALUES (?,?,?,?,?,?,?,?,?,?)",
            (envelope_id, result.site, result.device, result.request_id, result.tier, result.status, result.event_seq,
             result.latency_ms, received_at or time.time(), _json(result.model_dump(mode="json")))) == 1

    def answers(self, site: str, device: str, limit: int = 50) -> list[dict[str, Any]]:
        rows = self._query("SELECT envelope_id, received_at, body FROM answers WHERE site=? AND device=? "
                           "ORDER BY received_at DESC, rowid DESC LIMIT ?", (site, device, limit))
        return [{"envelope_id": r["envelope_id"], "received_at": r["received_at"], **json.loads(r["body"])}
                for r in rows]

    def record_ota_status(self, envelope_id: str, status: OtaStatus, *, received_at: float | None = None) -> bool:
        return self._write(
            "INSERT OR IGNORE INTO ota_status VALUES (?,?,?,?,?,?,?,?)",
            (envelope_id, status.site, status.device, status.image_version, status.phase, status.detail,
             status.progress, received_at or time.time())) == 1

    def ota_statuses(self, site: str, device: str, limit: int = 50) -> list[dict[str, Any]]:
        rows = self._query("SELECT * FROM ota_status WHERE site=? AND device=? "
                           "ORDER BY received_at DESC, rowid DESC LIMIT ?", (site, device, limit))
        return [dict(r) for r in rows]

    # ---- escalations -----------------------------------------------------------------------
    def claim_escalation(self, key: str, *, request_id: str, site: str, device: str, priority: int, reason: str,
                         worker: str, lease_s: float, now: float | None = None, topic: str | None = None,
                         envelope: bytes | None = None) -> Claim:
        now = now or time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                # A re-sent request may come in a new envelope: match on the envelope id or the request id.
                row = self._db.execute(
                    "SELECT * FROM escalations WHERE key=? OR (site=? AND device=? AND request_id=?) "
                    "ORDER BY (state='done') DESC LIMIT 1", (key, site, device, request_id)).fetchone()
                if row is not None and row["state"] == "done":
                    self._db.execute("COMMIT")
                    return Claim("answered", InferenceResult.model_validate_json(row["result"]))
                if row is not None and row["worker"] != worker and now - row["claimed_at"] < lease_s:
                    self._db.execute("COMMIT")
                    return Claim("busy")
                if row is not None:  # the claimer died or gave up (or is this worker's dead predecessor): take over
                    self._db.execute("UPDATE escalations SET worker=?, claimed_at=?, topic=coalesce(topic, ?), "
                                     "envelope=coalesce(envelope, ?) WHERE key=?",
                                     (worker, now, topic, envelope, row["key"]))
                else:
                    self._db.execute(
                        "INSERT INTO escalations (key, request_id, site, device, priority, reason, worker, state, "
                        "received_at, claimed_at, topic, envelope) VALUES (?,?,?,?,?,?,?,'pending',?,?,?,?)",
                        (key, request_id, site, device, priority, reason, worker, now, now, topic, envelope))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return Claim("claimed")

    def finish_escalation(self, key: str, result: InferenceResult, *, finished_at: float | None = None) -> None:
        now = finished_at or time.time()
        self._write(
            "UPDATE escalations SET state='done', outcome=?, finished_at=?, latency_ms=?, prompt_tokens=?, "
            "completion_tokens=?, result=? WHERE key=? OR (site=? AND device=? AND request_id=? AND state='pending')",
            (result.status, now, result.latency_ms, result.prompt_tokens, result.completion_tokens,
             result.model_dump_json(), key, result.site, result.device, result.request_id))

    def renew_escalations(self, worker: str, *, now: float | None = None) -> int:
        return self._write("UPDATE escalations SET claimed_at=? WHERE worker=? AND state='pending'",
                           (now or time.time(), worker))

    def unfinished_escalations(self, worker: str) -> list[Unfinished]:
        rows = self._query("SELECT key, topic, envelope, received_at FROM escalations "
                           "WHERE worker=? AND state='pending' ORDER BY received_at, key", (worker,))
        return [Unfinished(r["key"], r["topic"], r["envelope"], r["received_at"]) for r in rows]

    def release_escalation(self, key: str) -> None:
        self._write("UPDATE escalations SET claimed_at=0 WHERE key=? AND state='pending'", (key,))

    def escalations(self, limit: int = 50, *, site: str | None = None, outcome: str | None = None) -> list[dict[str, Any]]:
        where, args = [], []
        if site:
            where.append("site=?")
            args.append(site)
        if outcome:
            where.append("outcome=?")
            args.append(outcome)
        sql = ("SELECT key, request_id, site, device, priority, reason, worker, state, outcome, received_at, "
               "finished_at, latency_ms, prompt_tokens, completion_tokens, result FROM escalations"
               + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY received_at DESC LIMIT ?")
        rows = self._query(sql, (*args, limit))
        out = []
        for r in rows:
            d = dict(r)
            result = json.loads(d.pop("result")) if d["result"] else None
            d["text"] = result.get("text", "") if result else None
            d["action"] = result.get("action") if result else None
            d["error"] = result.get("error") if result else None
            out.append(d)
        return out

    # ---- fleet rollouts --------------------------------------------------------------------
    _ROLLOUT_FIELDS = {"state", "reason", "wave", "wave_started_at", "finished_at"}
    _ROLLOUT_DEVICE_FIELDS = {"sent_at", "outcome", "outcome_at"}

    def create_rollout(self, rollout: dict[str, Any], devices: list[tuple[str, str, int]]) -> None:
        row = {**rollout, "target": _json(rollout["target"])}
        names = ", ".join(row)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(f"INSERT INTO rollouts ({names}) VALUES ({', '.join('?' * len(row))})",
                                 tuple(row.values()))
                self._db.executemany(
                    "INSERT INTO rollout_devices (rollout_id, site, device, wave, position) VALUES (?,?,?,?,?)",
                    [(rollout["id"], site, device, wave, i) for i, (site, device, wave) in enumerate(devices)])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    @staticmethod
    def _rollout_row(r: sqlite3.Row) -> dict[str, Any]:
        d = dict(r)
        d["target"] = json.loads(d["target"])
        return d

    def rollout(self, rollout_id: str) -> dict[str, Any] | None:
        rows = self._query("SELECT * FROM rollouts WHERE id=?", (rollout_id,))
        return self._rollout_row(rows[0]) if rows else None

    def rollouts(self, limit: int = 50, *, state: str | None = None) -> list[dict[str, Any]]:
        rows = self._query("SELECT * FROM rollouts" + (" WHERE state=?" if state else "")
                           + " ORDER BY created_at DESC, rowid DESC LIMIT ?", (state, limit) if state else (limit,))
        return [self._rollout_row(r) for r in rows]

    def rollout_devices(self, rollout_id: str) -> list[dict[str, Any]]:
        rows = self._query(
            """SELECT d.site, d.device, d.wave, d.sent_at, d.outcome, d.outcome_at,
                      s.phase AS ota_phase, s.detail AS ota_detail, s.progress AS ota_progress,
                      s.received_at AS ota_at
               FROM rollout_devices d JOIN rollouts r ON r.id = d.rollout_id
               LEFT JOIN ota_status s ON s.rowid = (
                   SELECT rowid FROM ota_status o WHERE o.site = d.site AND o.device = d.device
                       AND o.image_version = r.image_version AND d.sent_at IS NOT NULL AND o.received_at >= d.sent_at
                   ORDER BY o.received_at DESC, o.rowid DESC LIMIT 1)
               WHERE d.rollout_id=? ORDER BY d.wave, d.position""", (rollout_id,))
        return [dict(r) for r in rows]

    def busy_devices(self, devices: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
        busy: dict[tuple[str, str], str] = {}
        for site, device in devices:
            rows = self._query("SELECT d.rollout_id FROM rollout_devices d JOIN rollouts r ON r.id = d.rollout_id "
                               "WHERE d.site=? AND d.device=? AND r.state='running' LIMIT 1", (site, device))
            if rows:
                busy[(site, device)] = rows[0][0]
        return busy

    def claim_rollout(self, rollout_id: str, owner: str, lease_s: float, *, now: float | None = None) -> bool:
        now = now or time.time()
        return self._write("UPDATE rollouts SET driver=?, driver_until=? WHERE id=? AND state='running' "
                           "AND (driver IS NULL OR driver=? OR driver_until < ?)",
                           (owner, now + lease_s, rollout_id, owner, now)) == 1

    def release_rollouts(self, owner: str) -> None:
        self._write("UPDATE rollouts SET driver_until=0 WHERE driver=?", (owner,))

    def _set(self, table: str, allowed: set[str], fields: dict[str, Any], where: str, args: tuple) -> None:
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(f"not a settable column of {table}: {sorted(unknown)}")
        if fields:
            self._write(f"UPDATE {table} SET {', '.join(f'{k}=?' for k in fields)} WHERE {where}",
                        (*fields.values(), *args))

    def update_rollout(self, rollout_id: str, **fields: Any) -> None:
        self._set("rollouts", self._ROLLOUT_FIELDS, fields, "id=?", (rollout_id,))

    def update_rollout_device(self, rollout_id: str, site: str, device: str, **fields: Any) -> None:
        self._set("rollout_devices", self._ROLLOUT_DEVICE_FIELDS, fields, "rollout_id=? AND site=? AND device=?",
                  (rollout_id, site, device))

    def close(self) -> None:
        with self._lock:
            self._db.close()
