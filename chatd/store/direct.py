"""The turn's hot statements on a SQLite file, through the sqlite3 module on one thread of their own.

Every turn reads its conversation and appends two messages. Through the ORM each of those is an
async session, several thread hops through aiosqlite and rows turned into objects and then into
records: milliseconds of Python on the event loop per call, which many turns starting together wait for one
after another. Here one call is one hop to a thread that owns a plain sqlite3 connection and runs the whole
transaction there, a small fraction of that.

Only what a turn needs goes this way (:class:`SqliteStatements`, which :class:`chatd.store.repo.Repo` chooses
once, at construction, for a SQLite file): reading a session, its active messages, appending a message, creating
and deleting a session, and the snapshot records. Everything else, and every other backend, stays on
the ORM. Both write the same bytes and return equal records, which the store tests check by running
every repository test on both paths and comparing records read through each: timestamps in
SQLAlchemy's SQLite text form (naive UTC, microseconds), token ids as the little-endian uint32 blob,
usage as ``json.dumps`` text, booleans as 0/1.

The connection is configured as the ORM's are (WAL, foreign keys, ``synchronous=FULL``, busy
timeout). Writes begin with ``BEGIN IMMEDIATE`` and still queue for the repository's write lock, so
this process's writers take SQLite's lock in turn whichever path they use.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from chatd.domain import SessionRecord, SnapshotRecord
from chatd.errors import BadRequest, NotFound
from chatd.store.db import configure_sqlite_connection
from chatd.store.models import SessionRow, SnapshotRow, pack_token_ids, unpack_token_ids, utc
from chatd.store.records import MessageRecord

_T = TypeVar("_T")

Job = Callable[[sqlite3.Connection], Any]
"""Work for one transaction: gets the connection, returns what its caller hears back."""

_SESSION_COLUMNS = "session_id, title, created_at, updated_at, message_count, token_count"
_MESSAGE_COLUMNS = "id, session_id, position, role, content, token_ids, created_at, finish_reason, usage, unanswered"
_ACTIVE_MESSAGES = (
    f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE session_id = ? AND archived_by_edit IS NULL ORDER BY position"
)


def timestamp_text(value: datetime) -> str:
    """An aware datetime as the ORM stores it on SQLite: UTC, no offset, six digits of microseconds."""
    value = utc(value)
    return f"{value:%Y-%m-%d %H:%M:%S}.{value.microsecond:06d}"


def parse_timestamp(text: str) -> datetime:
    """The inverse of :func:`timestamp_text` (an aware UTC datetime)."""
    return utc(datetime.fromisoformat(text))


def usage_text(usage: dict[str, Any] | None) -> str | None:
    """A usage dict as the ORM's JSON column stores it (None is SQL NULL)."""
    return None if usage is None else json.dumps(usage)


def session_record(row: Sequence[Any]) -> SessionRecord:
    """A ``sessions`` row, in :data:`_SESSION_COLUMNS` order, as a record."""
    session_id, title, created_at, updated_at, message_count, token_count = row
    return SessionRecord(session_id=session_id, title=title, created_at=parse_timestamp(created_at),
                         updated_at=parse_timestamp(updated_at), message_count=message_count,
                         token_count=token_count)


def message_fields(row: Sequence[Any]) -> dict[str, Any]:
    """A ``messages`` row, in :data:`_MESSAGE_COLUMNS` order, as the fields of a message record."""
    message_id, session_id, position, role, content, token_ids, created_at, finish_reason, usage, unanswered = row
    return {
        "message_id": message_id, "session_id": session_id, "index": position, "role": role,
        "content": content, "token_ids": unpack_token_ids(token_ids), "created_at": parse_timestamp(created_at),
        "finish_reason": finish_reason, "usage": None if usage is None else json.loads(usage),
        "unanswered": bool(unanswered),
    }


