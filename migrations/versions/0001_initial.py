"""Initial schema: sessions, edits, messages, snapshots.

Revision ID: 0001
Revises:
Create Date: 2025-12-02

Written by hand to match chatd/store/models.py (a test compares the two). Every constraint and
index is named explicitly so later migrations can refer to it on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SESSION_ID = sa.String(64)
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("session_id", SESSION_ID, nullable=False),
        sa.Column("title", sa.Text(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("updated_at", TIMESTAMP, nullable=False),
        # Counts over the active conversation only (archived messages excluded).
        sa.Column("message_count", sa.Integer(), nullable=False),
        sa.Column("token_count", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("session_id", name="pk_sessions"),
    )
    op.create_index("ix_sessions_updated_at", "sessions", ["updated_at"])

    # One row per edit; the messages it replaced point back to it (archived_by_edit).
    op.create_table(
        "edits",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("session_id", SESSION_ID, nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_edits"),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["sessions.session_id"],
            name="fk_edits_session_id_sessions",
            ondelete="CASCADE",
        ),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_edits_session_id", "edits", ["session_id"])

    op.create_table(
        "messages",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("session_id", SESSION_ID, nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("content", sa.Text(), nullable=False),
        # Little-endian uint32 token ids; num_tokens * 4 bytes.
        sa.Column("token_ids", sa.LargeBinary(), nullable=False),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("finish_reason", sa.String(16), nullable=True),
        sa.Column("usage", sa.JSON(), nullable=True),
        # NULL: part of the active conversation; otherwise the edit that replaced it.
        sa.Column("archived_by_edit", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_messages"),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["sessions.session_id"],
            name="fk_messages_session_id_sessions",
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["archived_by_edit"],
            ["edits.id"],
            name="fk_messages_archived_by_edit_edits",
            ondelete="CASCADE",
        ),
        sa.CheckConstraint("role IN ('system', 'user', 'assistant')", name=op.f("ck_messages_role")),
        sa.CheckConstraint(
            "finish_reason IN ('stop', 'length', 'cancelled')", name=op.f("ck_messages_finish_reason")
        ),
        sa.CheckConstraint("position >= 0", name=op.f("ck_messages_position")),
        sa.CheckConstraint("num_tokens >= 0", name=op.f("ck_messages_num_tokens")),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_messages_session_id", "messages", ["session_id"])
    op.create_index("ix_messages_archived_by_edit", "messages", ["archived_by_edit"])
    # Active positions are unique per session; archived history may repeat them.
    op.create_index(
        "uq_messages_active_position",
        "messages",
        ["session_id", "position"],
        unique=True,
        sqlite_where=sa.text("archived_by_edit IS NULL"),
        postgresql_where=sa.text("archived_by_edit IS NULL"),
    )

    # At most one KV snapshot file per session (the primary key is the session).
    op.create_table(
        "snapshots",
        sa.Column("session_id", SESSION_ID, nullable=False),
        sa.Column("file_name", sa.Text(), nullable=False),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("file_bytes", sa.BigInteger(), nullable=False),
        sa.Column("raw_bytes", sa.BigInteger(), nullable=False),
        sa.Column("fingerprint", sa.Text(), nullable=False),
        sa.Column("ids_digest", sa.Text(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("session_id", name="pk_snapshots"),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["sessions.session_id"],
            name="fk_snapshots_session_id_sessions",
            ondelete="CASCADE",
        ),
    )


def downgrade() -> None:
    # Reverse order of creation: children before the tables they reference.
    op.drop_table("snapshots")
    op.drop_index("uq_messages_active_position", table_name="messages")
    op.drop_index("ix_messages_archived_by_edit", table_name="messages")
    op.drop_index("ix_messages_session_id", table_name="messages")
    op.drop_table("messages")
    op.drop_index("ix_edits_session_id", table_name="edits")
    op.drop_table("edits")
    op.drop_index("ix_sessions_updated_at", table_name="sessions")
    op.drop_table("sessions")
