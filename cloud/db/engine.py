"""From the ``[cloud] db`` setting to a SQLAlchemy engine: which backend, and its connection rules.

``db`` is a URL (``postgresql://user:pass@host/db``, ``sqlite:///path``) or a plain path, which
stays SQLite, the embedded default. SQLite connections run in WAL mode with a busy timeout (several
processes on one machine share the file), and every transaction that may write starts with
``BEGIN IMMEDIATE``: it takes the write lock up front, so two read-then-write transactions never
deadlock on the lock upgrade, and a claim's read and write are one step, as with one lock.
"""
from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.pool import StaticPool

from apiary.cloud.errors import CloudError

READ_ONLY = "apiary_read_only"  # execution option: a SQLite read runs in a plain (deferred) transaction


def database_url(db: str | Path) -> str:
    """The SQLAlchemy URL for a ``db`` setting: psycopg 3 for PostgreSQL, pysqlite for SQLite and plain paths."""
    text = str(db)
    if text in (":memory:", "sqlite://", "sqlite:///:memory:"):
        return "sqlite://"
    if "://" not in text:
        return f"sqlite:///{text}"
    scheme, rest = text.split("://", 1)
    if scheme in ("postgresql", "postgres", "postgresql+psycopg"):
        return f"postgresql+psycopg://{rest}"
    if scheme == "sqlite":
        return text
    raise CloudError(f"unsupported database URL {redact(text)!r}: use postgresql://… or sqlite:///… (or a file path)")


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def sqlite_file(db: str | Path) -> Path | None:
    """The file a SQLite ``db`` setting names; None for PostgreSQL or an in-memory database."""
    url = database_url(db)
    path = make_url(url).database if is_sqlite(url) else None
    return Path(path) if path else None


def make_engine(db: str | Path) -> Engine:
    """An engine for ``db``; a SQLite file's directory is created, a PostgreSQL server is not contacted yet."""
    url = database_url(db)
    if not is_sqlite(url):
        try:
            return create_engine(url, pool_size=5, max_overflow=10, pool_pre_ping=True)
        except (ArgumentError, ImportError) as e:
            raise CloudError(f"bad database URL {redact(url)}: {e}") from None
    path = sqlite_file(url)
    if path:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CloudError(f"cannot create the database directory for {path}: {e}") from None
        engine = create_engine(url, connect_args={"timeout": 10.0, "check_same_thread": False})
    else:  # one in-memory database: every checkout is the same connection
        engine = create_engine(url, connect_args={"check_same_thread": False}, poolclass=StaticPool)

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None  # SQLAlchemy emits BEGIN itself (below), not the driver
        cur = dbapi_conn.cursor()
        if path:
            cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA busy_timeout=10000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn) -> None:
        options = conn.get_execution_options()
        if options.get("isolation_level") == "AUTOCOMMIT":
            return  # one statement on its own: SQLite runs it as its own transaction
        conn.exec_driver_sql("BEGIN" if options.get(READ_ONLY) else "BEGIN IMMEDIATE")

    return engine
