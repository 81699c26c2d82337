"""The one error tree of chatd.

Every error a client can see carries a stable wire ``code`` and an HTTP status; the edges
(websocket and HTTP handlers) map them in one place and never show internal details. Errors
that are not ``ChatdError`` reach clients only as ``internal`` with a generic message.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class ChatdError(Exception):
    """Base class. ``message`` is safe to show to a client."""

    code = "internal"
    http_status = 500

    def __init__(self, message: str = "internal error") -> None:
        super().__init__(message)
        self.message = message
        # The client's request id, when the error answers a frame that had one.
        self.request_id: str | None = None


class BadRequest(ChatdError):
    code = "bad_request"
    http_status = 400


class InvalidParam(BadRequest):
    """A request field that is malformed or names a feature chatd does not have; ``param`` names the field
    (the OpenAI API's errors carry it), None for the request as a whole."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


class Unavailable(ChatdError):
    """The server cannot serve the request now: it is still starting (``/readyz`` says how far), or its
    engine has stopped."""

    code = "unavailable"
    http_status = 503


class UnknownType(ChatdError):
    code = "unknown_type"
    http_status = 400


class TooLarge(ChatdError):
    code = "too_large"
    http_status = 413


class NotFound(ChatdError):
    code = "not_found"
    http_status = 404


class Busy(ChatdError):
    """A generation is already running in that session (or the server is at its generation limit)."""

    code = "busy"
    http_status = 409


class ContextLengthExceeded(ChatdError):
    code = "context_length_exceeded"
    http_status = 400


class Unauthorized(ChatdError):
    code = "unauthorized"
    http_status = 401


class RateLimited(ChatdError):
    code = "rate_limited"
    http_status = 429


class ReplyNotSaved(ChatdError):
    """A reply was generated (and streamed) but could not be stored, even after retries (the database
    disk is full, the store is down). The user message is kept, marked unanswered."""

    code = "reply_not_saved"
    http_status = 503


class Internal(ChatdError):
    code = "internal"
    http_status = 500


class ConfigError(ChatdError):
    """Invalid configuration; raised at load time, before anything starts. ``chatd serve`` exits with 2."""


class StartupError(ChatdError):
    """The server cannot start for a reason outside its configuration's syntax (the port is taken, the store
    does not answer, the model does not load). ``message`` says what, where and what to do; ``chatd serve``
    exits with 1."""


class SnapshotError(ChatdError):
    """A snapshot file cannot be used. ``reason`` is a short machine-readable word.

    Never shown to clients: a session whose snapshot is rejected is recomputed instead.
    """

    reason = "invalid"

    def __init__(self, message: str) -> None:
        super().__init__(f"{self.reason}: {message}")


class SnapshotTruncated(SnapshotError):
    reason = "truncated"


class SnapshotCorrupt(SnapshotError):
    reason = "corrupt"


class SnapshotVersionError(SnapshotError):
    reason = "unknown_version"


class SnapshotModelMismatch(SnapshotError):
    reason = "other_model"


class SnapshotIdsMismatch(SnapshotError):
    reason = "ids_mismatch"


WIRE_ERRORS: tuple[type[ChatdError], ...] = (
    BadRequest, UnknownType, TooLarge, NotFound, Busy, ContextLengthExceeded, Unauthorized, RateLimited,
    Unavailable, ReplyNotSaved, Internal,
)
"""The errors a client can see, in the order docs/protocol.md lists them."""

ERROR_CODES: tuple[str, ...] = tuple(cls.code for cls in WIRE_ERRORS)
"""Every wire ``code`` an ``error`` frame (or an HTTP error body) can carry; the browser gets them through
the generated static/wire.js."""


def describe_validation_errors(errors: Iterable[Mapping[str, Any]], *, root: str = "value",
                               limit: int | None = 5, skip: int = 0) -> str:
    """One line naming what is wrong, from pydantic's ``ValidationError.errors()`` (or FastAPI's
    ``RequestValidationError.errors()``): ``"a.b: msg; c: msg"``.

    ``skip`` drops that many leading location parts (e.g. a discriminated union's tag); a problem with
    the whole value is named ``root``. At most ``limit`` problems are listed (all when None), so a
    client's message stays short whatever it sent. Returns "" when there are no errors.
    """
    parts = []
    for num, err in enumerate(errors):
        if limit is not None and num >= limit:
            break
        loc = ".".join(str(p) for p in tuple(err.get("loc", ()))[skip:]) or root
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)
