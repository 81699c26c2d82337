"""The service layer's own types: what its operations take and return.

They say what chatd knows, not how a transport spells it: the websocket protocol, the admin API and the OpenAI API
(chatd.server) each map them to their wire models at the edge, so a change of the wire never reaches the service and
the service never validates a wire model. Immutable dataclasses, no I/O.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from chatd.domain import ContextSource, FinishReason, Role, SessionRecord, Tier


@dataclass(frozen=True)
class GenerationOptions:
    """A request's sampling choices; None takes the server's default (``[generation]``)."""

    max_tokens: int | None = None
    temperature: float | None = None
    """0 means greedy decoding."""
    top_p: float | None = None
    top_k: int | None = None
    """0 disables top-k filtering."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Strings that end the reply when it produces one (the string itself is not kept)."""


@dataclass(frozen=True, kw_only=True)
class Usage:
    """Where a turn's context came from, and what the turn cost. ``cached_tokens + prefill_tokens ==
    input_tokens``."""

    input_tokens: int
    cached_tokens: int
    cache_tier: ContextSource
    """Where the cached tokens came from (:func:`chatd.domain.context_source`)."""
    prefill_tokens: int
    output_tokens: int
    invalidated_from: int | None = None
    """An edit's first changed token position: the cache was cut there."""
    restore_ms: float | None = None
    """How long reading the cache back from its snapshot took, when it was."""
    ttft_ms: float
    decode_tokens_per_s: float

    def to_dict(self) -> dict[str, Any]:
        """The usage as stored beside its reply (every field, None ones included)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, stored: dict[str, Any]) -> Usage:
        """A usage :meth:`to_dict` stored (fields it lacks take their defaults)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in stored.items() if key in names})


@dataclass(frozen=True)
class Message:
    """A message of a conversation, at its ``index``."""

    index: int
    role: Role
    content: str
    created_at: datetime
    finish_reason: FinishReason | None = None
    """Replies in a resumed conversation: how the reply ended."""
    usage: Usage | None = None
    """Replies in a resumed conversation: the usage of the turn that produced it."""
    unanswered: bool | None = None
    """User messages in a resumed conversation, only when true: no reply to it is stored (its turn is running or
    ended without storing one)."""


@dataclass(frozen=True)
class SessionInfo:
    """A stored session and where its KV cache is now."""

    session_id: str
    title: str
    created_at: datetime
    updated_at: datetime
    message_count: int
    """Messages in the active conversation (archived ones excluded)."""
    token_count: int
    """Sum of the active messages' token counts."""
    tier: Tier

    @classmethod
    def of(cls, record: SessionRecord, tier: Tier) -> SessionInfo:
        return cls(session_id=record.session_id, title=record.title, created_at=record.created_at,
                   updated_at=record.updated_at, message_count=record.message_count,
                   token_count=record.token_count, tier=tier)


@dataclass(frozen=True)
class TurnResult:
    """A finished turn: the user message it answered, the stored reply, how it ended and what it cost."""

    session_id: str
    user_message: Message
    assistant_message: Message
    finish_reason: FinishReason
    usage: Usage


@dataclass(frozen=True)
class EditResult:
    """An edit of a system or assistant message: nothing is generated."""

    session_id: str
    message: Message
    invalidated_from: int
