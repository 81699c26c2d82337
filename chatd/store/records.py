"""The store's records of messages and edits: frozen dataclasses, the only shape stored rows leave the store in
(with :class:`chatd.domain.SessionRecord` and :class:`chatd.domain.SnapshotRecord`)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class MessageRecord:
    message_id: int
    session_id: str
    index: int
    """0-based position in the conversation (for an archived message: where it was)."""
    role: str
    content: str
    token_ids: tuple[int, ...]
    created_at: datetime
    finish_reason: str | None
    usage: dict[str, Any] | None
    unanswered: bool = False
    """A user message whose reply is not stored: its turn is running, or ended without storing one."""


@dataclass(frozen=True)
class EditRecord:
    edit_id: int
    session_id: str
    index: int
    """The edited position: messages from here on were archived."""
    created_at: datetime
    archived: tuple[MessageRecord, ...]
    """The messages this edit replaced, ordered by index."""
