"""Wire protocol v1: the websocket frames shared by server and client. No I/O here.

Every frame is a JSON object with a ``type``. Client frames may carry an ``id`` (a client-chosen
request id) that the server echoes on every frame answering that request. :func:`parse_client_frame`
turns text into a validated model or raises a :class:`~chatd.errors.ChatdError` whose code is the
``error`` frame's code; the connection stays usable after any of them. See docs/protocol.md.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from chatd.domain import SESSION_ID_PATTERN, FinishReason, Role, SessionRecord, Tier
from chatd.errors import BadRequest, TooLarge, UnknownType

PROTOCOL_VERSION = 1

SessionId = Annotated[str, Field(pattern=SESSION_ID_PATTERN)]
"""A session id as the domain module defines it; anything else is a bad_request."""

MAX_REQUEST_ID_CHARS = 128
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 64


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerationParams(_Model):
    """Per-request sampling overrides; a missing field takes the server's default."""

    max_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    temperature: float | None = Field(default=None, ge=0.0, le=5.0)
    """0 means greedy decoding."""
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=1 << 20)
    """0 disables top-k filtering."""
    seed: int | None = Field(default=None, ge=0, le=(1 << 63) - 1)
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS
    )


class SessionInfo(SessionRecord):
    """A session as the wire shows it: the stored record plus where its KV cache is now."""

    tier: Tier

    @classmethod
    def of(cls, record: SessionRecord, tier: Tier) -> SessionInfo:
        return cls(**record.model_dump(), tier=tier)


class Usage(_Model):
    """Where a turn's context came from. ``cached_tokens + prefill_tokens == input_tokens``."""

    input_tokens: int
    cached_tokens: int
    cache_tier: Tier
    prefill_tokens: int
    output_tokens: int
    invalidated_from: int | None = None
    restore_ms: float | None = None
    ttft_ms: float
    decode_tokens_per_s: float


class Message(_Model):
    index: int
    role: Role
    content: str
    created_at: datetime
    finish_reason: FinishReason | None = None
    """Assistant messages in ``session.resumed`` only: how the reply ended."""
    usage: Usage | None = None
    """Assistant messages in ``session.resumed`` only: the usage of the turn that produced it."""


# ----------------------------------------------------------------------------- client -> server


class _ClientFrame(_Model):
    id: str | None = Field(default=None, max_length=MAX_REQUEST_ID_CHARS)


class SessionCreate(_ClientFrame):
    type: Literal["session.create"] = "session.create"
    system: str | None = None
    title: str | None = Field(default=None, max_length=200)


class SessionResume(_ClientFrame):
    type: Literal["session.resume"] = "session.resume"
    session_id: SessionId


class MessageSend(_ClientFrame):
    type: Literal["message.send"] = "message.send"
    session_id: SessionId
    content: str
    params: GenerationParams | None = None


class MessageEdit(_ClientFrame):
    type: Literal["message.edit"] = "message.edit"
    session_id: SessionId
    index: int = Field(ge=0)
    content: str
    params: GenerationParams | None = None


class GenerationCancel(_ClientFrame):
    type: Literal["generation.cancel"] = "generation.cancel"
    session_id: SessionId


class Ping(_ClientFrame):
    type: Literal["ping"] = "ping"


ClientFrame = SessionCreate | SessionResume | MessageSend | MessageEdit | GenerationCancel | Ping

CLIENT_FRAMES: dict[str, type[_ClientFrame]] = {
    "session.create": SessionCreate,
    "session.resume": SessionResume,
    "message.send": MessageSend,
    "message.edit": MessageEdit,
    "generation.cancel": GenerationCancel,
    "ping": Ping,
}


# ----------------------------------------------------------------------------- server -> client


class _ServerFrame(_Model):
    id: str | None = None

    def to_json(self) -> str:
        return self.model_dump_json(exclude_none=True)


class Hello(_ServerFrame):
    type: Literal["hello"] = "hello"
    protocol_version: int = PROTOCOL_VERSION
    model: str
    server_version: str
    max_context: int


