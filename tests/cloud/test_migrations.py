"""Schema versions on both backends: upgrade from empty, adoption of a pre-Alembic SQLite file, refusal of a
newer schema, PostgreSQL never migrated at start, and `apiary cloud db upgrade`."""
from __future__ import annotations

import sqlite3

import pytest
from sqlalchemy import create_engine, inspect, text
from typer.testing import CliRunner

from apiary.cli import app
from apiary.cloud.db import legacy, migrate, schema
from apiary.cloud.db.engine import database_url
from apiary.cloud.errors import CloudError
from apiary.cloud.store import SqliteStore, open_store
from apiary.shared.protocol import DeviceState, SensorEvent


def db_upgrade(*args: str):
    return CliRunner().invoke(app, ["cloud", "db", "upgrade", *args])


def revision(url: str) -> str | None:
    engine = create_engine(database_url(url))
    try:
        with engine.connect() as conn:
            if "alembic_version" not in inspect(conn).get_table_names():
                return None
            return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    finally:
        engine.dispose()


def columns(url: str) -> dict[str, set[str]]:
    engine = create_engine(database_url(url))
    try:
        with engine.connect() as conn:
            insp = inspect(conn)
            return {t: {c["name"] for c in insp.get_columns(t)} for t in insp.get_table_names()}
    finally:
        engine.dispose()


@pytest.fixture
def empty_url(request, tmp_path) -> str:
    """An empty database on each backend (nothing migrated yet)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.db'}"
    return request.getfixturevalue("postgres").create_database()


both = pytest.mark.parametrize("empty_url", ["sqlite", "postgresql"], indirect=True)


@both
def test_upgrade_from_empty_builds_the_schema_the_store_queries(empty_url):
    result = db_upgrade("--db", empty_url)
    assert result.exit_code == 0, result.output
    assert f"upgraded from revision none to {migrate.head()}" in result.stdout
    assert revision(empty_url) == migrate.head()
    have = columns(empty_url)
    sqlite = empty_url.startswith("sqlite")
    for table in schema.TABLES:  # schema.py describes exactly what the revisions made
        want = {c.name for c in schema.metadata.tables[table].columns} - ({"rowid"} if sqlite else set())
        assert have[table] == want, table
    again = db_upgrade("--db", empty_url)
    assert again.exit_code == 0 and f"already at revision {migrate.head()}" in again.stdout
    store = open_store(empty_url)
    try:
        assert store.record_event("e1", SensorEvent(site="s", device="d", seq=1, timestamp=1.0, readings={}))
    finally:
        store.close()


def pre_alembic_file(path, *, drop_labels: bool = False) -> None:
    """A database as the code before Alembic left it: its DDL, some data, no alembic_version."""
    db = sqlite3.connect(path)
    db.executescript(legacy.SQLITE_SCHEMA)
    if drop_labels:  # older still: before the labels table and the claim columns
        db.execute("DROP TABLE labels")
    db.execute("INSERT INTO events VALUES ('old-1', 's', 'd', 7, 100.0, 'info', 'reading', 200.0, "
               "'{\"site\": \"s\", \"device\": \"d\", \"seq\": 7, \"timestamp\": 100.0, \"readings\": {}}')")
    db.execute("INSERT INTO devices (site, device, role, online, status, session, first_seen, last_seen) "
               "VALUES ('s', 'd', 'edge', 1, 'birth', 3, 1.0, 1.0)")
    db.commit()
    db.close()


@pytest.mark.parametrize("drop_labels", [False, True], ids=["current", "before-labels"])
def test_a_pre_alembic_sqlite_file_is_adopted_with_its_data(tmp_path, drop_labels):
    path = tmp_path / "old.db"
    pre_alembic_file(path, drop_labels=drop_labels)
    store = SqliteStore(path)  # the embedded default adopts (and upgrades) at start
    try:
        assert revision(f"sqlite:///{path}") == migrate.head()
        assert store.event("old-1")["seq"] == 7 and store.event("old-1")["label"] is None
        assert store.devices()[0]["session"] == 3
        assert store.record_state(DeviceState(site="s", device="d", status="update", online=True, session=3))
        assert store.label_event("old-1", "normal", note=None, key_id="k") is not None
    finally:
        store.close()


def test_a_pre_alembic_file_whose_tables_do_not_match_is_left_alone(tmp_path):
    path = tmp_path / "odd.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE events (envelope_id TEXT PRIMARY KEY, site TEXT, colour TEXT)")
    db.commit()
    db.close()
    with pytest.raises(CloudError, match=r"do not match revision 0001: events lacks .*body.*; events has unknown "
                                         r"columns colour"):
        SqliteStore(path)
    result = db_upgrade("--db", str(path))
    assert result.exit_code == 2 and "not adopted, nothing changed" in result.output
    assert set(columns(f"sqlite:///{path}")) == {"events"}  # nothing created, nothing stamped


@both
def test_a_newer_schema_is_refused_naming_both_revisions(empty_url):
    migrate.upgrade(empty_url)
    engine = create_engine(database_url(empty_url))
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '0099_from_the_future'"))
    engine.dispose()
    with pytest.raises(CloudError, match=rf"revision 0099_from_the_future, newer than .* newest is {migrate.head()}"):
        open_store(empty_url)
    result = db_upgrade("--db", empty_url)
    assert result.exit_code == 2 and "0099_from_the_future" in result.output
    assert revision(empty_url) == "0099_from_the_future"


def test_postgresql_is_never_migrated_at_start(postgres):
    url = postgres.create_database()
    with pytest.raises(CloudError, match=r"no schema yet.*run `apiary cloud db upgrade --db URL`"):
        open_store(url)
    assert columns(url) == {}  # the refusal touched nothing
    assert db_upgrade("--db", url).exit_code == 0
    open_store(url).close()


def test_a_bad_database_url_is_a_clear_error(tmp_path):
    with pytest.raises(CloudError, match="unsupported database URL 'mysql://u:\\*\\*\\*@h/db'"):
        open_store("mysql://u:secret@h/db")
    result = db_upgrade("--db", "postgresql://nobody@/nowhere?host=/nonexistent&port=1")
    assert result.exit_code == 2 and "cannot migrate" in result.output


def test_a_replica_refuses_to_start_on_an_unmigrated_postgresql(postgres, tmp_path):
    """`apiary cloud serve` against a database nobody migrated: exit 2 naming the command, before any model load."""
    url = postgres.create_database()
    result = CliRunner().invoke(app, ["cloud", "serve", "--db", url, "--port", "0", "--api-key-file",
                                      str(tmp_path / "keys.jsonl"), "--images", str(tmp_path / "images")])
    assert result.exit_code == 2, result.output
    assert "apiary cloud db upgrade" in result.output and "no schema yet" in result.output
