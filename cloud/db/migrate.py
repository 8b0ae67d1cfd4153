"""Schema versions: Alembic upgrades, adoption of pre-Alembic SQLite files, and the check every replica makes
at start.

At start (:func:`check`) a store compares the database's revision with the newest this code knows:

* equal: go on;
* unknown to this code (a newer replica migrated it): refuse, naming both revisions; this code would
  misread the newer tables;
* older, or no schema yet: the embedded SQLite default upgrades it on the spot (one process, one
  file, nobody else to coordinate with); PostgreSQL refuses and tells the operator to run
  ``apiary cloud db upgrade``: a shared database is migrated once, on purpose, never as a side effect
  of whichever replica a scheduler happened to start first.

A SQLite file made by the code before Alembic has our tables and no ``alembic_version``: it is adopted
(:func:`adopt`): the old code's additive DDL is replayed (as it did at every open), its columns are
compared with revision 0001, and when they match it is stamped 0001; when they do not, nothing is
changed and the error names the differences, so nobody's database breaks silently.
"""
from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, inspect, text
from sqlalchemy.exc import SQLAlchemyError

from apiary.cloud.db.engine import is_sqlite, make_engine, redact
from apiary.cloud.db.legacy import SQLITE_COLUMNS, sqlite_statements
from apiary.cloud.db.schema import TABLES, metadata
from apiary.cloud.errors import CloudError

MIGRATIONS = Path(__file__).with_name("migrations")
ADOPTED = "0001"  # the revision a pre-Alembic SQLite file is stamped with
_PG_LOCK = 0x61706961  # pg_advisory_xact_lock key: one migration at a time per database


def config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


def scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(config())


def head() -> str:
    return scripts().get_current_head()


def current(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


def _ours(conn: Connection) -> set[str]:
    return set(TABLES) & set(inspect(conn).get_table_names())


def _pre_alembic(conn: Connection) -> bool:
    return current(conn) is None and bool(_ours(conn))


def adopt(conn: Connection) -> None:
    """Stamp a pre-Alembic SQLite database with revision 0001 once its tables match (see the module doc)."""
    if conn.dialect.name != "sqlite":
        raise CloudError(f"the database has the store's tables ({', '.join(sorted(_ours(conn)))}) but no schema "
                         "version: it was not made by `apiary cloud db upgrade`; refusing to touch it")
    problems = []
    insp = inspect(conn)
    for table in sorted(_ours(conn)):  # tables the old code had not made yet come from the replay below
        want = {c.name for c in metadata.tables[table].columns} - {"rowid"}
        have = {c["name"] for c in insp.get_columns(table)}
        lacking = want - have - set(SQLITE_COLUMNS.get(table, {}))  # columns the old code added later are added
        if lacking:
            problems.append(f"{table} lacks {', '.join(sorted(lacking))}")
        if have - want:
            problems.append(f"{table} has unknown columns {', '.join(sorted(have - want))}")
    if problems:
        raise CloudError("a database without a schema version whose tables do not match revision "
                         f"{ADOPTED}: {'; '.join(problems)}; not adopted, nothing changed")
    for statement in sqlite_statements():  # what the old code ran at every open: missing tables and indexes
        conn.exec_driver_sql(statement)
    for table, columns in SQLITE_COLUMNS.items():
        have = {c["name"] for c in inspect(conn).get_columns(table)}
        for name, kind in columns.items():
            if name not in have:
                conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
    MigrationContext.configure(conn).stamp(scripts(), ADOPTED)


def _known(revision: str) -> bool:
    return any(s.revision == revision for s in scripts().walk_revisions())


def upgrade_on(conn: Connection) -> tuple[str | None, str]:
    """Bring the database on ``conn`` (in a transaction) to the newest revision; (before, after)."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK})
    before = current(conn)
    if before is not None and not _known(before):
        raise _newer(before)
    if _pre_alembic(conn):
        adopt(conn)
    cfg = config()
    cfg.attributes["connection"] = conn
    command.upgrade(cfg, "head")
    return before, current(conn) or head()


def upgrade(db: str | Path) -> tuple[str | None, str]:
    """``apiary cloud db upgrade``: migrate ``db`` (URL or SQLite path) to the newest revision; (before, after)."""
    engine = make_engine(db)
    try:
        with engine.begin() as conn:
            return upgrade_on(conn)
    except SQLAlchemyError as e:
        raise CloudError(f"cannot migrate {redact(str(engine.url))}: {e}") from None
    finally:
        engine.dispose()


def _newer(revision: str) -> CloudError:
    return CloudError(f"the database schema is at revision {revision}, newer than this version of apiary knows "
                      f"(its newest is {head()}): upgrade apiary on this replica before starting it")


def check(engine: Engine) -> None:
    """At a store's start: refuse a newer schema; upgrade an older one only on SQLite (see the module doc)."""
    with engine.connect() as conn:
        at = current(conn)
        pre = at is None and bool(_ours(conn))
        conn.rollback()
    newest = head()
    if at == newest:
        return
    if at is not None and not _known(at):
        raise _newer(at)
    if not is_sqlite(str(engine.url)):
        found = "no schema yet" if at is None and not pre else f"schema revision {at or 'none'}"
        raise CloudError(f"the database {engine.url.render_as_string(hide_password=True)} has {found}, "
                         f"this version of apiary needs revision {newest}: run `apiary cloud db upgrade --db URL` "
                         "once, then start the replicas (PostgreSQL is never migrated at start)")
    with engine.begin() as conn:
        upgrade_on(conn)
