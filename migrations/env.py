"""Alembic environment for chatd's store.

The URL comes from the caller, never from this file: ``chatd.store.db.upgrade(url)`` passes it
as a config attribute; the ``alembic`` command line takes ``-x url=...``, then ``sqlalchemy.url``
from alembic.ini, then chatd's own configuration. Migrations run on the async engine built by
``chatd.store.db.create_engine``, so they see the same connection settings as the server.
"""

from __future__ import annotations

import asyncio
from logging.config import fileConfig
from typing import Any

from alembic import context
from sqlalchemy import event
from sqlalchemy.engine import Connection

from chatd.store.db import URL_ATTRIBUTE, create_engine, is_sqlite
from chatd.store.models import Base

config = context.config
target_metadata = Base.metadata

# Only the command line configures logging; a program calling upgrade() keeps its own.
if config.config_file_name is not None and URL_ATTRIBUTE not in config.attributes:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    url = config.attributes.get(URL_ATTRIBUTE)
    url = url or context.get_x_argument(as_dictionary=True).get("url")
    url = url or config.get_main_option("sqlalchemy.url")
    if url:
        return str(url)
    from chatd.config import load

    return load().store_url


def _configure(**kwargs: Any) -> None:
    sqlite = is_sqlite(_url())
    context.configure(
        target_metadata=target_metadata,
        compare_type=True,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        render_as_batch=sqlite,
        # chatd's SQLite connections emit their own BEGIN, so DDL there is transactional too:
        # an upgrade applies completely or not at all.
        transactional_ddl=True,
        **kwargs,
    )


def run_migrations_offline() -> None:
    """``alembic upgrade --sql``: write the SQL instead of running it."""
    _configure(url=_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def _run_sync(connection: Connection) -> None:
    _configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()
        if connection.dialect.name == "sqlite":
            # Foreign keys are off while migrating (see below); refuse to commit a schema
            # change that left dangling references.
            problems = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
            if problems:
                raise RuntimeError(f"migration left foreign key violations: {problems[:10]}")


async def run_migrations_online() -> None:
    engine = create_engine(_url())
    if engine.dialect.name == "sqlite":

        @event.listens_for(engine.sync_engine, "connect")
        def _foreign_keys_off(dbapi_connection: Any, _record: Any) -> None:
            # A batch migration drops and recreates tables; with foreign keys on, dropping
            # "sessions" would cascade-delete every message. The pragma only works outside a
            # transaction, hence here, after create_engine's own connect hook.
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute("PRAGMA foreign_keys=OFF")
            finally:
                cursor.close()

    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run_sync)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    asyncio.run(run_migrations_online())
