"""The store's statements through SQLAlchemy's ORM (every backend: PostgreSQL, and SQLite for what the direct path
does not take): the rows-to-records helpers the repository shares, and :class:`OrmStatements`, the ORM's backend
for a turn's calls (chatd.store.repo.Statements)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, fields
from datetime import datetime
from typing import Any, TypeVar

from pydantic import BaseModel
from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from chatd.domain import SessionRecord, SnapshotRecord
from chatd.errors import BadRequest, NotFound
from chatd.store.models import Base, MessageRow, SessionRow, SnapshotRow
from chatd.store.records import MessageRecord

# ORM-enabled UPDATE/DELETE would otherwise look for affected objects in the session; we hold none.
NO_SYNC = {"synchronize_session": False}
_R = TypeVar("_R", "SessionRecord", "SnapshotRecord")

Job = Callable[[AsyncSession], Any]
"""Work for one ORM transaction: an async function of the session."""


def record_of(cls: type[_R], row: Base) -> _R:
    # SessionRecord and SnapshotRecord mirror their rows' column names one to one.
    names = list(cls.model_fields) if issubclass(cls, BaseModel) else [f.name for f in fields(cls)]
    return cls(**{name: getattr(row, name) for name in names})


def message_record(row: MessageRow) -> MessageRecord:
    return MessageRecord(
        message_id=row.id,
        session_id=row.session_id,
        index=row.position,
        role=row.role,
        content=row.content,
        token_ids=row.token_ids,
        created_at=row.created_at,
        finish_reason=row.finish_reason,
        usage=row.usage,
        unanswered=bool(row.unanswered),
    )


async def update_session(db: AsyncSession, session_id: str, **values: Any) -> int:
    """UPDATE the session row (taking its lock) and return its message_count; NotFound if none."""
    result = await db.execute(
        update(SessionRow)
        .where(SessionRow.session_id == session_id)
        .values(**values)
        .returning(SessionRow.message_count),
        execution_options=NO_SYNC,
    )
    count = result.scalar_one_or_none()
    if count is None:
        raise NotFound("session not found")
    return int(count)


def new_message(
    session_id: str,
    position: int,
    role: str,
    content: str,
    token_ids: tuple[int, ...],
    now: datetime,
    finish_reason: str | None = None,
    usage: dict[str, Any] | None = None,
    unanswered: bool = False,
) -> MessageRow:
    return MessageRow(
        session_id=session_id,
        position=position,
        role=role,
        content=content,
        token_ids=token_ids,
        num_tokens=len(token_ids),
        created_at=now,
        finish_reason=finish_reason,
        # A copy: the returned record must not change when the caller's dict does.
        usage=None if usage is None else dict(usage),
        archived_by_edit=None,
        unanswered=unanswered,
    )


def active_messages(session_id: str) -> Any:
    """The query of a session's active conversation, in order."""
    return (select(MessageRow)
            .where(MessageRow.session_id == session_id, MessageRow.archived_by_edit.is_(None))
            .order_by(MessageRow.position))


class OrmStatements:
    """A turn's statements through the ORM (the repository's ``Statements`` on every backend but a SQLite file)."""

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker

    async def read_session(self, session_id: str) -> SessionRecord | None:
        async with self._sessionmaker.begin() as db:
            row = await db.get(SessionRow, session_id)
            return None if row is None else record_of(SessionRecord, row)

    async def read_conversation(self, session_id: str) -> tuple[SessionRecord, list[MessageRecord]]:
        async with self._sessionmaker.begin() as db:
            session = await db.get(SessionRow, session_id)
            if session is None:
                raise NotFound("session not found")
            rows = await db.scalars(active_messages(session_id))
            return record_of(SessionRecord, session), [message_record(row) for row in rows]

    def create_session(self, record: SessionRecord) -> Job:
        async def job(db: AsyncSession) -> None:
            db.add(SessionRow(**record.model_dump()))
            try:
                await db.flush()
            except IntegrityError as exc:
                raise BadRequest("session id already exists") from exc

        return job

    def append_message(self, session_id: str, role: str, content: str, ids: tuple[int, ...], now: datetime,
                       finish_reason: str | None, usage: dict[str, Any] | None, unanswered: bool,
                       answers: int | None, title: str | None) -> Job:
        async def job(db: AsyncSession) -> MessageRecord:
            # Counting first reserves the index under the session's lock (chatd.store.repo's docstring).
            titled = {} if title is None else {"title": func.coalesce(func.nullif(SessionRow.title, ""), title)}
            new_count = await update_session(
                db,
                session_id,
                message_count=SessionRow.message_count + 1,
                token_count=SessionRow.token_count + len(ids),
                updated_at=now,
                **titled,
            )
            row = new_message(session_id, new_count - 1, role, content, ids, now, finish_reason, usage, unanswered)
            if answers is not None:
                await db.execute(
                    update(MessageRow)
                    .where(MessageRow.id == answers, MessageRow.session_id == session_id)
                    .values(unanswered=False),
                    execution_options=NO_SYNC,
                )
            db.add(row)
            await db.flush()
            return message_record(row)

        return job

    def delete_by_session(self, row: type[SessionRow] | type[SnapshotRow], session_id: str) -> Job:
        async def job(db: AsyncSession) -> bool:
            deleted = await db.execute(
                delete(row).where(row.session_id == session_id).returning(row.session_id),
                execution_options=NO_SYNC,
            )
            return deleted.first() is not None

        return job

    def put_snapshot(self, record: SnapshotRecord) -> Job:
        async def job(db: AsyncSession) -> None:
            # A no-op write that locks the session row first, so that two puts for one session cannot both find
            # no record and both insert.
            await update_session(db, record.session_id, message_count=SessionRow.message_count)
            await db.merge(SnapshotRow(**asdict(record)))

        return job

    async def transaction(self, jobs: Sequence[Job]) -> list[Any]:
        results: list[Any] = []
        async with self._sessionmaker.begin() as db:
            for job in jobs:
                results.append(await job(db))
        return results

    async def close(self) -> None:
        """Nothing to release: the engine is the caller's to dispose."""
