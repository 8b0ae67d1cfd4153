"""Durable cloud state: fleet, events, answers, OTA progress, escalation results, operators' labels and rollouts.

Everything a replica needs to answer correctly lives here, never only in one worker's
memory: an escalation answered by one worker is found by any other worker (or the same
one after a restart) when the edge re-sends it. :class:`Store` is the contract;
:class:`SqlStore` implements it for both backends, chosen by the ``[cloud] db`` URL:
SQLite (a plain path or ``sqlite:///…``: the embedded default, WAL mode, several processes
on one machine share the file) or PostgreSQL (``postgresql://…``: replicas on many machines).

Why one implementation on SQLAlchemy Core rather than a psycopg 3 copy beside the sqlite3
one: every query exists once, so the backends cannot drift apart (the same test suite runs
on both), and the few real differences are isolated in a handful of places: the dialect's
``insert`` for upserts (``ON CONFLICT``, the same shape on both), ``FOR UPDATE SKIP LOCKED``
where replicas prune at once (SQLite has no row locks and ignores it), transaction-scoped
advisory locks that serialize read-then-write steps per request or device on PostgreSQL
(SQLite's ``BEGIN IMMEDIATE`` already takes its single write lock), and the tie-breaking
``rowid`` (implicit on SQLite, an identity column on PostgreSQL; :mod:`apiary.cloud.db.schema`).
Core, not the ORM: the store is a few dozen hand-written statements returning plain dicts.
The schema is versioned by Alembic (:mod:`apiary.cloud.db.migrate`), checked at every open.

Every write keyed by an envelope id is idempotent, so several replicas recording the
same broadcast message (or a QoS 1 redelivery) store it once.
"""
from __future__ import annotations

import json
import threading
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

from sqlalchemy import (Column, Connection, Engine, Select, Table, and_, case, delete, exists, func, insert, or_,
                        select, text, tuple_, update)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import StaticPool

from apiary.cloud.db import migrate, schema
from apiary.cloud.db.engine import READ_ONLY, make_engine, redact
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

    # retention
    @abstractmethod
    def prune(self, before: float, *, batch: int = 1000) -> dict[str, int]:
        """Delete what was recorded before ``before`` (unix seconds), ``batch`` rows per transaction: events
        (never a labelled one: labels are training data), answers, OTA statuses, and finished escalations
        (never a pending claim). How many rows of each table went."""

    @abstractmethod
    def close(self) -> None: ...


def _counts(state: DeviceState, session: int, status: str) -> bool:
    """Sparkplug: a birth resets the session; a death or update must be of the current one, an update alive."""
    if state.status == "birth":
        return True
    return state.session == session and (state.status == "death" or status != "death")


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), default=str)


def _public(table: Table) -> list[Column]:
    """A table's columns without the tie-breaking ``rowid`` (not part of any answer)."""
    return [c for c in table.c if c.name != "rowid"]


def _label(r: Any) -> dict[str, Any] | None:
    if r.assessment is None:
        return None
    return {"assessment": r.assessment, "note": r.note, "key_id": r.key_id, "key_name": r.key_name,
            "labelled_at": r.labelled_at}


def _event_row(r: Any) -> dict[str, Any]:
    return {"envelope_id": r.envelope_id, "received_at": r.received_at, **json.loads(r.body), "label": _label(r)}


def _rollout_row(r: Any) -> dict[str, Any]:
    d = dict(r._mapping)
    d["target"] = json.loads(d["target"])
    return d


