"""Wire protocol v1: the websocket frames shared by server and client. No I/O here.

Every frame is a JSON object with a ``type``. Client frames may carry an ``id`` (a client-chosen
request id) that the server echoes on every frame answering that request. :func:`parse_client_frame`
turns text into a validated model or raises a :class:`~chatd.errors.ChatdError` whose code is the
``error`` frame's code; the connection stays usable after any of them. See docs/protocol.md.
"""

from __future__ import annotations

import json
import re
from array import array
from datetime import datetime
from itertools import accumulate
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from chatd.domain import SESSION_ID_PATTERN, FinishReason, Role, SessionRecord, Tier, is_valid_unicode
from chatd.errors import BadRequest, ChatdError, TooLarge, UnknownType, describe_validation_errors

PROTOCOL_VERSION = 1

SessionId = Annotated[str, Field(pattern=SESSION_ID_PATTERN)]
"""A session id as the domain module defines it; anything else is a bad_request."""

MAX_REQUEST_ID_CHARS = 128
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 64
MAX_NESTING_DEPTH = 32
"""The deepest nesting of JSON arrays and objects a frame may have (the frame object itself is level 1).
Real frames need 4; the limit keeps the JSON decoder far from Python's recursion limit."""


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
    unanswered: bool | None = None
    """User messages in ``session.resumed`` only, and only when true: no reply to it is stored, because its
    turn is still running or ended without storing one (``reply_not_saved``, an engine failure, a crash)."""


# ----------------------------------------------------------------------------- client -> server


class ClientFrameBase(_Model):
    """What every client frame has: an optional request id, echoed on every frame that answers it."""

    id: str | None = Field(default=None, max_length=MAX_REQUEST_ID_CHARS)


class SessionCreate(ClientFrameBase):
    type: Literal["session.create"] = "session.create"
    system: str | None = None
    title: str | None = Field(default=None, max_length=200)


class SessionResume(ClientFrameBase):
    type: Literal["session.resume"] = "session.resume"
    session_id: SessionId


class MessageSend(ClientFrameBase):
    type: Literal["message.send"] = "message.send"
    session_id: SessionId
    content: str
    params: GenerationParams | None = None


class MessageEdit(ClientFrameBase):
    type: Literal["message.edit"] = "message.edit"
    session_id: SessionId
    index: int = Field(ge=0)
    content: str
    params: GenerationParams | None = None


class GenerationCancel(ClientFrameBase):
    type: Literal["generation.cancel"] = "generation.cancel"
    session_id: SessionId


class Ping(ClientFrameBase):
    type: Literal["ping"] = "ping"


ClientFrame = Annotated[
    SessionCreate | SessionResume | MessageSend | MessageEdit | GenerationCancel | Ping,
    Field(discriminator="type"),
]
"""Any client frame, told apart by ``type``. A ``match`` over it can be checked for exhaustiveness."""


# ----------------------------------------------------------------------------- server -> client


class ServerFrameBase(_Model):
    """What every server frame has: the request id of the client frame it answers, if that had one."""

    id: str | None = None

    def to_json(self) -> str:
        """The frame as sent on the wire: absent (None) fields are left out."""
        return self.model_dump_json(exclude_none=True)


class Hello(ServerFrameBase):
    type: Literal["hello"] = "hello"
    protocol_version: int = PROTOCOL_VERSION
    model: str
    server_version: str
    max_context: int


class SessionCreated(ServerFrameBase):
    type: Literal["session.created"] = "session.created"
    session: SessionInfo


class SessionResumed(ServerFrameBase):
    type: Literal["session.resumed"] = "session.resumed"
    session: SessionInfo
    messages: list[Message]


class Token(ServerFrameBase):
    type: Literal["token"] = "token"
    session_id: str
    text: str


class MessageDone(ServerFrameBase):
    type: Literal["message.done"] = "message.done"
    session_id: str
    user_message: Message
    assistant_message: Message
    finish_reason: FinishReason
    usage: Usage


class MessageEdited(ServerFrameBase):
    """Answer to ``message.edit`` of a system or assistant message (nothing is generated)."""

    type: Literal["message.edited"] = "message.edited"
    session_id: str
    message: Message
    invalidated_from: int | None = None


class GenerationCancelled(ServerFrameBase):
    """Answer to ``generation.cancel``; the cancelled turn still ends with its ``message.done``."""

    type: Literal["generation.cancelled"] = "generation.cancelled"
    session_id: str
    was_running: bool


class Pong(ServerFrameBase):
    type: Literal["pong"] = "pong"


class ErrorFrame(ServerFrameBase):
    type: Literal["error"] = "error"
    code: str
    message: str

    @classmethod
    def of(cls, exc: ChatdError, request_id: str | None = None) -> ErrorFrame:
        """The frame that reports ``exc`` (its wire code and client-safe message)."""
        return cls(code=exc.code, message=exc.message, id=request_id)


ServerFrame = Annotated[
    Hello | SessionCreated | SessionResumed | Token | MessageDone | MessageEdited | GenerationCancelled | Pong
    | ErrorFrame,
    Field(discriminator="type"),
]
"""Any server frame, told apart by ``type``."""


def _frame_types(union: Any) -> dict[str, type[BaseModel]]:
    members = get_args(get_args(union)[0])
    return {model.model_fields["type"].default: model for model in members}


