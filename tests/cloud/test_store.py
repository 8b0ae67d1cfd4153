"""The storage layer on real SQLite files and a real PostgreSQL (the same tests on both, via ``store``):
session rules, idempotency, escalation claims."""
from __future__ import annotations

import threading

import pytest

from apiary.cloud.errors import CloudError
from apiary.cloud.store import SqliteStore
from apiary.shared.protocol import DeviceState, InferenceResult, OtaStatus, SensorEvent


@pytest.fixture
def store(any_store):
    return any_store


@pytest.fixture
def sqlite_store(tmp_path):
    s = SqliteStore(tmp_path / "db" / "cloud.db")
    yield s
    s.close()


def state(status: str, session: int, **kw) -> DeviceState:
    return DeviceState(site="meadow", device="hive-1", status=status, online=status != "death", session=session, **kw)


def result(request_id: str = "r1", status: str = "ok", text: str = "answer") -> InferenceResult:
    return InferenceResult(request_id=request_id, site="meadow", device="hive-1", tier="cloud", status=status,
                           text=text, latency_ms=12.5, prompt_tokens=30, completion_tokens=5)


def test_wal_mode_and_bad_path(sqlite_store, tmp_path):
    assert sqlite_store.journal_mode == "wal"
    (tmp_path / "file").write_text("x")
    with pytest.raises(CloudError, match="cannot"):
        SqliteStore(tmp_path / "file" / "cloud.db")
    (tmp_path / "garbage.db").write_bytes(b"not a database" * 100)
    with pytest.raises(CloudError, match="cannot open database"):
        SqliteStore(tmp_path / "garbage.db")


def test_birth_death_sessions(store):
    assert store.record_state(state("birth", 5, battery_soc=0.9, model_version="m1"))
    assert not store.record_state(state("death", 4))  # the Last Will of an older session
    (d,) = store.devices()
    assert d["online"] and d["session"] == 5 and d["battery_soc"] == 0.9
    assert store.record_state(state("update", 5, battery_soc=0.7))  # partial update keeps other fields
    (d,) = store.devices()
    assert d["battery_soc"] == 0.7 and d["model_version"] == "m1"
    assert store.record_state(state("death", 5))
    (d,) = store.devices()
    assert not d["online"] and d["status"] == "death" and d["last_death"] is not None
    assert store.record_state(state("birth", 6))
    assert store.devices()[0]["online"]
    assert store.devices(site="elsewhere") == []


def test_sparkplug_sessions_a_birth_resets_death_and_update_need_the_current_session(store):
    """A huge session number cannot freeze a node: the next birth resets it, whatever its number."""
    assert store.record_state(state("birth", 3))
    assert not store.record_state(state("update", 999_999))  # not the current session: refused
    assert not store.record_state(state("death", 10**12))
    (d,) = store.devices()
    assert d["online"] and d["session"] == 3
    assert store.record_state(state("birth", 10**12))  # even a spoofed birth...
    assert store.record_state(state("birth", 4))  # ...is reset by the node's real one
    assert store.record_state(state("death", 4))  # and its Last Will counts
    (d,) = store.devices()
    assert not d["online"] and d["session"] == 4
    assert not store.record_state(state("update", 4))  # a dead session stays dead until a birth
    assert not store.devices()[0]["online"]


def test_events_answers_ota_are_idempotent_and_newest_first(store):
    for seq in range(5):
        ev = SensorEvent(site="meadow", device="hive-1", seq=seq, timestamp=1000.0 + seq, readings={"t": float(seq)})
        assert store.record_event(f"env-{seq}", ev, received_at=2000.0 + seq)
    assert not store.record_event("env-4", ev)  # a QoS 1 redelivery or a second replica: stored once
    assert [e["seq"] for e in store.events("meadow", "hive-1", limit=3)] == [4, 3, 2]
    assert store.events("meadow", "other") == []
    assert store.record_answer("a-1", result())
    assert not store.record_answer("a-1", result())
    assert store.answers("meadow", "hive-1")[0]["text"] == "answer"
    st = OtaStatus(site="meadow", device="hive-1", image_version="2.0", phase="verified")
    assert store.record_ota_status("o-1", st) and not store.record_ota_status("o-1", st)
    store.record_state(state("birth", 1))
    assert store.devices()[0]["last_ota"]["phase"] == "verified"


