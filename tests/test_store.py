"""The conversation store's repository, on a real SQLite file and on a real PostgreSQL cluster.

Every test runs once per backend, and on a SQLite file twice: with a turn's calls on the plain sqlite3 path
(the default) and with everything on the ORM. The schema always comes from ``alembic upgrade head``. The
PostgreSQL variant starts a throwaway cluster of its own (initdb into a temporary folder); it fails
with install instructions when the server binaries or asyncpg are missing, and is skipped only
when ``CHATD_TEST_POSTGRES=0``.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import importlib.util
import itertools
import os
import pwd
import shutil
import socket
import sqlite3
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncEngine

from chatd.domain import SnapshotRecord
from chatd.errors import BadRequest, NotFound
from chatd.store.db import create_engine, downgrade_async, make_sessionmaker, upgrade_async
from chatd.store.models import Base, pack_token_ids, unpack_token_ids
from chatd.store.repo import Repo

INSTALL_HINT = (
    "the PostgreSQL store tests need Debian's server binaries and asyncpg: "
    "`apt-get install -y postgresql` and `.venv/bin/pip install asyncpg` "
    "(or set CHATD_TEST_POSTGRES=0 to skip them)"
)


def sess(name: str) -> str:
    """A valid session id (16 characters) that reads like ``name``."""
    return name.ljust(16, "_")


# -- a throwaway PostgreSQL cluster -------------------------------------------------------------


@dataclass
class PgCluster:
    bindir: Path
    port: int
    counter: Iterator[int]

    def new_database(self) -> str:
        """Create an empty database and return its async URL."""
        name = f"chatd_test_{next(self.counter)}"
        subprocess.run(
            [str(self.bindir / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "chatd", name],
            check=True,
            capture_output=True,
        )
        return f"postgresql+asyncpg://chatd@127.0.0.1:{self.port}/{name}"


def _pg_bindir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    if os.environ.get("CHATD_TEST_POSTGRES") == "0":
        pytest.skip("CHATD_TEST_POSTGRES=0")
    bindir = _pg_bindir()
    if bindir is None or importlib.util.find_spec("asyncpg") is None:
        pytest.fail(f"PostgreSQL not available: {INSTALL_HINT}", pytrace=False)
    # initdb refuses to run as root; the cluster then belongs to an unprivileged user.
    run_as: dict[str, Any] = {}
    base = Path(tempfile.mkdtemp(prefix="chatd-pg-"))
    if os.geteuid() == 0:
        user = next((u for u in ("postgres", "nobody") if _has_user(u)), None)
        if user is None:
            pytest.fail("running as root and neither user postgres nor nobody exists", pytrace=False)
        entry = pwd.getpwnam(user)
        os.chown(base, entry.pw_uid, entry.pw_gid)
        run_as = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
    data, sock, log = base / "data", base / "sock", base / "server.log"
    port = _free_port()

    def pg(*args: str) -> None:
        done = subprocess.run(args, capture_output=True, text=True, cwd=base, **run_as)
        if done.returncode != 0:
            server_log = log.read_text() if log.exists() else ""
            raise RuntimeError(f"{args[0]} failed:\n{done.stdout}{done.stderr}{server_log}")

    try:
        pg(str(bindir / "initdb"), "-D", str(data), "-U", "chatd", "--auth=trust", "-E", "UTF8")
        pg("mkdir", str(sock))
        # Durability does not matter for a throwaway cluster; speed does.
        options = (
            f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={sock} "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        )
        pg(str(bindir / "pg_ctl"), "start", "-w", "-D", str(data), "-l", str(log), "-o", options)
        try:
            yield PgCluster(bindir, port, itertools.count())
        finally:
            pg(str(bindir / "pg_ctl"), "stop", "-w", "-m", "fast", "-D", str(data))
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


# -- fixtures ----------------------------------------------------------------------------------


class FakeClock:
    """Strictly increasing time, one second per reading, so orderings are deterministic."""

    def __init__(self) -> None:
        self.now = datetime(2025, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        self.now += timedelta(seconds=1)
        return self.now


@pytest.fixture(params=["sqlite", "sqlite-orm", "postgresql"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def direct(backend: str) -> bool:
    """Whether repositories may take the plain sqlite3 path (it only exists on a SQLite file)."""
    return backend != "sqlite-orm"


@pytest.fixture
async def store_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if backend.startswith("sqlite"):
        url = f"sqlite+aiosqlite:///{tmp_path / 'data' / 'chatd.db'}"
    else:
        cluster: PgCluster = request.getfixturevalue("pg_cluster")
        url = cluster.new_database()
    await upgrade_async(url)
    return url


@pytest.fixture
async def engine(store_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(store_url)
    yield engine
    await engine.dispose()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def repo(engine: AsyncEngine, clock: FakeClock, backend: str, direct: bool) -> AsyncIterator[Repo]:
    repo = Repo(make_sessionmaker(engine), clock=clock, direct=direct)
    assert (repo.direct is not None) == (backend == "sqlite")
    yield repo
    await repo.close()


def commit_counter(repo: Repo, engine: AsyncEngine) -> Callable[[], int]:
    """How many write transactions the repository has committed since this call, on either path."""
    orm: list[int] = []
    event.listen(engine.sync_engine, "commit", lambda _conn: orm.append(1))
    start = 0 if repo.direct is None else repo.direct.committed
    return lambda: len(orm) + (0 if repo.direct is None else repo.direct.committed - start)


async def count_rows(engine: AsyncEngine, table: str, session_id: str) -> int:
    async with engine.connect() as conn:
        result = await conn.execute(
            text(f"SELECT COUNT(*) FROM {table} WHERE session_id = :sid"), {"sid": session_id}
        )
        return int(result.scalar_one())


def snapshot(session_id: str, name: str, when: datetime) -> SnapshotRecord:
    return SnapshotRecord(session_id, name, 7, 1234, 5678, "smollm2:fp32", "digest-" + name, when)


# -- tests -------------------------------------------------------------------------------------


def test_token_ids_are_little_endian_uint32() -> None:
    assert pack_token_ids([1, 0x01020304]) == b"\x01\x00\x00\x00\x04\x03\x02\x01"
    assert unpack_token_ids(pack_token_ids([0, 65535, 65536, 2**32 - 1])) == (0, 65535, 65536, 2**32 - 1)
    assert unpack_token_ids(b"") == ()
    for bad in ([-1], [2**32]):
        with pytest.raises(ValueError):
            pack_token_ids(bad)


async def test_create_and_get(repo: Repo) -> None:
    created = await repo.create_session(sess("s1"), "first")
    summary = (created.session_id, created.title, created.message_count, created.token_count)
    assert summary == (sess("s1"), "first", 0, 0)
    assert created.created_at.tzinfo is UTC and created.created_at == created.updated_at
    assert await repo.get_session(sess("s1")) == created
    assert await repo.get_session("nope") is None
    with pytest.raises(BadRequest):
        await repo.create_session(sess("s1"), "again")
    for bad_id in ("", "short", "x" * 65, "x" * 20 + "/"):
        with pytest.raises(BadRequest):
            await repo.create_session(bad_id, "t")
    assert await repo.create_session("x" * 64, "longest") is not None


async def test_list_paginate_filter_count(repo: Repo) -> None:
    for i in range(5):
        await repo.create_session(sess(f"s{i}"), f"title {i}")
    listed = await repo.list_sessions()
    assert [s.session_id for s in listed] == [sess("s4"), sess("s3"), sess("s2"), sess("s1"), sess("s0")]
    await repo.append_message(sess("s0"), "user", "hi", [1])  # activity moves s0 to the front
    assert [s.session_id for s in await repo.list_sessions(limit=2)] == [sess("s0"), sess("s4")]
    assert [s.session_id for s in await repo.list_sessions(limit=2, offset=2)] == [sess("s3"), sess("s2")]
    assert [s.session_id for s in await repo.list_sessions(limit=2, offset=4)] == [sess("s1")]
    assert await repo.list_sessions(offset=10) == []
    picked = await repo.list_sessions(session_ids={sess("s1"), sess("s3"), sess("unknown")})
    assert [s.session_id for s in picked] == [sess("s3"), sess("s1")]
    assert await repo.list_sessions(session_ids=[]) == []
    assert await repo.count_sessions() == 5
    assert await repo.count_sessions([sess("s1"), sess("s3"), sess("unknown")]) == 2
    assert await repo.count_sessions(set()) == 0
    assert await repo.all_session_ids() == [sess("s0"), sess("s1"), sess("s2"), sess("s3"), sess("s4")]


async def test_set_title(repo: Repo) -> None:
    before = await repo.create_session(sess("s"), "old")
    after = await repo.set_title(sess("s"), "new")
    assert after.title == "new" and after.updated_at > before.updated_at
    assert await repo.get_session(sess("s")) == after
    with pytest.raises(NotFound):
        await repo.set_title("nope", "x")


async def test_a_message_titles_an_untitled_session_in_its_own_transaction(repo: Repo) -> None:
    await repo.create_session(sess("t"), "")
    first = await repo.append_message(sess("t"), "user", "hello there", [1, 2], title="hello there")
    session, messages = await repo.get_conversation(sess("t"))
    assert session.title == "hello there" and session.message_count == 1
    assert messages == [first]
    await repo.append_message(sess("t"), "user", "again", [3], title="something else")
    session, messages = await repo.get_conversation(sess("t"))
    assert session.title == "hello there"  # a title is never replaced this way
    assert [m.content for m in messages] == ["hello there", "again"] and session.token_count == 3
    with pytest.raises(NotFound):
        await repo.get_conversation(sess("missing"))
    with pytest.raises(NotFound):  # nothing is written for an unknown session, title or not
        await repo.append_message(sess("missing"), "user", "x", [1], title="x")
    assert await repo.get_session(sess("missing")) is None


async def test_append_keeps_counts_and_token_ids_exact(repo: Repo) -> None:
    await repo.create_session(sess("s"), "t")
    turns: list[tuple[str, list[int]]] = [
        ("system", [1, 2, 3]),
        ("user", [0, 65535, 65536, 2**32 - 1]),
        ("assistant", []),
        ("user", list(range(100_000, 103_000))),
    ]
    appended = []
    for i, (role, ids) in enumerate(turns):
        message = await repo.append_message(sess("s"), role, f"text {i}", ids)
        assert (message.index, message.session_id, message.token_ids) == (i, sess("s"), tuple(ids))
        appended.append(message)
    usage = {"input_tokens": 12, "cached_tokens": 8, "cache_tier": "device"}
    reply = await repo.append_message(sess("s"), "assistant", "done", [7], finish_reason="length", usage=usage)
    appended.append(reply)
    assert reply.finish_reason == "length" and reply.usage == usage

    assert await repo.get_messages(sess("s")) == appended
    session = await repo.get_session(sess("s"))
    assert session is not None
    assert session.message_count == 5
    assert session.token_count == sum(len(ids) for _, ids in turns) + 1
    assert session.updated_at == reply.created_at

    with pytest.raises(NotFound):
        await repo.append_message("nope", "user", "x", [1])
    with pytest.raises(BadRequest):
        await repo.append_message(sess("s"), "robot", "x", [1])
    with pytest.raises(BadRequest):
        await repo.append_message(sess("s"), "assistant", "x", [1], finish_reason="bored")
    with pytest.raises(ValueError):
        await repo.append_message(sess("s"), "user", "x", [-1])
    assert await repo.get_session(sess("s")) == session  # failed appends left nothing behind


async def test_replace_from_archives_later_messages(repo: Repo, engine: AsyncEngine) -> None:
    await repo.create_session(sess("s"), "t")
    old = [await repo.append_message(sess("s"), role, f"m{i}", [i] * (i + 1))
           for i, role in enumerate(["system", "user", "assistant", "user"])]

    new, edit = await repo.replace_from(sess("s"), 1, "user", "edited", [42, 70000])
    assert (new.index, new.content, new.token_ids) == (1, "edited", (42, 70000))
    assert (edit.session_id, edit.index) == (sess("s"), 1)
    assert edit.archived == tuple(old[1:])
    assert await repo.get_messages(sess("s")) == [old[0], new]
    session = await repo.get_session(sess("s"))
    assert session is not None
    assert (session.message_count, session.token_count) == (2, 1 + 2)
    assert await count_rows(engine, "messages", sess("s")) == 5  # archived rows are kept

    # The conversation goes on after the edit, and a second edit archives its own branch.
    reply = await repo.append_message(sess("s"), "assistant", "r", [5, 5, 5])
    assert reply.index == 2
    newer, edit2 = await repo.replace_from(sess("s"), 0, "system", "sys2", [])
    assert edit2.archived == (old[0], new, reply)
    assert await repo.get_messages(sess("s")) == [newer]
    session = await repo.get_session(sess("s"))
    assert session is not None and (session.message_count, session.token_count) == (1, 0)
    assert await repo.list_edits(sess("s")) == [edit, edit2]
    assert edit2.edit_id > edit.edit_id


async def test_replace_from_rejects_bad_index(repo: Repo) -> None:
    await repo.create_session(sess("empty"), "t")
    await repo.create_session(sess("s"), "t")
    for i in range(3):
        await repo.append_message(sess("s"), "user", f"m{i}", [i])
    before = await repo.get_session(sess("s"))
    for index in (-1, 3, 10):
        with pytest.raises(BadRequest):
            await repo.replace_from(sess("s"), index, "user", "x", [1])
    with pytest.raises(BadRequest):
        await repo.replace_from(sess("empty"), 0, "user", "x", [1])
    with pytest.raises(BadRequest):
        await repo.replace_from(sess("s"), 0, "robot", "x", [1])
    with pytest.raises(NotFound):
        await repo.replace_from("nope", 0, "user", "x", [1])
    assert await repo.get_session(sess("s")) == before
    assert len(await repo.get_messages(sess("s"))) == 3
    assert await repo.list_edits(sess("s")) == []


async def test_unknown_session_reads(repo: Repo) -> None:
    await repo.create_session(sess("s"), "t")
    assert await repo.get_messages(sess("s")) == []
    with pytest.raises(NotFound):
        await repo.get_messages("nope")
    with pytest.raises(NotFound):
        await repo.list_edits("nope")


async def test_delete_cascades(repo: Repo, engine: AsyncEngine, clock: FakeClock) -> None:
    for sid in (sess("gone"), sess("kept")):
        await repo.create_session(sid, "t")
        for i in range(3):
            await repo.append_message(sid, "user", f"m{i}", [i, i])
        await repo.replace_from(sid, 1, "user", "edited", [9])
        await repo.put_snapshot(snapshot(sid, f"{sid}.kv", clock()))

    assert await repo.delete_session(sess("gone")) is True
    for table in ("messages", "edits", "snapshots", "sessions"):
        assert await count_rows(engine, table, sess("gone")) == 0, table
        assert await count_rows(engine, table, sess("kept")) > 0, table
    assert await repo.get_session(sess("gone")) is None
    assert await repo.get_snapshot(sess("gone")) is None
    with pytest.raises(NotFound):
        await repo.get_messages(sess("gone"))
    assert await repo.delete_session(sess("gone")) is False
    assert len(await repo.get_messages(sess("kept"))) == 2


async def test_snapshot_records(repo: Repo, clock: FakeClock) -> None:
    await repo.create_session(sess("a"), "t")
    await repo.create_session(sess("b"), "t")
    assert await repo.get_snapshot(sess("a")) is None and await repo.list_snapshots() == []

    first = snapshot(sess("a"), "a-1.kv", clock())
    await repo.put_snapshot(first)
    assert await repo.get_snapshot(sess("a")) == first
    second = snapshot(sess("b"), "b-1.kv", clock())
    await repo.put_snapshot(second)
    replaced = snapshot(sess("a"), "a-2.kv", clock())
    await repo.put_snapshot(replaced)  # upsert: still one record for sess("a")
    assert await repo.get_snapshot(sess("a")) == replaced
    assert await repo.list_snapshots() == [second, replaced]

    # A timestamp in another zone is stored as the same instant and read back in UTC.
    local = datetime(2025, 6, 1, 14, 0, tzinfo=UTC).astimezone(timezone(timedelta(hours=2)))
    await repo.put_snapshot(snapshot(sess("b"), "b-2.kv", local))
    got = await repo.get_snapshot(sess("b"))
    assert got is not None and got.created_at == local and got.created_at.tzinfo is UTC

    with pytest.raises(NotFound):
        await repo.put_snapshot(snapshot("nope", "x.kv", clock()))
    with pytest.raises(ValueError):
        await repo.put_snapshot(snapshot(sess("a"), "naive.kv", datetime(2025, 1, 1)))
    assert await repo.delete_snapshot(sess("a")) is True
    assert await repo.delete_snapshot(sess("a")) is False
    assert await repo.get_snapshot(sess("a")) is None
    assert [s.session_id for s in await repo.list_snapshots()] == [sess("b")]
    assert await repo.get_session(sess("a")) is not None  # the session outlives its snapshot


async def test_concurrent_appends_all_land(repo: Repo) -> None:
    await repo.create_session(sess("a"), "t")
    await repo.create_session(sess("b"), "t")

    async def writer(sid: str, n: int) -> None:
        for i in range(n):
            await repo.append_message(sid, "user", f"{sid}{i}", [i])

    # Different sessions from separate tasks, and several tasks racing on the same session.
    await asyncio.gather(writer(sess("a"), 10), writer(sess("b"), 10), writer(sess("a"), 10), writer(sess("b"), 10))
    for sid in (sess("a"), sess("b")):
        messages = await repo.get_messages(sid)
        assert [m.index for m in messages] == list(range(20))
        # Each of the two writers' ten messages landed exactly once.
        assert sorted(m.content for m in messages) == sorted(2 * [f"{sid}{i}" for i in range(10)])
        session = await repo.get_session(sid)
        assert session is not None and (session.message_count, session.token_count) == (20, 20)


async def test_appends_that_queue_commit_together_and_fail_alone(repo: Repo, engine: AsyncEngine) -> None:
    await repo.create_session(sess("a"), "")
    await repo.create_session(sess("b"), "")
    commits = commit_counter(repo, engine)
    # Twelve appends at once, one of them to a session that does not exist.
    targets = [sess("a"), sess("b"), sess("a"), sess("missing"), sess("b"), *[sess("a")] * 7]
    results = await asyncio.gather(
        *(repo.append_message(sid, "user", f"m{i}", [i], title=f"t{i}") for i, sid in enumerate(targets)),
        return_exceptions=True)
    appends_committed = commits()
    assert isinstance(results[3], NotFound)
    assert all(not isinstance(r, BaseException) for i, r in enumerate(results) if i != 3)
    for sid, count in ((sess("a"), 9), (sess("b"), 2)):
        session, messages = await repo.get_conversation(sid)
        assert [m.index for m in messages] == list(range(count)) and session.message_count == count
        # The title is the one the session's first stored message came with; later ones kept it.
        assert session.title == "t" + messages[0].content.removeprefix("m")
    assert await repo.get_session(sess("missing")) is None
    if engine.dialect.name == "sqlite":
        # The twelve queued together and went in one transaction, which the failing one rolled back, so
        # each ran again in one of its own: the eleven that succeed committed once each.
        assert appends_committed == 11, appends_committed
    else:
        assert appends_committed == 11  # PostgreSQL: one transaction per append (its row locks order them)
    commits = commit_counter(repo, engine)
    await asyncio.gather(*(repo.append_message(sess("b"), "assistant", f"r{i}", [i]) for i in range(8)))
    assert commits() == (1 if engine.dialect.name == "sqlite" else 8)  # SQLite: the eight in one transaction
    _, messages = await repo.get_conversation(sess("b"))
    assert [m.index for m in messages] == list(range(10))


async def test_data_survives_reopen(store_url: str, clock: FakeClock, direct: bool) -> None:
    first = create_engine(store_url)
    repo = Repo(make_sessionmaker(first), clock=clock, direct=direct)
    await repo.create_session(sess("s"), "persisted")
    await repo.append_message(sess("s"), "user", "héllo ✓", [1, 70000], usage={"k": [1, 2]})
    await repo.replace_from(sess("s"), 0, "user", "edited", [2])
    await repo.put_snapshot(snapshot(sess("s"), "s.kv", clock()))
    state = (await repo.get_session(sess("s")), await repo.get_messages(sess("s")), await repo.list_edits(sess("s")),
             await repo.get_snapshot(sess("s")))
    await repo.close()
    await first.dispose()

    second = create_engine(store_url)
    reopened = Repo(make_sessionmaker(second), direct=direct)
    try:
        assert (await reopened.get_session(sess("s")), await reopened.get_messages(sess("s")),
                await reopened.list_edits(sess("s")), await reopened.get_snapshot(sess("s"))) == state
    finally:
        await reopened.close()
        await second.dispose()


async def test_migrated_schema_matches_models(store_url: str, engine: AsyncEngine) -> None:
    def compare(sync_conn: Any) -> list[Any]:
        context = MigrationContext.configure(sync_conn, opts={"compare_type": True})
        return list(compare_metadata(context, Base.metadata))

    async with engine.connect() as conn:
        assert await conn.run_sync(compare) == []
    # The downgrade works on this backend too, and the schema comes back the same.
    await downgrade_async(store_url, "base")
    async with engine.connect() as conn:
        assert await conn.run_sync(compare) != []
    await upgrade_async(store_url)
    async with engine.connect() as conn:
        assert await conn.run_sync(compare) == []


# -- the plain sqlite3 path against the ORM ------------------------------------------------------------------


async def _one_history(repo: Repo) -> list[Any]:
    """The same calls on any repository; everything they returned."""
    returned: list[Any] = [await repo.create_session(sess("h"), "")]
    user = await repo.append_message(sess("h"), "user", "héllo ✓ ' \" \\", [0, 1, 70000, 2**32 - 1], unanswered=True,
                                     title="first title")
    returned.append(user)
    usage = {"input_tokens": 4, "cache_tier": "gpu", "nested": {"ratio": 0.25, "list": [1, None]}, "ok": True}
    returned.append(await repo.append_message(sess("h"), "assistant", "réply", [5, 6], finish_reason="stop",
                                              usage=usage, answers=user.message_id, title="not used"))
    returned.append(await repo.append_message(sess("h"), "user", "", [], unanswered=True))
    returned.append(await repo.replace_from(sess("h"), 2, "user", "edited", [9], unanswered=True))
    returned.append(await repo.append_message(sess("h"), "assistant", "again", [7], finish_reason="length"))
    returned += [await repo.get_conversation(sess("h")), await repo.get_messages(sess("h")),
                 await repo.get_session(sess("h")), await repo.list_edits(sess("h"))]
    # Snapshot records: one, then replaced by one stored from another zone with microseconds (the row the
    # tables are compared on); none for an unknown session.
    await repo.put_snapshot(snapshot(sess("h"), "h-1.kv", datetime(2026, 12, 7, 1, 2, 3, tzinfo=UTC)))
    returned.append(await repo.get_snapshot(sess("h")))
    east = timezone(timedelta(hours=5, minutes=30))
    await repo.put_snapshot(SnapshotRecord(sess("h"), "h-2.kv", 6, 1000, 4000, "smollm2:int8", "d2",
                                           datetime(2026, 12, 6, 23, 59, 59, 123456, tzinfo=east)))
    returned += [await repo.get_snapshot(sess("h")), await repo.list_snapshots()]
    with pytest.raises(NotFound):
        await repo.put_snapshot(snapshot(sess("nope"), "x.kv", datetime(2026, 12, 7, tzinfo=UTC)))
    # Deleting: a snapshot record, then a whole session with its messages and edits.
    await repo.create_session(sess("gone"), "going")
    await repo.append_message(sess("gone"), "user", "a", [1])
    await repo.replace_from(sess("gone"), 0, "user", "b", [2])
    await repo.put_snapshot(snapshot(sess("gone"), "gone.kv", datetime(2026, 12, 7, 2, tzinfo=UTC)))
    returned += [await repo.delete_snapshot(sess("gone")), await repo.delete_snapshot(sess("gone")),
                 await repo.delete_session(sess("gone")), await repo.delete_session(sess("gone")),
                 await repo.get_session(sess("gone"))]
    return returned


def _rows(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return {table: conn.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall()
                for table in ("sessions", "messages", "edits", "snapshots")}


async def test_the_direct_path_stores_and_returns_what_the_orm_does(tmp_path: Path) -> None:
    # One history through each path, each in a file of its own with the same clock: the same records
    # come back and the same bytes are stored.
    results, tables = [], []
    for direct in (True, False):
        path = tmp_path / f"{direct}.db"
        url = f"sqlite+aiosqlite:///{path}"
        await upgrade_async(url)
        engine = create_engine(url)
        repo = Repo(make_sessionmaker(engine), clock=FakeClock(), direct=direct)
        assert (repo.direct is not None) == direct
        try:
            results.append(await _one_history(repo))
        finally:
            await repo.close()
            await engine.dispose()
        tables.append(_rows(path))
    assert results[0] == results[1]
    assert tables[0] == tables[1]
    assert [m.content for m in results[0][7]] == ["héllo ✓ ' \" \\", "réply", "edited", "again"]  # get_messages
    first, replaced, listed = results[0][-8:-5]
    assert first.file_name == "h-1.kv" and listed == [replaced] and replaced.file_name == "h-2.kv"
    assert replaced.created_at == datetime(2026, 12, 6, 18, 29, 59, 123456, tzinfo=UTC)
    assert replaced.created_at.tzinfo is UTC
    assert results[0][-5:] == [True, False, True, False, None]  # deleted once, then nothing left
    assert [row[1] for row in tables[0]["snapshots"]] == ["h-2.kv"]  # compared above, byte for byte
    assert {row[0] for row in tables[0]["sessions"]} == {sess("h")}
    assert tables[0]["messages"][1][9] == '{"input_tokens": 4, "cache_tier": "gpu", "nested": {"ratio": 0.25, ' \
                                          '"list": [1, null]}, "ok": true}'


async def test_each_path_reads_what_the_other_wrote(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'shared.db'}"
    await upgrade_async(url)
    engine = create_engine(url)
    clock = FakeClock()
    fast, orm = (Repo(make_sessionmaker(engine), clock=clock, direct=d) for d in (True, False))
    try:
        await orm.create_session(sess("x"), "")
        for i in range(6):
            writer = (fast, orm)[i % 2]
            await writer.append_message(sess("x"), ("user", "assistant")[i % 2], f"m{i}", [i] * i,
                                        usage=None if i % 3 else {"i": i}, unanswered=i == 5, title=f"t{i}")
        assert await fast.get_conversation(sess("x")) == await orm.get_conversation(sess("x"))
        assert await fast.get_session(sess("x")) == await orm.get_session(sess("x"))
        session, messages = await fast.get_conversation(sess("x"))
        assert session.title == "t0" and session.message_count == 6 and session.token_count == 15
        assert [m.usage for m in messages] == [{"i": 0}, None, None, {"i": 3}, None, None]
        assert [m.unanswered for m in messages] == [False] * 5 + [True]
        assert all(m.created_at.tzinfo is UTC for m in messages) and session.updated_at == messages[-1].created_at
        # Appends from both at once still take positions in turn.
        await asyncio.gather(*(r.append_message(sess("x"), "user", "c", [1]) for r in (fast, orm) * 4))
        assert [m.index for m in await orm.get_messages(sess("x"))] == list(range(14))
        with pytest.raises(NotFound):
            await fast.get_conversation(sess("nope"))
        assert await fast.get_session(sess("nope")) is None
        # A snapshot record written on the direct path reads back on the ORM, and replaced there, here.
        written = snapshot(sess("x"), "x-1.kv", datetime(2026, 12, 6, 22, 1, 2, 345678, tzinfo=UTC))
        await fast.put_snapshot(written)
        assert await orm.get_snapshot(sess("x")) == written
        replaced = snapshot(sess("x"), "x-2.kv", datetime(2026, 12, 6, 22, 5, tzinfo=UTC))
        await orm.put_snapshot(replaced)
        await fast.put_snapshot(replaced)
        assert await orm.list_snapshots() == [replaced]
    finally:
        await fast.close()
        await orm.close()
        await engine.dispose()
