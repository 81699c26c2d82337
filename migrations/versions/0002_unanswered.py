"""messages.unanswered: a user message whose reply is not stored.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03

A turn commits its user message marked unanswered and clears the mark in the transaction that stores
the reply. A reply that could not be committed (a full disk), a failed engine or a crash leaves the
mark, so a history never ends on an unanswered user message that nobody can tell from an answered one.
Existing messages are answered (false).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "messages",
        sa.Column("unanswered", sa.Boolean(), nullable=False, server_default=sa.false()),
    )


def downgrade() -> None:
    # SQLite drops a column in place since 3.35 (the column is in no index or constraint).
    op.drop_column("messages", "unanswered")
