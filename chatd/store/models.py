"""SQLAlchemy models of the conversation store.

These classes are the schema's single description in Python; ``migrations/`` creates the same
schema by hand and a test checks that the two agree. Nothing outside ``chatd.store`` should use
these rows: :mod:`chatd.store.repo` turns them into frozen dataclasses.

Conventions the repository relies on:

* timestamps are :class:`UTCDateTime`: aware UTC ``datetime`` in and out on every backend (SQLite
  stores no offset, so reads put UTC back);
* ``messages.token_ids`` is :class:`TokenIds`: a ``tuple[int, ...]`` in Python, little-endian
  uint32 bytes in the database, ``num_tokens`` of them;
* a message with ``archived_by_edit`` NULL belongs to the active conversation, and within one
  session active positions are unique (a partial unique index) and run 0..message_count-1;
* ``sessions.message_count`` / ``token_count`` describe the active messages only;
* ``messages.unanswered`` marks a user message whose reply is not stored (yet).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    false,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from chatd.domain import FINISH_REASONS, ROLES, SESSION_ID_MAX_CHARS

# Deterministic constraint names, so a later migration can drop or alter them by name on every
# backend (SQLite and PostgreSQL otherwise invent different ones).
NAMING_CONVENTION: dict[str, str] = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


# The partial index's predicate; shared by both dialects' ``*_where`` options.
_ACTIVE = text("archived_by_edit IS NULL")


# The array typecode whose items are exactly 4 bytes ("I" on every mainstream platform).
_U32 = next(code for code in "IL" if array(code).itemsize == 4)
_BIG_ENDIAN = sys.byteorder == "big"
MAX_TOKEN_ID = 2**32 - 1


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; ValueError for ids outside 0..2**32-1."""
    try:
        values = array(_U32, token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in 0..{MAX_TOKEN_ID}: {exc}") from exc
    if _BIG_ENDIAN:
        values.byteswap()
    return values.tobytes()


def unpack_token_ids(blob: bytes) -> tuple[int, ...]:
    """The inverse of :func:`pack_token_ids`."""
    values = array(_U32)
    values.frombytes(blob)
    if _BIG_ENDIAN:
        values.byteswap()
    return tuple(values)


def utc(value: datetime) -> datetime:
    """``value`` as an aware UTC datetime; a naive value (as SQLite returns) is taken as UTC."""
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp column that only takes aware datetimes and always returns aware UTC ones."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("timestamps must be timezone-aware")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else utc(value)


class TokenIds(TypeDecorator[tuple[int, ...]]):
    """Token ids stored as a little-endian uint32 BLOB (BYTEA on PostgreSQL)."""

    impl = LargeBinary
    cache_ok = True

    def process_bind_param(self, value: Sequence[int] | None, dialect: Dialect) -> bytes | None:
        return None if value is None else pack_token_ids(value)

    def process_result_value(self, value: bytes | None, dialect: Dialect) -> tuple[int, ...] | None:
        return None if value is None else unpack_token_ids(value)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class SessionRow(Base):
    """One conversation. ``session_id`` is chosen by the caller (an unguessable token)."""

    __tablename__ = "sessions"
    __table_args__ = (
        # list_sessions sorts by recency.
        Index("ix_sessions_updated_at", "updated_at"),
    )

    session_id: Mapped[str] = mapped_column(String(SESSION_ID_MAX_CHARS), primary_key=True)
    title: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    message_count: Mapped[int] = mapped_column(Integer)
    token_count: Mapped[int] = mapped_column(Integer)


class EditRow(Base):
    """One edit of a session's message at ``position``; archived messages point here."""

    __tablename__ = "edits"
    __table_args__ = (
        Index("ix_edits_session_id", "session_id"),
        # Never reuse ids on SQLite: an id names one edit for the life of the database.
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(
        String(SESSION_ID_MAX_CHARS), ForeignKey("sessions.session_id", ondelete="CASCADE")
    )
    position: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class MessageRow(Base):
    """One message, active (``archived_by_edit`` NULL) or kept as history of an edit."""

    __tablename__ = "messages"
    __table_args__ = (
        Index("ix_messages_session_id", "session_id"),
        Index("ix_messages_archived_by_edit", "archived_by_edit"),
        Index(
            "uq_messages_active_position",
            "session_id",
            "position",
            unique=True,
            sqlite_where=_ACTIVE,
            postgresql_where=_ACTIVE,
        ),
        CheckConstraint(_in("role", ROLES), name="role"),
        CheckConstraint(_in("finish_reason", FINISH_REASONS), name="finish_reason"),
        CheckConstraint("position >= 0", name="position"),
        CheckConstraint("num_tokens >= 0", name="num_tokens"),
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(
        String(SESSION_ID_MAX_CHARS), ForeignKey("sessions.session_id", ondelete="CASCADE")
    )
    position: Mapped[int] = mapped_column(Integer)
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[str] = mapped_column(Text)
    token_ids: Mapped[tuple[int, ...]] = mapped_column(TokenIds)
    num_tokens: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    finish_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)
    # none_as_null: a missing usage is SQL NULL, not the JSON value null.
    usage: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    archived_by_edit: Mapped[int | None] = mapped_column(
        Integer, ForeignKey("edits.id", ondelete="CASCADE"), nullable=True
    )
    # A user message whose turn has stored no reply yet: the turn is running, or it ended without one
    # (the reply could not be committed, the engine failed, the server died). Cleared in the transaction
    # that stores its reply, so a history never ends on an unanswered user message that is not marked.
    unanswered: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class SnapshotRow(Base):
    """The one KV snapshot file recorded for a session (the file itself lives on disk)."""

    __tablename__ = "snapshots"

    session_id: Mapped[str] = mapped_column(
        String(SESSION_ID_MAX_CHARS),
        ForeignKey("sessions.session_id", ondelete="CASCADE"),
        primary_key=True,
    )
    file_name: Mapped[str] = mapped_column(Text)
    num_tokens: Mapped[int] = mapped_column(Integer)
    file_bytes: Mapped[int] = mapped_column(BigInteger)
    raw_bytes: Mapped[int] = mapped_column(BigInteger)
    fingerprint: Mapped[str] = mapped_column(Text)
    ids_digest: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