class SqlStore(Store):
    """The store on SQLAlchemy Core: SQLite (a path or ``sqlite:///…``) or PostgreSQL (``postgresql://…``).

    At open the schema is checked (:func:`apiary.cloud.db.migrate.check`): a newer one is refused, an
    older SQLite one upgraded, an older PostgreSQL one refused with the command that upgrades it.
    """

    def __init__(self, db: str | Path = ":memory:") -> None:
        self.db = str(db)
        self.engine: Engine = make_engine(db)
        self.dialect = self.engine.dialect.name
        self._reader = self.engine.execution_options(**{READ_ONLY: True})
        # one statement needs no BEGIN/COMMIT around it (it is atomic alone): two round trips fewer per recorded
        # message on PostgreSQL
        self._single = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        # one in-memory SQLite connection is shared by every thread: its transactions must not interleave
        self._serial = threading.RLock() if isinstance(self.engine.pool, StaticPool) else None
        self._insert = pg_insert if self.dialect == "postgresql" else sqlite_insert
        try:
            migrate.check(self.engine)
        except SQLAlchemyError as e:
            self.engine.dispose()
            raise CloudError(f"cannot open database {redact(str(self.engine.url))}: "
                             f"{getattr(e, 'orig', None) or e}") from None
        except CloudError:
            self.engine.dispose()
            raise

    @contextmanager
    def _tx(self, *, write: bool = True) -> Iterator[Connection]:
        """One transaction: committed when the block ends, rolled back when it raises."""
        with self._serial or nullcontext():
            with (self.engine if write else self._reader).begin() as conn:
                yield conn

    def _query(self, stmt: Any) -> list[Any]:
        """Rows of a read (a statement, or plain SQL text as tests peek with)."""
        with self._tx(write=False) as c:
            return list(c.execute(text(stmt) if isinstance(stmt, str) else stmt))

    @contextmanager
    def _statement(self) -> Iterator[Connection]:
        """A connection for one statement on its own (autocommit)."""
        with self._serial or nullcontext():
            with self._single.connect() as conn:
                yield conn

    def _write(self, stmt: Any) -> int:
        """One writing statement; how many rows it touched."""
        with self._statement() as c:
            return c.execute(stmt).rowcount

    def _serialize(self, conn: Connection, *parts: str) -> None:
        """PostgreSQL: hold a transaction-scoped lock on ``parts`` (e.g. one request), so read-then-write
        steps on the same thing take turns across replicas, also when its row does not exist yet. SQLite's
        BEGIN IMMEDIATE already takes the one write lock."""
        if self.dialect == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:k, 0))"), {"k": "\x1f".join(parts)})

    # ---- fleet -----------------------------------------------------------------------------
    def record_state(self, state: DeviceState, *, received_at: float | None = None) -> bool:
        now = received_at or time.time()
        d = schema.devices
        with self._tx() as c:
            self._serialize(c, "device", state.site, state.device)
            row = c.execute(select(d.c.session, d.c.status).where(d.c.site == state.site,
                                                                  d.c.device == state.device)).first()
            if row is not None and not _counts(state, row.session, row.status):
                return False
            online = bool(state.online) and state.status != "death"
            ins = self._insert(d).values(
                site=state.site, device=state.device, role=state.role, online=int(online), status=state.status,
                session=state.session, battery_soc=state.battery_soc, battery_v=state.battery_v,
                solar_w=state.solar_w, model_version=state.model_version, image_version=state.image_version,
                budget_tokens_per_hour=state.budget_tokens_per_hour, counters=_json(state.counters),
                first_seen=now, last_seen=now, last_birth=now if state.status == "birth" else None,
                last_death=now if state.status == "death" else None)
            x = ins.excluded

            def versioned(column: str) -> Any:  # a birth states it, a death never changes it, an update may
                return case((x.status == "birth", x[column]), (x.status == "death", d.c[column]),
                            else_=func.coalesce(x[column], d.c[column]))

            keep = {name: func.coalesce(x[name], d.c[name])
                    for name in ("battery_soc", "battery_v", "solar_w", "budget_tokens_per_hour", "last_birth",
                                 "last_death")}
            c.execute(ins.on_conflict_do_update(index_elements=[d.c.site, d.c.device], set_={
                "role": x.role, "online": x.online, "status": x.status, "session": x.session, **keep,
                "model_version": versioned("model_version"), "image_version": versioned("image_version"),
                "counters": case((x.counters == "{}", d.c.counters), else_=x.counters),
                "last_seen": x.last_seen}))
        return True

    def devices(self, site: str | None = None) -> list[dict[str, Any]]:
        """One statement for the whole fleet: each device with its newest OTA status, joined in."""
        d, o, s = schema.devices, schema.ota_status.alias("o"), schema.ota_status.alias("s")
        newest = (select(o.c.rowid).where(o.c.site == d.c.site, o.c.device == d.c.device)
                  .order_by(o.c.received_at.desc(), o.c.rowid.desc()).limit(1).scalar_subquery())
        ota = [s.c.image_version, s.c.phase, s.c.detail, s.c.progress, s.c.received_at]
        stmt = (select(d, *[col.label(f"ota_{col.name}") for col in ota])
                .select_from(d.outerjoin(s, s.c.rowid == newest)).order_by(d.c.site, d.c.device))
        if site:
            stmt = stmt.where(d.c.site == site)
        out = []
        for r in self._query(stmt):
            m = r._mapping
            row = {c.name: m[c.name] for c in d.c}
            row["online"] = bool(row["online"])
            row["counters"] = json.loads(row["counters"])
            row["last_ota"] = ({col.name: m[f"ota_{col.name}"] for col in ota}
                               if m["ota_received_at"] is not None else None)
            out.append(row)
        return out

    # ---- events, answers, OTA progress -----------------------------------------------------
    def _insert_once(self, table: Table, **values: Any) -> bool:
        """Insert unless a row with the same key exists (a redelivery, another replica): True when stored."""
        stmt = self._insert(table).values(**values).on_conflict_do_nothing().returning(*table.primary_key)
        with self._statement() as c:
            return c.execute(stmt).first() is not None  # RETURNING, not rowcount: psycopg's is -1 here

    def record_event(self, envelope_id: str, event: SensorEvent, *, received_at: float | None = None) -> bool:
        return self._insert_once(
            schema.events, envelope_id=envelope_id, site=event.site, device=event.device, seq=event.seq,
            timestamp=event.timestamp, severity=str(event.severity), kind=event.kind,
            received_at=received_at or time.time(), body=_json(event.model_dump(mode="json")))

    @staticmethod
    def _events_with_labels(*, labelled_only: bool = False) -> Select:
        e, lb = schema.events, schema.labels
        join = e.join(lb, lb.c.envelope_id == e.c.envelope_id, isouter=not labelled_only)
        return select(e.c.envelope_id, e.c.received_at, e.c.body, lb.c.assessment, lb.c.note, lb.c.key_id,
                      lb.c.key_name, lb.c.labelled_at).select_from(join)

    def events(self, site: str, device: str, limit: int = 50) -> list[dict[str, Any]]:
        e = schema.events
        rows = self._query(self._events_with_labels().where(e.c.site == site, e.c.device == device)
                           .order_by(e.c.received_at.desc(), e.c.rowid.desc()).limit(limit))
        return [_event_row(r) for r in rows]

    def event(self, envelope_id: str) -> dict[str, Any] | None:
        rows = self._query(self._events_with_labels().where(schema.events.c.envelope_id == envelope_id))
        return _event_row(rows[0]) if rows else None

    # ---- labels ----------------------------------------------------------------------------
    def label_event(self, envelope_id: str, assessment: str, *, note: str | None, key_id: str, key_name: str = "",
                    labelled_at: float | None = None) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
        label = {"assessment": assessment, "note": note, "key_id": key_id, "key_name": key_name,
                 "labelled_at": labelled_at or time.time()}
        e, lb = schema.events, schema.labels
        with self._tx() as c:
            self._serialize(c, "label", envelope_id)
            if c.execute(select(e.c.envelope_id).where(e.c.envelope_id == envelope_id)).first() is None:
                return None
            old = c.execute(select(lb.c.assessment, lb.c.note, lb.c.key_id, lb.c.key_name, lb.c.labelled_at)
                            .where(lb.c.envelope_id == envelope_id)).first()
            ins = self._insert(lb).values(envelope_id=envelope_id, **label)
            c.execute(ins.on_conflict_do_update(index_elements=[lb.c.envelope_id],
                                                set_={k: ins.excluded[k] for k in label}))
        return label, dict(old._mapping) if old is not None else None

    def labelled_events(self, *, since: float | None = None, context: int = 6) -> list[dict[str, Any]]:
        e, lb = schema.events, schema.labels
        stmt = self._events_with_labels(labelled_only=True)
        if since is not None:
            stmt = stmt.where(lb.c.labelled_at >= since)
        stmt = stmt.order_by(e.c.timestamp, e.c.site, e.c.device, e.c.seq, e.c.envelope_id)
        out = []
        with self._tx(write=False) as c:
            for r in list(c.execute(stmt)):
                event = json.loads(r.body)
                earlier = list(c.execute(
                    select(e.c.body).where(e.c.site == event["site"], e.c.device == event["device"],
                                           e.c.timestamp < event["timestamp"])
                    .order_by(e.c.timestamp.desc(), e.c.seq.desc()).limit(context))) if context > 0 else []
                out.append({"envelope_id": r.envelope_id, "label": _label(r), "event": event,
                            "context": [json.loads(b.body) for b in reversed(earlier)]})
        return out

    def record_answer(self, envelope_id: str, result: InferenceResult, *, received_at: float | None = None) -> bool:
        return self._insert_once(
            schema.answers, envelope_id=envelope_id, site=result.site, device=result.device,
            request_id=result.request_id, tier=result.tier, status=result.status, event_seq=result.event_seq,
            latency_ms=result.latency_ms, received_at=received_at or time.time(),
            body=_json(result.model_dump(mode="json")))

    def answers(self, site: str, device: str, limit: int = 50) -> list[dict[str, Any]]:
        a = schema.answers
        rows = self._query(select(a.c.envelope_id, a.c.received_at, a.c.body)
                           .where(a.c.site == site, a.c.device == device)
                           .order_by(a.c.received_at.desc(), a.c.rowid.desc()).limit(limit))
        return [{"envelope_id": r.envelope_id, "received_at": r.received_at, **json.loads(r.body)} for r in rows]

    def record_ota_status(self, envelope_id: str, status: OtaStatus, *, received_at: float | None = None) -> bool:
        return self._insert_once(
            schema.ota_status, envelope_id=envelope_id, site=status.site, device=status.device,
            image_version=status.image_version, phase=status.phase, detail=status.detail, progress=status.progress,
            received_at=received_at or time.time())

    def ota_statuses(self, site: str, device: str, limit: int = 50) -> list[dict[str, Any]]:
        o = schema.ota_status
        rows = self._query(select(*_public(o)).where(o.c.site == site, o.c.device == device)
                           .order_by(o.c.received_at.desc(), o.c.rowid.desc()).limit(limit))
        return [dict(r._mapping) for r in rows]

    # ---- escalations -----------------------------------------------------------------------
    def claim_escalation(self, key: str, *, request_id: str, site: str, device: str, priority: int, reason: str,
                         worker: str, lease_s: float, now: float | None = None, topic: str | None = None,
                         envelope: bytes | None = None) -> Claim:
        now = now or time.time()
        x = schema.escalations
        with self._tx() as c:
            # the lock is on the request, not the row: two replicas handed the same request (or its re-send
            # in a new envelope) before any row exists take turns, and the second one sees the first's claim
            self._serialize(c, "escalation", site, device, request_id)
            row = c.execute(select(x).where(or_(x.c.key == key, and_(x.c.site == site, x.c.device == device,
                                                                    x.c.request_id == request_id)))
                            .order_by((x.c.state == "done").desc()).limit(1)).first()
            if row is not None and row.state == "done":
                return Claim("answered", InferenceResult.model_validate_json(row.result))
            if row is not None and row.worker != worker and now - row.claimed_at < lease_s:
                return Claim("busy")
            if row is not None:  # the claimer died or gave up (or is this worker's dead predecessor): take over
                c.execute(update(x).where(x.c.key == row.key).values(
                    worker=worker, claimed_at=now, topic=func.coalesce(x.c.topic, topic),
                    envelope=func.coalesce(x.c.envelope, envelope)))
            else:
                c.execute(insert(x).values(key=key, request_id=request_id, site=site, device=device,
                                           priority=priority, reason=reason, worker=worker, state="pending",
                                           received_at=now, claimed_at=now, topic=topic, envelope=envelope))
        return Claim("claimed")

    def finish_escalation(self, key: str, result: InferenceResult, *, finished_at: float | None = None) -> None:
        x = schema.escalations
        self._write(update(x).where(or_(x.c.key == key, and_(
            x.c.site == result.site, x.c.device == result.device, x.c.request_id == result.request_id,
            x.c.state == "pending"))).values(
            state="done", outcome=result.status, finished_at=finished_at or time.time(),
            latency_ms=result.latency_ms, prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens, result=result.model_dump_json()))

    def renew_escalations(self, worker: str, *, now: float | None = None) -> int:
        x = schema.escalations
        return self._write(update(x).where(x.c.worker == worker, x.c.state == "pending")
                           .values(claimed_at=now or time.time()))

    def unfinished_escalations(self, worker: str) -> list[Unfinished]:
        x = schema.escalations
        rows = self._query(select(x.c.key, x.c.topic, x.c.envelope, x.c.received_at)
                           .where(x.c.worker == worker, x.c.state == "pending").order_by(x.c.received_at, x.c.key))
        return [Unfinished(r.key, r.topic, bytes(r.envelope) if r.envelope is not None else None, r.received_at)
                for r in rows]

    def release_escalation(self, key: str) -> None:
        x = schema.escalations
        self._write(update(x).where(x.c.key == key, x.c.state == "pending").values(claimed_at=0))

    def escalations(self, limit: int = 50, *, site: str | None = None, outcome: str | None = None) -> list[dict[str, Any]]:
        x = schema.escalations
        stmt = select(x.c.key, x.c.request_id, x.c.site, x.c.device, x.c.priority, x.c.reason, x.c.worker,
                      x.c.state, x.c.outcome, x.c.received_at, x.c.finished_at, x.c.latency_ms,
                      x.c.prompt_tokens, x.c.completion_tokens, x.c.result)
        if site:
            stmt = stmt.where(x.c.site == site)
        if outcome:
            stmt = stmt.where(x.c.outcome == outcome)
        out = []
        for r in self._query(stmt.order_by(x.c.received_at.desc()).limit(limit)):
            d = dict(r._mapping)
            result = json.loads(d.pop("result")) if d["result"] else None
            d["text"] = result.get("text", "") if result else None
            d["action"] = result.get("action") if result else None
            d["error"] = result.get("error") if result else None
            out.append(d)
        return out

    # ---- retention -------------------------------------------------------------------------
    def prune(self, before: float, *, batch: int = 1000) -> dict[str, int]:
        e, lb, x = schema.events, schema.labels, schema.escalations
        targets = {
            "events": (e, e.c.envelope_id, and_(e.c.received_at < before, ~exists().where(
                lb.c.envelope_id == e.c.envelope_id))),
            "answers": (schema.answers, schema.answers.c.envelope_id, schema.answers.c.received_at < before),
            "ota_status": (schema.ota_status, schema.ota_status.c.envelope_id,
                           schema.ota_status.c.received_at < before),
            "escalations": (x, x.c.key, and_(x.c.state == "done", x.c.finished_at < before)),
        }
        removed = {}
        for name, (table, key, old) in targets.items():
            removed[name] = 0
            while True:
                # SKIP LOCKED (PostgreSQL; SQLite has no row locks): replicas pruning at once take different
                # rows instead of queueing behind each other, and a batch never waits on a live transaction
                doomed = select(key).where(old).limit(batch).with_for_update(skip_locked=True)
                n = self._write(delete(table).where(key.in_(doomed.scalar_subquery())))
                removed[name] += n
                if n < batch:
                    break
        return removed

    # ---- fleet rollouts --------------------------------------------------------------------
    _ROLLOUT_FIELDS = {"state", "reason", "wave", "wave_started_at", "finished_at"}
    _ROLLOUT_DEVICE_FIELDS = {"sent_at", "outcome", "outcome_at"}

    def create_rollout(self, rollout: dict[str, Any], devices: list[tuple[str, str, int]]) -> None:
        with self._tx() as c:
            c.execute(insert(schema.rollouts).values(**{**rollout, "target": _json(rollout["target"])}))
            if devices:
                c.execute(insert(schema.rollout_devices), [
                    {"rollout_id": rollout["id"], "site": site, "device": device, "wave": wave, "position": i}
                    for i, (site, device, wave) in enumerate(devices)])

    def rollout(self, rollout_id: str) -> dict[str, Any] | None:
        r = schema.rollouts
        rows = self._query(select(*_public(r)).where(r.c.id == rollout_id))
        return _rollout_row(rows[0]) if rows else None

    def rollouts(self, limit: int = 50, *, state: str | None = None) -> list[dict[str, Any]]:
        r = schema.rollouts
        stmt = select(*_public(r)).order_by(r.c.created_at.desc(), r.c.rowid.desc()).limit(limit)
        if state:
            stmt = stmt.where(r.c.state == state)
        return [_rollout_row(row) for row in self._query(stmt)]

    def rollout_devices(self, rollout_id: str) -> list[dict[str, Any]]:
        d, r = schema.rollout_devices, schema.rollouts
        o, s = schema.ota_status.alias("o"), schema.ota_status.alias("s")
        newest = (select(o.c.rowid).where(o.c.site == d.c.site, o.c.device == d.c.device,
                                          o.c.image_version == r.c.image_version, d.c.sent_at.is_not(None),
                                          o.c.received_at >= d.c.sent_at)
                  .order_by(o.c.received_at.desc(), o.c.rowid.desc()).limit(1).scalar_subquery())
        stmt = (select(d.c.site, d.c.device, d.c.wave, d.c.sent_at, d.c.outcome, d.c.outcome_at,
                       s.c.phase.label("ota_phase"), s.c.detail.label("ota_detail"),
                       s.c.progress.label("ota_progress"), s.c.received_at.label("ota_at"))
                .select_from(d.join(r, r.c.id == d.c.rollout_id).outerjoin(s, s.c.rowid == newest))
                .where(d.c.rollout_id == rollout_id).order_by(d.c.wave, d.c.position))
        return [dict(row._mapping) for row in self._query(stmt)]

    def busy_devices(self, devices: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
        if not devices:
            return {}
        d, r = schema.rollout_devices, schema.rollouts
        rows = self._query(select(d.c.site, d.c.device, d.c.rollout_id).join(r, r.c.id == d.c.rollout_id)
                           .where(r.c.state == "running", tuple_(d.c.site, d.c.device).in_(devices)))
        return {(row.site, row.device): row.rollout_id for row in rows}

    def claim_rollout(self, rollout_id: str, owner: str, lease_s: float, *, now: float | None = None) -> bool:
        now = now or time.time()
        r = schema.rollouts
        return self._write(update(r).where(r.c.id == rollout_id, r.c.state == "running",
                                           or_(r.c.driver.is_(None), r.c.driver == owner, r.c.driver_until < now))
                           .values(driver=owner, driver_until=now + lease_s)) == 1

    def release_rollouts(self, owner: str) -> None:
        r = schema.rollouts
        self._write(update(r).where(r.c.driver == owner).values(driver_until=0))

    def _set(self, table: Table, allowed: set[str], fields: dict[str, Any], *where: Any) -> None:
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(f"not a settable column of {table.name}: {sorted(unknown)}")
        if fields:
            self._write(update(table).where(*where).values(**fields))

    def update_rollout(self, rollout_id: str, **fields: Any) -> None:
        r = schema.rollouts
        self._set(r, self._ROLLOUT_FIELDS, fields, r.c.id == rollout_id)

    def update_rollout_device(self, rollout_id: str, site: str, device: str, **fields: Any) -> None:
        d = schema.rollout_devices
        self._set(d, self._ROLLOUT_DEVICE_FIELDS, fields, d.c.rollout_id == rollout_id, d.c.site == site,
                  d.c.device == device)

    def close(self) -> None:
        self.engine.dispose()


class SqliteStore(SqlStore):
    """The embedded default: one SQLite file (``path``) in WAL mode, shared by the processes of one machine."""

    def __init__(self, path: str | Path = ":memory:") -> None:
        super().__init__(":memory:" if str(path) == ":memory:" else f"sqlite:///{path}")
        self.path = str(path)

    @property
    def journal_mode(self) -> str:
        with self._tx(write=False) as c:
            return c.exec_driver_sql("PRAGMA journal_mode").scalar()


def open_store(db: str | Path) -> SqlStore:
    """The store a ``[cloud] db`` setting names: ``postgresql://…``, ``sqlite:///…`` or a plain SQLite path."""
    return SqlStore(db)