def test_escalation_claims(store):
    claim = dict(request_id="r1", site="meadow", device="hive-1", priority=2, reason="low conf", lease_s=30.0)
    assert store.claim_escalation("env-1", worker="w1", now=100.0, **claim).state == "claimed"
    assert store.claim_escalation("env-1", worker="w2", now=110.0, **claim).state == "busy"
    # the same request re-sent in a new envelope is the same escalation
    assert store.claim_escalation("env-2", worker="w2", now=110.0, **claim).state == "busy"
    store.finish_escalation("env-1", result(), finished_at=101.0)
    again = store.claim_escalation("env-2", worker="w2", now=120.0, **claim)
    assert again.state == "answered" and again.result == result()
    (row,) = store.escalations()
    assert row["outcome"] == "ok" and row["state"] == "done" and row["latency_ms"] == 12.5 and row["worker"] == "w1"
    assert store.escalations(outcome="expired") == [] and len(store.escalations(site="meadow")) == 1


def test_escalation_lease_takeover_and_release(store):
    claim = dict(request_id="r2", site="meadow", device="hive-1", priority=0, reason="", lease_s=30.0)
    assert store.claim_escalation("env-9", worker="w1", now=100.0, **claim).state == "claimed"
    # w1 died mid-request: after the lease another worker takes over
    assert store.claim_escalation("env-9", worker="w2", now=131.0, **claim).state == "claimed"
    assert store.escalations()[0]["worker"] == "w2"
    # w2 stops mid-request: the claim stays (w2 resumes it when it is back) but its lease ends at once
    store.release_escalation("env-9")
    (row,) = store.escalations()
    assert row["state"] == "pending" and row["worker"] == "w2"
    assert store.claim_escalation("env-9", worker="w3", now=132.0, **claim).state == "claimed"


def test_a_claim_keeps_its_request_and_the_same_worker_resumes_it_after_a_crash(store):
    """A worker id is one process at a time (its fixed MQTT client id): a pending claim under its own id is a
    dead predecessor's, so the restarted worker takes it back at once, lease or not, with the request it needs."""
    claim = dict(request_id="r3", site="meadow", device="hive-1", priority=0, reason="", lease_s=30.0)
    topic = "apiary/v1/meadow/hive-1/escalate"
    assert store.claim_escalation("env-3", worker="w1", now=100.0, topic=topic, envelope=b"\x81request",
                                  **claim).state == "claimed"
    store.claim_escalation("env-4", worker="w2", now=100.0, topic=topic, envelope=b"other",
                           **{**claim, "request_id": "r4"})
    (unfinished,) = store.unfinished_escalations("w1")
    assert (unfinished.key, unfinished.topic, unfinished.envelope, unfinished.received_at) == (
        "env-3", topic, b"\x81request", 100.0)
    assert store.claim_escalation("env-3", worker="w1", now=101.0, **claim).state == "claimed"  # within the lease
    assert store.claim_escalation("env-3", worker="w2", now=102.0, **claim).state == "busy"
    store.finish_escalation("env-3", result("r3"), finished_at=103.0)
    assert store.unfinished_escalations("w1") == []
    assert [u.key for u in store.unfinished_escalations("w2")] == ["env-4"]