CLIENT_FRAME_TYPES: frozenset[str] = frozenset(_frame_types(ClientFrame))
"""Every client frame ``type`` the server understands."""
SERVER_FRAME_TYPES: frozenset[str] = frozenset(_frame_types(ServerFrame))
"""Every server frame ``type`` a client may receive."""

_client_frames: TypeAdapter[ClientFrame] = TypeAdapter(ClientFrame)
_server_frames: TypeAdapter[ServerFrame] = TypeAdapter(ServerFrame)


# ----------------------------------------------------------------------------- parsing


# A JSON string literal (escapes included), written so that the regex engine does not backtrack.
_JSON_STRING_RE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS_RE = re.compile(r"[^\[\]{}]+")
# Opening brackets become the signed byte +1, closing ones -1, so the running sum is the depth.
_BRACKET_STEPS = str.maketrans({"[": "\x01", "{": "\x01", "]": "\xff", "}": "\xff"})


def nesting_depth(text: str) -> int:
    """How deeply JSON arrays and objects nest in ``text``; brackets inside strings do not count.

    A scan of the text, without parsing it (so without recursion), in C loops: about as fast as
    ``json.loads`` of the same text. For text that is not valid JSON the answer is only an estimate.
    """
    brackets = _NOT_BRACKETS_RE.sub("", _JSON_STRING_RE.sub("", text))
    steps = array("b", brackets.translate(_BRACKET_STEPS).encode("latin-1"))
    return max(accumulate(steps, initial=0))


def _invalid_unicode_at(data: Any, root: str) -> str | None:
    """The location of the first string (value or key) in decoded JSON that is not valid Unicode, or None."""
    stack: list[tuple[str, Any]] = [(root, data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            if not is_valid_unicode(value):
                return where
        elif isinstance(value, dict):
            for key, item in value.items():
                if not is_valid_unicode(key):
                    return f"{where} (a key)"
                stack.append((f"{where}.{key}", item))
        elif isinstance(value, list):
            stack.extend((f"{where}.{num}", item) for num, item in enumerate(value))
    return None


def _load_object(text: str | bytes, max_bytes: int | None) -> dict[str, Any]:
    if max_bytes is not None and len(text) > max_bytes:
        raise TooLarge(f"frame of {len(text)} bytes exceeds the limit of {max_bytes}")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest("frame is not valid UTF-8") from None
    # Checked before decoding: json.loads recurses once per level and deep input would hit RecursionError.
    if nesting_depth(text) > MAX_NESTING_DEPTH:
        raise BadRequest(f"frame is nested deeper than {MAX_NESTING_DEPTH} levels")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise BadRequest(f"frame is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("frame must be a JSON object")
    return data


def _check_unicode(data: dict[str, Any]) -> None:
    # JSON's \uXXXX escapes can spell a lone surrogate, which no later step (tokenizer, store, the JSON
    # encoder of the answer) can encode; refuse it here, once for every field of every frame type.
    where = _invalid_unicode_at(data, "frame")
    if where is not None:
        raise BadRequest(f"{where[:100]}: text is not valid Unicode (it holds a lone surrogate escape)")


def request_id_of(data: dict[str, Any]) -> str | None:
    """The frame's ``id`` if it is a usable request id, else None (for echoing on errors)."""
    rid = data.get("id")
    if isinstance(rid, str) and len(rid) <= MAX_REQUEST_ID_CHARS and is_valid_unicode(rid):
        return rid
    return None


def parse_client_frame(text: str | bytes, *, max_bytes: int | None = None) -> ClientFrame:
    """Validate one client frame.

    Raises TooLarge (over ``max_bytes``), BadRequest (not JSON, nested deeper than
    :data:`MAX_NESTING_DEPTH`, not an object, a string that is not valid Unicode, missing or mistyped
    fields; the message names them) or UnknownType. The raised error carries ``request_id`` when
    the frame had a usable ``id``.
    """
    data = _load_object(text, max_bytes)
    kind = data.get("type")
    try:
        _check_unicode(data)
        if not isinstance(kind, str):
            raise BadRequest("frame needs a string field 'type'")
        if kind not in CLIENT_FRAME_TYPES:
            raise UnknownType(f"unknown frame type {kind[:64]!r}")
        try:
            return _client_frames.validate_python(data)
        except ValidationError as exc:
            # The union puts the frame's type first in every error location; the message names it already.
            problems = describe_validation_errors(exc.errors(), root="frame", skip=1)
            raise BadRequest(f"invalid {kind} frame: {problems}") from None
    except (BadRequest, UnknownType) as exc:
        exc.request_id = request_id_of(data)
        raise


def parse_server_frame(text: str | bytes) -> ServerFrame:
    """Validate one server frame (used by the client library). Raises BadRequest if invalid."""
    data = _load_object(text, None)
    _check_unicode(data)
    kind = data.get("type")
    if not isinstance(kind, str) or kind not in SERVER_FRAME_TYPES:
        raise BadRequest(f"unknown server frame type {kind!r}")
    try:
        return _server_frames.validate_python(data)
    except ValidationError as exc:
        problems = describe_validation_errors(exc.errors(), root="frame", skip=1)
        raise BadRequest(f"invalid {kind} frame from the server: {problems}") from None