def read_session(conn: sqlite3.Connection, session_id: str) -> SessionRecord | None:
    row = conn.execute(f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
    return None if row is None else session_record(row)


def read_messages(conn: sqlite3.Connection, session_id: str) -> list[dict[str, Any]]:
    return [message_fields(row) for row in conn.execute(_ACTIVE_MESSAGES, (session_id,))]


def append(conn: sqlite3.Connection, session_id: str, role: str, content: str, token_ids: tuple[int, ...],
           now: datetime, finish_reason: str | None, usage: dict[str, Any] | None, unanswered: bool,
           answers: int | None, title: str | None) -> dict[str, Any]:
    """Append a message as :meth:`Repo.append_message` does, inside the caller's transaction; the new
    message's record fields. NotFound for an unknown session."""
    stamp = timestamp_text(now)
    titled = "" if title is None else ", title = coalesce(nullif(title, ''), ?)"
    params: tuple[Any, ...] = (len(token_ids), stamp, *(() if title is None else (title,)), session_id)
    counted = conn.execute(
        "UPDATE sessions SET message_count = message_count + 1, token_count = token_count + ?, updated_at = ?"
        f"{titled} WHERE session_id = ? RETURNING message_count", params).fetchone()
    if counted is None:
        raise NotFound("session not found")
    position = int(counted[0]) - 1
    if answers is not None:
        conn.execute("UPDATE messages SET unanswered = 0 WHERE id = ? AND session_id = ?", (answers, session_id))
    cursor = conn.execute(
        "INSERT INTO messages (session_id, position, role, content, token_ids, num_tokens, created_at, "
        "finish_reason, usage, archived_by_edit, unanswered) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, ?)",
        (session_id, position, role, content, pack_token_ids(token_ids), len(token_ids), stamp, finish_reason,
         usage_text(usage), int(unanswered)))
    return {
        "message_id": cursor.lastrowid, "session_id": session_id, "index": position, "role": role,
        "content": content, "token_ids": token_ids, "created_at": utc(now), "finish_reason": finish_reason,
        # A copy: the returned record must not change when the caller's dict does.
        "usage": None if usage is None else dict(usage), "unanswered": unanswered,
    }


def create_session(conn: sqlite3.Connection, session_id: str, title: str, now: datetime) -> None:
    """Insert an empty session as :meth:`Repo.create_session` does, inside the caller's write transaction.
    BadRequest for an id already used."""
    stamp = timestamp_text(now)
    try:
        conn.execute(f"INSERT INTO sessions ({_SESSION_COLUMNS}) VALUES (?, ?, ?, ?, 0, 0)",
                     (session_id, title, stamp, stamp))
    except sqlite3.IntegrityError as exc:
        raise BadRequest("session id already exists") from exc


def delete_by_session(conn: sqlite3.Connection, table: str, session_id: str) -> bool:
    """Delete the row of ``table`` ("sessions", whose messages, edits and snapshot record go with it, or
    "snapshots") keyed by ``session_id``, inside the caller's write transaction; False when there was none."""
    if table not in ("sessions", "snapshots"):
        raise ValueError(f"no rows are deleted by session from {table!r}")
    return conn.execute(f"DELETE FROM {table} WHERE session_id = ?", (session_id,)).rowcount > 0


def put_snapshot(conn: sqlite3.Connection, session_id: str, file_name: str, num_tokens: int, file_bytes: int,
                 raw_bytes: int, fingerprint: str, ids_digest: str, created_at: datetime) -> None:
    """Record (or replace) the session's one snapshot as :meth:`Repo.put_snapshot` does, inside the caller's
    write transaction. NotFound for an unknown session."""
    if conn.execute("SELECT 1 FROM sessions WHERE session_id = ?", (session_id,)).fetchone() is None:
        raise NotFound("session not found")
    conn.execute(
        "INSERT INTO snapshots (session_id, file_name, num_tokens, file_bytes, raw_bytes, fingerprint, ids_digest, "
        "created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (session_id) DO UPDATE SET "
        "file_name = excluded.file_name, num_tokens = excluded.num_tokens, file_bytes = excluded.file_bytes, "
        "raw_bytes = excluded.raw_bytes, fingerprint = excluded.fingerprint, ids_digest = excluded.ids_digest, "
        "created_at = excluded.created_at",
        (session_id, file_name, num_tokens, file_bytes, raw_bytes, fingerprint, ids_digest,
         timestamp_text(created_at)))


class SqliteDirect:
    """One sqlite3 connection to a SQLite file, used from one thread; each call is one transaction there."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chatd-sqlite")
        self._conn: sqlite3.Connection | None = None  # opened on the thread, on first use
        self.committed = 0
        """Write transactions committed so far."""

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            conn = sqlite3.connect(self.path, isolation_level=None)
            try:
                configure_sqlite_connection(conn)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _run(self, begin: str, jobs: Sequence[Job]) -> list[Any]:
        conn = self._connection()
        conn.execute(begin)
        try:
            results = [job(conn) for job in jobs]
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        if begin != "BEGIN":
            self.committed += 1
        return results

    async def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        future = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # The transaction runs to its end on the thread regardless; the caller leaves once it has,
            # so whoever holds the write lock holds it until SQLite's lock is free again.
            if not future.done():
                await asyncio.wait([future])
            raise

    async def read(self, job: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``job`` in a read transaction (one snapshot of the database); what it returned."""
        results = await self._call(self._run, "BEGIN", (job,))
        return results[0]

    async def write(self, jobs: Sequence[Job]) -> list[Any]:
        """Run ``jobs`` in one write transaction, in order; their results once it committed. When one
        raises, the transaction is rolled back and that error raised."""
        return await self._call(self._run, "BEGIN IMMEDIATE", tuple(jobs))

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def close(self) -> None:
        """Close the connection and stop the thread (calls after this fail)."""
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._close)
        finally:
            self._executor.shutdown(wait=False)