def test_a_worker_renews_its_leases_while_it_computes(store):
    """A long computation keeps its claim: a re-send reaching another worker after claim_lease_s is not run twice."""
    claim = dict(request_id="r5", site="meadow", device="hive-1", priority=0, reason="", lease_s=30.0)
    assert store.claim_escalation("env-5", worker="w1", now=100.0, **claim).state == "claimed"
    assert store.renew_escalations("w1", now=125.0) == 1
    assert store.claim_escalation("env-5", worker="w2", now=131.0, **claim).state == "busy"
    assert store.renew_escalations("w2", now=140.0) == 0
    assert store.claim_escalation("env-5", worker="w2", now=156.0, **claim).state == "claimed"


def test_an_older_database_gains_the_claim_columns(tmp_path):
    import sqlite3

    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE escalations (key TEXT PRIMARY KEY, request_id TEXT NOT NULL, site TEXT NOT NULL, "
               "device TEXT NOT NULL, priority INTEGER NOT NULL, reason TEXT NOT NULL, worker TEXT NOT NULL, "
               "state TEXT NOT NULL, outcome TEXT, received_at REAL NOT NULL, claimed_at REAL NOT NULL, "
               "finished_at REAL, latency_ms REAL, prompt_tokens INTEGER, completion_tokens INTEGER, result TEXT)")
    db.execute("INSERT INTO escalations (key, request_id, site, device, priority, reason, worker, state, "
               "received_at, claimed_at) VALUES ('old', 'r0', 's', 'd', 0, '', 'w1', 'pending', 1.0, 1.0)")
    db.commit()
    db.close()
    store = SqliteStore(path)
    try:
        (old,) = store.unfinished_escalations("w1")
        assert old.key == "old" and old.envelope is None and old.topic is None
    finally:
        store.close()


