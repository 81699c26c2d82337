"""The conversation store's repository: queries in, frozen dataclasses out.

Every public method is one database transaction: it either happens completely or not at all, and
what it returns was read inside that transaction. No ORM object ever leaves this module.

Concurrency: methods that write start with a write to the session row (an UPDATE), which takes
SQLite's write lock or PostgreSQL's row lock before anything is read. Two writers to the same
session therefore run one after the other, and SQLite never has to abort a transaction whose
snapshot went stale. On SQLite, this process's write transactions also queue for an asyncio lock
before they begin, so they take the database's single write lock in turn: a writer that found it
taken would wait in SQLite's busy handler, which sleeps in steps of up to 100 ms, so many turns starting
at once would store their messages hundreds of milliseconds late. A writer in another process still waits
for the lock (busy timeout) rather than fail.

Appended messages are committed in groups on SQLite: the appends that queue while a transaction runs
go into the next one together, one BEGIN and one COMMIT (one disk sync) for all of them, and each
caller hears back only once that transaction committed. When one of them fails, the group is rolled
back and each is run again in a transaction of its own, so an append still happens completely or not
at all, on its own. A caller cancelled after its append joined a running group does not stop it: the
append may still be stored.

Timestamps are timezone-aware UTC on the way in and out (SQLite drops the offset; reads restore it).

On a SQLite file, a turn's own calls (reading a session or its conversation, appending a message), creating
and deleting a session and the KV layer's snapshot records (each eviction and background persist writes one,
each snapshot deleted for the disk budget removes one) skip the ORM:
:mod:`chatd.store.direct` runs each transaction in one hop to a thread with a plain sqlite3 connection.
They write and return the same as the ORM path would (``Repo(..., direct=False)`` keeps everything on the
ORM, as on PostgreSQL).
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, Protocol, TypeVar

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from chatd.domain import (
    FINISH_REASONS,
    ROLES,
    SESSION_ID_MAX_CHARS,
    SESSION_ID_MIN_CHARS,
    SessionRecord,
    SnapshotRecord,
    is_session_id,
)
from chatd.errors import BadRequest, NotFound
from chatd.store.db import sqlite_file
from chatd.store.direct import SqliteDirect, SqliteStatements
from chatd.store.models import MAX_TOKEN_ID, EditRow, MessageRow, SessionRow, SnapshotRow, utc
from chatd.store.orm import (
    NO_SYNC,
    OrmStatements,
    message_record,
    new_message,
    record_of,
    update_session,
)
from chatd.store.records import EditRecord, MessageRecord

_T = TypeVar("_T")


class Statements(Protocol):
    """A turn's statements on one path: the ORM (:class:`chatd.store.orm.OrmStatements`) or, on a SQLite file, plain
    sqlite3 on a thread of its own (:class:`chatd.store.direct.SqliteStatements`). The repository picks one at
    construction and never asks again. Reads run in a transaction of their own; writes are jobs, run in the
    repository's write groups through :meth:`transaction`. Both write the same bytes and return equal records."""

    async def read_session(self, session_id: str) -> SessionRecord | None: ...

    async def read_conversation(self, session_id: str) -> tuple[SessionRecord, list[MessageRecord]]:
        """The session and its active messages, read together. NotFound."""
        ...

    def create_session(self, record: SessionRecord) -> Callable[[Any], Any]:
        """A job inserting the empty session; it raises BadRequest for an id already used."""
        ...

    def append_message(self, session_id: str, role: str, content: str, ids: tuple[int, ...], now: datetime,
                       finish_reason: str | None, usage: dict[str, Any] | None, unanswered: bool,
                       answers: int | None, title: str | None) -> Callable[[Any], Any]:
        """A job appending the message as :meth:`Repo.append_message` says; it returns its MessageRecord."""
        ...

    def delete_by_session(self, row: type[SessionRow] | type[SnapshotRow], session_id: str) -> Callable[[Any], Any]:
        """A job deleting ``row``'s one row keyed by ``session_id``; it returns whether there was one."""
        ...

    def put_snapshot(self, record: SnapshotRecord) -> Callable[[Any], Any]:
        """A job recording (or replacing) the session's snapshot; NotFound for an unknown session."""
        ...

    async def transaction(self, jobs: Sequence[Callable[[Any], Any]]) -> list[Any]:
        """Run ``jobs`` (made by this object) in one write transaction, in order; their results once it
        committed. When one raises, the transaction is rolled back and that error raised."""
        ...

    async def close(self) -> None: ...


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _token_ids(token_ids: Sequence[int]) -> tuple[int, ...]:
    # Checked here so a bad id fails before the transaction, as a plain ValueError.
    try:
        ids = tuple(map(operator.index, token_ids))
    except TypeError as exc:
        raise ValueError(f"token ids must be integers: {exc}") from exc
    if ids and (min(ids) < 0 or max(ids) > MAX_TOKEN_ID):
        raise ValueError(f"token ids must be in 0..{MAX_TOKEN_ID}")
    return ids


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise BadRequest(f"role must be one of {', '.join(ROLES)}")


