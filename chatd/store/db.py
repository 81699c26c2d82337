"""Engine, sessionmaker and schema migrations of the conversation store.

The same code serves SQLite (``sqlite+aiosqlite:///path``, the embedded default) and PostgreSQL
(``postgresql+asyncpg://...``): only the URL changes. SQLite connections are configured so that
the file behaves like a small server database: write-ahead logging (readers never block the
writer), foreign keys enforced (cascading deletes work), ``synchronous=FULL`` (a committed turn
survives a power cut) and a busy timeout (concurrent writers wait instead of failing at once).

The schema is owned by Alembic (``migrations/``); nothing here calls ``metadata.create_all``.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import event
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

# How long a SQLite writer waits for the write lock before "database is locked".
SQLITE_BUSY_TIMEOUT_MS = 10_000

# Key under which upgrade()/downgrade() hand the URL to migrations/env.py.
URL_ATTRIBUTE = "chatd_store_url"


def migrations_path() -> Path:
    """The ``migrations/`` folder that ships beside the ``chatd`` package."""
    return Path(__file__).resolve().parent.parent.parent / "migrations"


def is_sqlite(url: str | URL) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def _sqlite_file(url: URL) -> Path | None:
    database = url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


def sqlite_file(url: str | URL) -> Path | None:
    """The database file of a SQLite URL; None for another backend, an in-memory or a ``file:`` URI one."""
    parsed = make_url(url)
    return _sqlite_file(parsed) if parsed.get_backend_name() == "sqlite" else None


def configure_sqlite_connection(dbapi_connection: Any) -> None:
    """Set up a sqlite3 connection as every chatd connection to a SQLite file is (module docstring).

    The sqlite3 module's own transaction handling is switched off (it would only BEGIN before DML,
    leaving SELECTs and DDL outside the transaction): the caller issues BEGIN itself.
    """
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        # Pragmas must run outside a transaction; journal_mode is persistent in the file,
        # the others are per connection.
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    finally:
        cursor.close()


def _configure_sqlite(engine: AsyncEngine) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        configure_sqlite_connection(dbapi_connection)

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN")


def create_engine(url: str, *, echo: bool = False) -> AsyncEngine:
    """Create the async engine for ``url``; the caller disposes it (``await engine.dispose()``).

    For a SQLite file the parent folder is created. Every SQLite connection runs with WAL,
    ``foreign_keys=ON``, ``synchronous=FULL`` and a busy timeout, and a transaction covers every
    statement issued in it (reads included). Other backends get their defaults.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        path = _sqlite_file(parsed)
        if path is not None:
            path.expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_async_engine(parsed, echo=echo)
    if parsed.get_backend_name() == "sqlite":
        _configure_sqlite(engine)
    return engine


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    """A sessionmaker whose objects stay readable after commit (no implicit reload I/O)."""
    return async_sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str) -> Config:
    """An Alembic config for ``migrations/`` that targets ``url`` (no ini file is read)."""
    config = Config()
    config.set_main_option("script_location", str(migrations_path()))
    # Passed as an attribute, not a main option: configparser would treat '%' in a URL-encoded
    # password as interpolation.
    config.attributes[URL_ATTRIBUTE] = url
    return config


def _run_in_thread(name: str, target: Any, *args: Any) -> None:
    # Alembic's env.py drives the async engine with asyncio.run(), which cannot run on a thread
    # that already has a running loop; a worker thread gets a loop of its own.
    errors: list[BaseException] = []

    def work() -> None:
        try:
            target(*args)
        except BaseException as exc:  # re-raised in the caller's thread below
            errors.append(exc)

    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at ``url`` up to ``revision`` (creating a SQLite file if needed).

    Blocks until done and raises what Alembic raised. Safe to call with or without a running
    event loop in this thread (the migration runs on a worker thread); from async code prefer
    :func:`upgrade_async`, which does not block the loop.
    """
    if is_sqlite(url):
        path = _sqlite_file(make_url(url))
        if path is not None:
            path.expanduser().parent.mkdir(parents=True, exist_ok=True)
    _run_in_thread("chatd-db-upgrade", command.upgrade, alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    """Migrate the database at ``url`` down to ``revision`` (``"base"`` drops every table)."""
    _run_in_thread("chatd-db-downgrade", command.downgrade, alembic_config(url), revision)


async def upgrade_async(url: str, revision: str = "head") -> None:
    """:func:`upgrade` without blocking the running event loop."""
    await asyncio.to_thread(upgrade, url, revision)


async def downgrade_async(url: str, revision: str) -> None:
    """:func:`downgrade` without blocking the running event loop."""
    await asyncio.to_thread(downgrade, url, revision)


def current_revision(url: str) -> str | None:
    """The revision the database at ``url`` is at, or None for an empty database."""
    result: list[str | None] = []

    def read() -> None:
        result.append(asyncio.run(_current_revision(url)))

    _run_in_thread("chatd-db-revision", read)
    return result[0]


async def _current_revision(url: str) -> str | None:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(
                lambda sync_conn: MigrationContext.configure(sync_conn).get_current_revision()
            )
    finally:
        await engine.dispose()
