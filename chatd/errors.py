"""The one error tree of chatd.

Every error a client can see carries a stable wire ``code`` and an HTTP status; the edges
(websocket and HTTP handlers) map them in one place and never show internal details. Errors
that are not ``ChatdError`` reach clients only as ``internal`` with a generic message.
"""

from __future__ import annotations


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


class Internal(ChatdError):
    code = "internal"
    http_status = 500


class ConfigError(ChatdError):
    """Invalid configuration; raised at load time, before anything starts."""


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


WIRE_CODES = (
    "bad_request",
    "unknown_type",
    "too_large",
    "not_found",
    "busy",
    "context_length_exceeded",
    "unauthorized",
    "rate_limited",
    "internal",
)
