"""Alembic migrations and SQLite connection settings, on real SQLite files."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text

from chatd.store.db import (
    alembic_config,
    create_engine,
    current_revision,
    downgrade,
    migrations_path,
    upgrade,
    upgrade_async,
)
from chatd.store.models import Base

TABLES = {"sessions", "messages", "edits", "snapshots"}
REPO_ROOT = Path(__file__).resolve().parent.parent


def sqlite_url(path: Path) -> str:
    return f"sqlite+aiosqlite:///{path}"


def tables(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    return {name for (name,) in rows} - {"sqlite_sequence"}


def head() -> str:
    revision = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    assert revision is not None
    return revision


def test_migrations_folder_ships_beside_the_package() -> None:
    assert migrations_path() == REPO_ROOT / "migrations"
    assert (migrations_path() / "env.py").is_file()


def test_upgrade_creates_tables_in_a_new_folder(tmp_path: Path) -> None:
    path = tmp_path / "not" / "yet" / "there" / "chatd.db"
    assert current_revision(sqlite_url(path)) is None
    upgrade(sqlite_url(path))
    assert tables(path) == TABLES | {"alembic_version"}
    assert current_revision(sqlite_url(path)) == head()
    upgrade(sqlite_url(path))  # already at head: nothing to do, no error
    assert current_revision(sqlite_url(path)) == head()


def test_downgrade_then_upgrade_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "chatd.db"
    url = sqlite_url(path)
    upgrade(url)
    with sqlite3.connect(path) as conn:
        schema = sorted(conn.execute("SELECT type, name, sql FROM sqlite_master").fetchall())
    downgrade(url, "base")
    assert tables(path) == {"alembic_version"}
    assert current_revision(url) is None
    upgrade(url, "head")
    with sqlite3.connect(path) as conn:
        assert sorted(conn.execute("SELECT type, name, sql FROM sqlite_master").fetchall()) == schema


async def test_pragmas_through_create_engine(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "chatd.db")
    await upgrade_async(url)
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            pragma = {
                name: (await conn.execute(text(f"PRAGMA {name}"))).scalar_one()
                for name in ("journal_mode", "foreign_keys", "synchronous", "busy_timeout")
            }
    finally:
        await engine.dispose()
    assert pragma["journal_mode"] == "wal"
    assert pragma["foreign_keys"] == 1
    assert pragma["synchronous"] == 2  # FULL
    assert pragma["busy_timeout"] > 0


async def test_create_engine_makes_parent_folder(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "chatd.db"
    engine = create_engine(sqlite_url(path))
    try:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
    finally:
        await engine.dispose()
    assert path.is_file()


async def test_sync_upgrade_inside_a_running_loop(tmp_path: Path) -> None:
    # The server's lifespan may call the plain function; it must not trip over this loop.
    path = tmp_path / "chatd.db"
    upgrade(sqlite_url(path))
    assert TABLES <= tables(path)


async def test_schema_matches_models(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "chatd.db")

    def compare(sync_conn: Any) -> list[Any]:
        context = MigrationContext.configure(sync_conn, opts={"compare_type": True})
        return list(compare_metadata(context, Base.metadata))

    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            # The comparison is live: an empty database differs from the models.
            assert await conn.run_sync(compare) != []
        await upgrade_async(url)
        async with engine.connect() as conn:
            assert await conn.run_sync(compare) == []
            # compare_metadata does not look at index predicates; check the partial index here.
            sql = (
                await conn.execute(
                    text("SELECT sql FROM sqlite_master WHERE name = 'uq_messages_active_position'")
                )
            ).scalar_one()
    finally:
        await engine.dispose()
    assert "UNIQUE" in sql and sql.endswith("WHERE archived_by_edit IS NULL")


FAILING_REVISION = """
import sqlalchemy as sa
from alembic import op

revision = "9999"
down_revision = "{head}"
branch_labels = None
depends_on = None


def upgrade():
    op.create_table("half_done", sa.Column("id", sa.Integer(), primary_key=True))
    op.add_column("sessions", sa.Column("extra", sa.Text(), nullable=True))
    raise RuntimeError("migration failed halfway")


def downgrade():
    pass
"""


def test_failed_migration_leaves_nothing_behind(tmp_path: Path) -> None:
    # A copy of migrations/ with one more revision that fails after some DDL: on SQLite too the
    # whole upgrade is one transaction, so neither the table nor the column may remain.
    scripts = tmp_path / "migrations"
    shutil.copytree(migrations_path(), scripts, ignore=shutil.ignore_patterns("__pycache__"))
    (scripts / "versions" / "9999_fail.py").write_text(FAILING_REVISION.replace("{head}", head()))
    path = tmp_path / "chatd.db"
    url = sqlite_url(path)
    upgrade(url, head())
    config = alembic_config(url)
    config.set_main_option("script_location", str(scripts))
    with pytest.raises(RuntimeError, match="failed halfway"):
        command.upgrade(config, "head")
    assert current_revision(url) == head()
    assert "half_done" not in tables(path)
    with sqlite3.connect(path) as conn:
        columns = {row[1] for row in conn.execute("PRAGMA table_info(sessions)")}
    assert "extra" not in columns


def test_alembic_command_line_takes_the_url(tmp_path: Path) -> None:
    path = tmp_path / "cli" / "chatd.db"
    done = subprocess.run(
        [sys.executable, "-m", "alembic", "-c", str(REPO_ROOT / "alembic.ini"),
         "-x", f"url={sqlite_url(path)}", "upgrade", "head"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert tables(path) == TABLES | {"alembic_version"}


def test_0002_marks_existing_messages_answered_and_downgrades_in_place(tmp_path: Path) -> None:
    path = tmp_path / "chatd.db"
    url = sqlite_url(path)
    upgrade(url, "0001")
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO sessions VALUES ('s' || hex(randomblob(8)), 't', '2026-01-01', '2026-01-01', 1, 1)")
        conn.execute("INSERT INTO messages (session_id, position, role, content, token_ids, num_tokens, created_at) "
                     "SELECT session_id, 0, 'user', 'hi', x'01000000', 1, '2026-01-01' FROM sessions")
    upgrade(url, "0002")
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT content, unanswered FROM messages").fetchall() == [("hi", 0)]
        index_sql = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'uq_messages_active_position'")
        before = index_sql.fetchone()
    downgrade(url, "0001")
    with sqlite3.connect(path) as conn:
        assert "unanswered" not in {row[1] for row in conn.execute("PRAGMA table_info(messages)")}
        assert conn.execute("SELECT content FROM messages").fetchall() == [("hi",)]
        index_sql = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'uq_messages_active_position'")
        assert index_sql.fetchone() == before