def test_concurrent_claims_across_connections(tmp_path):
    """Two processes' connections racing for one request: exactly one wins."""
    path = tmp_path / "shared.db"
    stores = [SqliteStore(path) for _ in range(4)]
    outcomes: list[str] = []
    barrier = threading.Barrier(len(stores))

    def race(s: SqliteStore, i: int) -> None:
        barrier.wait()
        outcomes.append(s.claim_escalation("env-x", request_id="rx", site="s", device="d", priority=1, reason="",
                                           worker=f"w{i}", lease_s=60).state)

    threads = [threading.Thread(target=race, args=(s, i)) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["busy", "busy", "busy", "claimed"]
    for s in stores:
        s.close()


def test_the_fleet_listing_is_one_statement_whatever_the_fleet_size(store):
    """No N+1: devices() joins each device's newest OTA status in the same statement."""
    from sqlalchemy import event

    for i in range(6):
        store.record_state(DeviceState(site="meadow", device=f"hive-{i}", status="birth", online=True, session=1))
        for n, phase in enumerate(("downloading", "verified", "committed")[: i % 4]):
            store.record_ota_status(f"o-{i}-{n}", OtaStatus(site="meadow", device=f"hive-{i}", image_version="2.0",
                                                            phase=phase), received_at=1000.0 + n)
    store.record_ota_status("o-tie", OtaStatus(site="meadow", device="hive-2", image_version="2.1", phase="failed"),
                            received_at=1001.0)  # same instant as hive-2's "verified": the later one counts
    statements: list[str] = []
    listen = lambda conn, cursor, sql, *rest: statements.append(sql)  # noqa: E731
    event.listen(store.engine, "before_cursor_execute", listen)
    try:
        fleet = store.devices()
    finally:
        event.remove(store.engine, "before_cursor_execute", listen)
    assert len([s for s in statements if s.lstrip().upper().startswith("SELECT")]) == 1, statements
    last = {d["device"]: d["last_ota"] and (d["last_ota"]["image_version"], d["last_ota"]["phase"]) for d in fleet}
    assert last == {"hive-0": None, "hive-1": ("2.0", "downloading"), "hive-2": ("2.1", "failed"),
                    "hive-3": ("2.0", "committed"), "hive-4": None, "hive-5": ("2.0", "downloading")}
    assert fleet[3]["last_ota"]["received_at"] == 1002.0 and fleet[3]["online"] is True


def test_retention_prunes_in_batches_and_keeps_labels_and_unfinished_claims(store):
    old, new = 1000.0, 5000.0
    for i in range(7):
        ev = SensorEvent(site="meadow", device="hive-1", seq=i, timestamp=float(i), readings={})
        store.record_event(f"old-{i}", ev, received_at=old)
        store.record_answer(f"a-old-{i}", result(f"r{i}"), received_at=old)
        store.record_ota_status(f"o-old-{i}", OtaStatus(site="meadow", device="hive-1", image_version="2",
                                                        phase="verified"), received_at=old)
    store.record_event("new-0", SensorEvent(site="meadow", device="hive-1", seq=99, timestamp=99.0, readings={}),
                       received_at=new)
    store.record_answer("a-new", result("rn"), received_at=new)
    store.label_event("old-3", "swarming", note=None, key_id="k")  # training data: kept however old
    claim = dict(site="meadow", device="hive-1", priority=0, reason="", worker="w1", lease_s=30.0)
    store.claim_escalation("done-old", request_id="q1", now=old, **claim)
    store.finish_escalation("done-old", result("q1"), finished_at=old)
    store.claim_escalation("pending-old", request_id="q2", now=old, **claim)  # unfinished: never pruned
    store.claim_escalation("done-new", request_id="q3", now=new, **claim)
    store.finish_escalation("done-new", result("q3"), finished_at=new)

    removed = store.prune(3000.0, batch=2)
    assert removed == {"events": 6, "answers": 7, "ota_status": 7, "escalations": 1}
    assert [e["envelope_id"] for e in store.events("meadow", "hive-1")] == ["new-0", "old-3"]
    assert store.event("old-3")["label"]["assessment"] == "swarming"
    assert [a["envelope_id"] for a in store.answers("meadow", "hive-1")] == ["a-new"]
    assert store.ota_statuses("meadow", "hive-1") == []
    assert sorted(e["key"] for e in store.escalations()) == ["done-new", "pending-old"]
    assert [u.key for u in store.unfinished_escalations("w1")] == ["pending-old"]
    assert store.prune(3000.0, batch=2) == {"events": 0, "answers": 0, "ota_status": 0, "escalations": 0}


def test_the_retention_task_prunes_periodically(store):
    """The retention task the service runs (cloud/retention.py): first run soon after start, then every interval."""
    import time

    from apiary.cloud.retention import Retention

    for i in range(3):
        store.record_event(f"e-{i}", SensorEvent(site="meadow", device="hive-1", seq=i, timestamp=float(i),
                                                 readings={}), received_at=time.time() - 3 * 86400)
    store.record_event("fresh", SensorEvent(site="meadow", device="hive-1", seq=9, timestamp=9.0, readings={}))
    task = Retention(store, 2.0, interval_s=0.05, first_after_s=0.0, batch=2).start()
    try:
        deadline = time.monotonic() + 30
        while task.runs < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        task.stop()
    assert task.runs >= 2 and task.pruned["events"] == 3
    assert [e["envelope_id"] for e in store.events("meadow", "hive-1")] == ["fresh"]
    assert Retention(store, 0.0).start()._thread is None  # 0 days: keep everything, no task


def test_retention_settings_accept_none_and_refuse_nonsense():
    from apiary.cloud.settings import CloudSettings

    assert CloudSettings(retention_days="none").retention_days == 0.0
    assert CloudSettings(retention_days=30).retention_days == 30.0
    with pytest.raises(ValueError, match="retention_days"):
        CloudSettings(retention_days=-1)
    with pytest.raises(ValueError, match="unsupported database URL"):
        CloudSettings(db="mysql://h/db")
    assert CloudSettings(db="postgresql://u@h/db").db == "postgresql://u@h/db"
