"""Alembic's environment for the cloud store: migrations run on the connection :mod:`apiary.cloud.db.migrate`
hands over (``config.attributes["connection"]``), or on ``sqlalchemy.url`` when Alembic's own CLI runs them."""
from __future__ import annotations

from alembic import context

from apiary.cloud.db.engine import make_engine
from apiary.cloud.db.schema import metadata


def run() -> None:
    connection = context.config.attributes.get("connection")
    if connection is None:
        engine = make_engine(context.config.get_main_option("sqlalchemy.url"))
        with engine.connect() as connection:
            _migrate(connection)
        engine.dispose()
    else:
        _migrate(connection)


def _migrate(connection) -> None:
    context.configure(connection=connection, target_metadata=metadata, render_as_batch=True,
                      transaction_per_migration=True)
    with context.begin_transaction():
        context.run_migrations()


run()