class SqliteStatements:
    """A turn's statements on a SQLite file through :class:`SqliteDirect` (the repository's ``Statements`` there)."""

    def __init__(self, path: Path) -> None:
        self.direct = SqliteDirect(path)

    async def read_session(self, session_id: str) -> SessionRecord | None:
        return await self.direct.read(lambda conn: read_session(conn, session_id))

    async def read_conversation(self, session_id: str) -> tuple[SessionRecord, list[MessageRecord]]:
        def read(conn: sqlite3.Connection) -> tuple[SessionRecord | None, list[dict[str, Any]]]:
            session = read_session(conn, session_id)
            return session, [] if session is None else read_messages(conn, session_id)

        found, fields = await self.direct.read(read)
        if found is None:
            raise NotFound("session not found")
        return found, [MessageRecord(**message) for message in fields]

    def create_session(self, record: SessionRecord) -> Job:
        return lambda conn: create_session(conn, record.session_id, record.title, record.created_at)

    def append_message(self, session_id: str, role: str, content: str, ids: tuple[int, ...], now: datetime,
                       finish_reason: str | None, usage: dict[str, Any] | None, unanswered: bool,
                       answers: int | None, title: str | None) -> Job:
        return lambda conn: MessageRecord(**append(conn, session_id, role, content, ids, now, finish_reason, usage,
                                                   unanswered, answers, title))

    def delete_by_session(self, row: type[SessionRow] | type[SnapshotRow], session_id: str) -> Job:
        table = row.__tablename__
        return lambda conn: delete_by_session(conn, table, session_id)

    def put_snapshot(self, record: SnapshotRecord) -> Job:
        values = asdict(record)
        return lambda conn: put_snapshot(conn, **values)

    async def transaction(self, jobs: Sequence[Job]) -> list[Any]:
        return await self.direct.write(jobs)

    async def close(self) -> None:
        await self.direct.close()