@dataclass
class _Grouped(Generic[_T]):
    """A write waiting for its group: what to run in the transaction, and where its caller waits."""

    job: Callable[[Any], Any]
    """Given the transaction (an AsyncSession, or a sqlite3 connection on the direct path), does the write:
    awaitable on the ORM, plain on the direct path."""
    done: asyncio.Future[_T]

    def succeed(self, result: _T) -> None:
        if not self.done.done():
            self.done.set_result(result)

    def fail(self, error: BaseException) -> None:
        if self.done.done():
            return
        if isinstance(error, asyncio.CancelledError):
            self.done.cancel()
        else:
            self.done.set_exception(error)


def _session_filter(session_ids: Collection[str] | None) -> list[Any]:
    return [] if session_ids is None else [SessionRow.session_id.in_(list(session_ids))]


class Repo:
    """Async access to sessions, messages, edits and snapshot records.

    ``clock`` returns the current time (aware); tests may pass a fake one. ``direct=False`` keeps a SQLite
    file's turn calls on the ORM too (module docstring). :meth:`close` when done.
    """

    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        *,
        clock: Callable[[], datetime] = _utcnow,
        direct: bool = True,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._clock = clock
        bind = sessionmaker.kw.get("bind")
        sqlite = bind is not None and bind.dialect.name == "sqlite"
        self._write_lock: asyncio.Lock | None = asyncio.Lock() if sqlite else None
        self._queued: list[_Grouped[Any]] = []  # appends waiting for the next group (SQLite)
        self._drainer: asyncio.Task[None] | None = None
        path = sqlite_file(bind.url) if bind is not None and sqlite and direct else None
        self._statements: Statements = OrmStatements(sessionmaker) if path is None else SqliteStatements(path)

    @property
    def direct(self) -> SqliteDirect | None:
        """The plain sqlite3 path a turn's calls take, or None when they use the ORM."""
        return self._statements.direct if isinstance(self._statements, SqliteStatements) else None

    async def close(self) -> None:
        """Release the direct path's connection and thread (the ORM engine is the caller's to dispose)."""
        await self._statements.close()

    @contextlib.asynccontextmanager
    async def _writing(self) -> AsyncIterator[AsyncSession]:
        """A write transaction; on SQLite, after this process's earlier ones (module docstring)."""
        if self._write_lock is None:
            async with self._sessionmaker.begin() as db:
                yield db
            return
        async with self._write_lock, self._sessionmaker.begin() as db:
            yield db

    async def _in_group(self, job: Callable[[Any], Any]) -> Any:
        """Run ``job`` (made by the statements backend) in a write transaction: on SQLite in the next group (module
        docstring), else in one of its own. Returns what it returned, once its transaction committed."""
        if self._write_lock is None:
            (result,) = await self._statements.transaction([job])
            return result
        entry = _Grouped(job, asyncio.get_running_loop().create_future())
        self._queued.append(entry)
        if self._drainer is None:
            self._drainer = asyncio.ensure_future(self._drain())
        return await entry.done

    async def _drain(self) -> None:
        try:
            while self._queued:
                group = [entry for entry in self._queued if not entry.done.done()]  # a cancelled caller's: dropped
                self._queued = []
                if group:
                    assert self._write_lock is not None
                    async with self._write_lock:
                        await self._commit_group(group)
        finally:
            self._drainer = None

    async def _transaction(self, jobs: Sequence[Callable[[Any], Any]]) -> list[Any]:
        """Run grouped jobs in one write transaction, on the path they were made for."""
        return await self._statements.transaction(jobs)

    async def _commit_group(self, group: list[_Grouped[Any]]) -> None:
        try:
            results = await self._transaction([entry.job for entry in group])
        except BaseException as exc:
            if len(group) == 1 or not isinstance(exc, Exception):
                for entry in group:
                    entry.fail(exc)
                if not isinstance(exc, Exception):
                    raise
                return
            # Each again on its own, so only the one that fails fails.
            for entry in group:
                try:
                    (result,) = await self._transaction([entry.job])
                except Exception as error:
                    entry.fail(error)
                else:
                    entry.succeed(result)
            return
        for entry, result in zip(group, results, strict=True):
            entry.succeed(result)

    def _now(self) -> datetime:
        return utc(self._clock())

    async def _delete_by_session(self, row: type[SessionRow] | type[SnapshotRow], session_id: str) -> bool:
        """Delete the one row of ``row``'s table keyed by ``session_id``; False when there was none."""
        found: bool = await self._in_group(self._statements.delete_by_session(row, session_id))
        return found

    # -- sessions ------------------------------------------------------------------------------

    async def create_session(self, session_id: str, title: str) -> SessionRecord:
        """Create an empty session. BadRequest for an id outside the session-id format, or already used."""
        if not is_session_id(session_id):
            raise BadRequest(f"session id must be {SESSION_ID_MIN_CHARS}..{SESSION_ID_MAX_CHARS} characters of "
                             "[A-Za-z0-9_-]")
        now = self._now()
        record = SessionRecord(session_id=session_id, title=title, created_at=now, updated_at=now,
                               message_count=0, token_count=0)
        await self._in_group(self._statements.create_session(record))
        return record

    async def get_session(self, session_id: str) -> SessionRecord | None:
        """The session, or None when there is none with that id."""
        return await self._statements.read_session(session_id)

    async def list_sessions(
        self, *, limit: int = 50, offset: int = 0, session_ids: Collection[str] | None = None
    ) -> list[SessionRecord]:
        """A page of sessions, most recently updated first (ties by id, so pages are stable).

        ``session_ids`` keeps only those sessions (unknown ids are ignored); it is sent as
        bound parameters, so keep it to a few thousand ids.
        """
        if limit < 0 or offset < 0:
            raise BadRequest("limit and offset must not be negative")
        query = (
            select(SessionRow)
            .where(*_session_filter(session_ids))
            .order_by(SessionRow.updated_at.desc(), SessionRow.session_id)
            .limit(limit)
            .offset(offset)
        )
        async with self._sessionmaker.begin() as db:
            return [record_of(SessionRecord, row) for row in (await db.scalars(query))]

    async def count_sessions(self, session_ids: Collection[str] | None = None) -> int:
        """How many sessions exist (of ``session_ids``, when given)."""
        query = select(func.count()).select_from(SessionRow).where(*_session_filter(session_ids))
        async with self._sessionmaker.begin() as db:
            return int((await db.execute(query)).scalar_one())

    async def all_session_ids(self) -> list[str]:
        """Every session id, sorted."""
        async with self._sessionmaker.begin() as db:
            result = await db.scalars(select(SessionRow.session_id).order_by(SessionRow.session_id))
            return list(result)

    async def set_title(self, session_id: str, title: str) -> SessionRecord:
        """Rename a session; updated_at moves to now. NotFound for an unknown session."""
        async with self._writing() as db:
            updated = await db.scalars(
                update(SessionRow)
                .where(SessionRow.session_id == session_id)
                .values(title=title, updated_at=self._now())
                .returning(SessionRow),
                execution_options=NO_SYNC,
            )
            row = updated.first()
            if row is None:
                raise NotFound("session not found")
            return record_of(SessionRecord, row)

    async def delete_session(self, session_id: str) -> bool:
        """Delete a session with its messages, edits and snapshot record; False if unknown.

        The snapshot file on disk is the caller's to remove.
        """
        return await self._delete_by_session(SessionRow, session_id)

    # -- messages ------------------------------------------------------------------------------

    async def get_messages(self, session_id: str) -> list[MessageRecord]:
        """The active conversation, ordered by index (0..message_count-1). NotFound."""
        _, messages = await self._statements.read_conversation(session_id)
        return messages

    async def get_conversation(self, session_id: str) -> tuple[SessionRecord, list[MessageRecord]]:
        """The session and its active conversation (as :meth:`get_messages`), read together. NotFound."""
        return await self._statements.read_conversation(session_id)

    async def append_message(
        self,
        session_id: str,
        role: str,
        content: str,
        token_ids: Sequence[int],
        *,
        finish_reason: str | None = None,
        usage: dict[str, Any] | None = None,
        unanswered: bool = False,
        answers: int | None = None,
        title: str | None = None,
    ) -> MessageRecord:
        """Append a message at index message_count; counts and updated_at change with it.

        ``unanswered`` marks a user message whose reply is still to come; ``answers`` is the message id of
        the user message a reply answers, whose mark is cleared in the same transaction (so either the
        reply is stored and the mark is gone, or neither happened). ``title`` becomes the session's title
        in the same transaction when it has none (an empty one).

        NotFound for an unknown session; BadRequest for an unknown role or finish reason;
        ValueError for token ids outside uint32.
        """
        _check_role(role)
        if finish_reason is not None and finish_reason not in FINISH_REASONS:
            raise BadRequest(f"finish_reason must be one of {', '.join(FINISH_REASONS)}")
        ids = _token_ids(token_ids)
        now = self._now()
        job = self._statements.append_message(session_id, role, content, ids, now, finish_reason, usage, unanswered,
                                              answers, title)
        record: MessageRecord = await self._in_group(job)
        return record

    async def replace_from(
        self, session_id: str, index: int, role: str, content: str, token_ids: Sequence[int], *,
        unanswered: bool = False,
    ) -> tuple[MessageRecord, EditRecord]:
        """Replace message ``index`` and drop every later one from the active conversation.

        ``unanswered`` marks the new message as a user message whose reply is still to come
        (see :meth:`append_message`).

        The replaced messages are kept, archived under a new edit (returned, with them). After
        this the conversation has index + 1 messages and its counts match them. NotFound for an
        unknown session; BadRequest for an index outside 0..message_count-1 or a bad role.
        """
        _check_role(role)
        ids = _token_ids(token_ids)
        now = self._now()
        async with self._writing() as db:
            count = await update_session(db, session_id, updated_at=now)
            if not 0 <= index < count:
                # Leaving the block with an exception rolls the touch of updated_at back.
                raise BadRequest(f"message index {index} is out of range (0..{count - 1})")

            edit = EditRow(session_id=session_id, position=index, created_at=now)
            db.add(edit)
            await db.flush()
            replaced = list(
                await db.scalars(
                    select(MessageRow)
                    .where(
                        MessageRow.session_id == session_id,
                        MessageRow.archived_by_edit.is_(None),
                        MessageRow.position >= index,
                    )
                    .order_by(MessageRow.position)
                )
            )
            for old in replaced:
                old.archived_by_edit = edit.id
            # The archived rows must leave the active set before the new row takes their index.
            await db.flush()

            new = new_message(session_id, index, role, content, ids, now, unanswered=unanswered)
            db.add(new)
            await db.flush()
            # Recounted from the rows rather than adjusted, so the counts cannot drift.
            active_tokens = (
                select(func.coalesce(func.sum(MessageRow.num_tokens), 0))
                .where(MessageRow.session_id == session_id, MessageRow.archived_by_edit.is_(None))
                .scalar_subquery()
            )
            await db.execute(
                update(SessionRow)
                .where(SessionRow.session_id == session_id)
                .values(message_count=index + 1, token_count=active_tokens),
                execution_options=NO_SYNC,
            )
            archived = tuple(message_record(old) for old in replaced)
            edit_record = EditRecord(edit.id, session_id, index, edit.created_at, archived)
            return message_record(new), edit_record

    async def list_edits(self, session_id: str) -> list[EditRecord]:
        """The session's edits, oldest first, each with the messages it archived. NotFound."""
        async with self._sessionmaker.begin() as db:
            if await db.get(SessionRow, session_id) is None:
                raise NotFound("session not found")
            edits = list(
                await db.scalars(
                    select(EditRow).where(EditRow.session_id == session_id).order_by(EditRow.id)
                )
            )
            archived: dict[int, list[MessageRecord]] = {edit.id: [] for edit in edits}
            rows = await db.scalars(
                select(MessageRow)
                .where(MessageRow.session_id == session_id, MessageRow.archived_by_edit.is_not(None))
                .order_by(MessageRow.position)
            )
            for row in rows:
                assert row.archived_by_edit is not None
                archived[row.archived_by_edit].append(message_record(row))
            return [
                EditRecord(e.id, e.session_id, e.position, e.created_at, tuple(archived[e.id]))
                for e in edits
            ]

    # -- snapshot records ----------------------------------------------------------------------

    async def put_snapshot(self, record: SnapshotRecord) -> None:
        """Record (or replace) the session's one snapshot. NotFound for an unknown session.

        ``created_at`` must be timezone-aware (ValueError otherwise); it is read back in UTC.
        """
        if record.created_at.tzinfo is None:
            raise ValueError("created_at must be timezone-aware")
        await self._in_group(self._statements.put_snapshot(record))

    async def get_snapshot(self, session_id: str) -> SnapshotRecord | None:
        """The session's snapshot record, or None (also for an unknown session)."""
        async with self._sessionmaker.begin() as db:
            row = await db.get(SnapshotRow, session_id)
            return None if row is None else record_of(SnapshotRecord, row)

    async def delete_snapshot(self, session_id: str) -> bool:
        """Forget the session's snapshot record; False when there was none."""
        return await self._delete_by_session(SnapshotRow, session_id)

    async def list_snapshots(self) -> list[SnapshotRecord]:
        """Every snapshot record, oldest first (ties by session id)."""
        async with self._sessionmaker.begin() as db:
            rows = await db.scalars(
                select(SnapshotRow).order_by(SnapshotRow.created_at, SnapshotRow.session_id)
            )
            return [record_of(SnapshotRecord, row) for row in rows]