class SessionCreated(_ServerFrame):
    type: Literal["session.created"] = "session.created"
    session: SessionInfo


class SessionResumed(_ServerFrame):
    type: Literal["session.resumed"] = "session.resumed"
    session: SessionInfo
    messages: list[Message]


class Token(_ServerFrame):
    type: Literal["token"] = "token"
    session_id: str
    text: str


class MessageDone(_ServerFrame):
    type: Literal["message.done"] = "message.done"
    session_id: str
    user_message: Message
    assistant_message: Message
    finish_reason: FinishReason
    usage: Usage


class MessageEdited(_ServerFrame):
    """Answer to ``message.edit`` of a system or assistant message (nothing is generated)."""

    type: Literal["message.edited"] = "message.edited"
    session_id: str
    message: Message
    invalidated_from: int | None = None


class GenerationCancelled(_ServerFrame):
    """Answer to ``generation.cancel``; the cancelled turn still ends with its ``message.done``."""

    type: Literal["generation.cancelled"] = "generation.cancelled"
    session_id: str
    was_running: bool


class Pong(_ServerFrame):
    type: Literal["pong"] = "pong"


class ErrorFrame(_ServerFrame):
    type: Literal["error"] = "error"
    code: str
    message: str


ServerFrame = (
    Hello | SessionCreated | SessionResumed | Token | MessageDone | MessageEdited
    | GenerationCancelled | Pong | ErrorFrame
)

SERVER_FRAMES: dict[str, type[_ServerFrame]] = {
    "hello": Hello,
    "session.created": SessionCreated,
    "session.resumed": SessionResumed,
    "token": Token,
    "message.done": MessageDone,
    "message.edited": MessageEdited,
    "generation.cancelled": GenerationCancelled,
    "pong": Pong,
    "error": ErrorFrame,
}


# ----------------------------------------------------------------------------- parsing


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "frame"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def _load_object(text: str | bytes, max_bytes: int | None) -> dict[str, Any]:
    if max_bytes is not None and len(text) > max_bytes:
        raise TooLarge(f"frame of {len(text)} bytes exceeds the limit of {max_bytes}")
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"frame is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("frame must be a JSON object")
    return data


def request_id_of(data: dict[str, Any]) -> str | None:
    """The frame's ``id`` if it is a usable request id, else None (for echoing on errors)."""
    rid = data.get("id")
    if isinstance(rid, str) and len(rid) <= MAX_REQUEST_ID_CHARS:
        return rid
    return None


def parse_client_frame(text: str | bytes, *, max_bytes: int | None = None) -> ClientFrame:
    """Validate one client frame.

    Raises TooLarge (over ``max_bytes``), BadRequest (not JSON, not an object, missing or mistyped
    fields; the message names them) or UnknownType. The raised error carries ``request_id`` when
    the frame had a usable ``id``.
    """
    data = _load_object(text, max_bytes)
    rid = request_id_of(data)
    kind = data.get("type")
    try:
        if not isinstance(kind, str):
            raise BadRequest("frame needs a string field 'type'")
        model = CLIENT_FRAMES.get(kind)
        if model is None:
            raise UnknownType(f"unknown frame type {kind[:64]!r}")
        try:
            return model.model_validate(data)  # type: ignore[return-value]
        except ValidationError as exc:
            raise BadRequest(f"invalid {kind} frame: {_describe(exc)}") from None
    except (BadRequest, UnknownType) as exc:
        exc.request_id = rid
        raise


def parse_server_frame(text: str | bytes) -> _ServerFrame:
    """Validate one server frame (used by the client library). Raises BadRequest if invalid."""
    data = _load_object(text, None)
    model = SERVER_FRAMES.get(str(data.get("type")))
    if model is None:
        raise BadRequest(f"unknown server frame type {data.get('type')!r}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise BadRequest(f"invalid server frame: {_describe(exc)}") from None
