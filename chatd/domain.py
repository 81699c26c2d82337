"""The words every layer shares: tiers, roles, finish reasons, the session-id format, the wire's
transport constants and the session record. Pure definitions: no I/O, and nothing of chatd is imported
here, so the engine, the KV layer, the store and the protocol can all depend on this module without
depending on each other.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Final, Literal, get_args

from pydantic import BaseModel, ConfigDict

Tier = Literal["device", "host", "disk", "none"]
"""Where a session's KV cache is: resident on the model's device, in host memory, in a snapshot on disk,
or nowhere (its next turn recomputes)."""
TIERS: Final[tuple[Tier, ...]] = get_args(Tier)

ContextSource = Literal["device", "host", "disk", "none"]
"""Where a turn's reused context came from (the wire's ``Usage.cache_tier``): the session's cache or blocks
resident on the device, host memory, its snapshot read back from disk, or nowhere (everything was prefilled).
Decided in one place, :func:`context_source`."""


def context_source(num_cached: int, *, restored: bool) -> ContextSource:
    """The source of a turn that reuses ``num_cached`` positions, ``restored`` from a snapshot (for this turn or
    ahead of it, on resume) or not."""
    if num_cached == 0:
        return "none"
    return "disk" if restored else "device"


Role = Literal["system", "user", "assistant"]
ROLES: Final[tuple[Role, ...]] = get_args(Role)

FinishReason = Literal["stop", "length", "cancelled"]
FINISH_REASONS: Final[tuple[FinishReason, ...]] = get_args(FinishReason)

# Session ids are capabilities: new ones carry 144 random bits (24 URL-safe characters). The accepted
# format is a little wider so ids made elsewhere (imports, tests) fit, but never wider than the store's column.
SESSION_ID_MIN_CHARS: Final = 16
SESSION_ID_MAX_CHARS: Final = 64
SESSION_ID_PATTERN: Final = rf"^[A-Za-z0-9_-]{{{SESSION_ID_MIN_CHARS},{SESSION_ID_MAX_CHARS}}}$"
_SESSION_ID_RE = re.compile(SESSION_ID_PATTERN)


def new_session_id() -> str:
    """144 random bits, URL-safe."""
    return secrets.token_urlsafe(18)


def is_session_id(text: str) -> bool:
    """True when ``text`` has the session-id format (it may still name no session)."""
    return _SESSION_ID_RE.fullmatch(text) is not None


# A lone surrogate (U+D800..U+DFFF not part of a pair) can reach a str through JSON's \uXXXX escapes, but
# it cannot be encoded as UTF-8: the tokenizer, the store and the JSON encoder all fail on it.
_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def is_valid_unicode(text: str) -> bool:
    """True when ``text`` can be encoded as UTF-8, i.e. it holds no lone surrogate."""
    return _SURROGATE_RE.search(text) is None


# Websocket transport constants (docs/protocol.md). The browser UI imports them from static/wire.js, generated
# from this module by `python -m chatd.server.wirejs`.
SUBPROTOCOL: Final = "chatd.v1"
KEY_SUBPROTOCOL_PREFIX: Final = "chatd.key."
CLOSE_IDLE: Final = 4000
CLOSE_UNAUTHORIZED: Final = 4401
CLOSE_TOO_SLOW: Final = 4408
CLOSE_TRY_AGAIN_LATER: Final = 1013
"""The server is still starting (after one ``unavailable`` error frame): connect again when /readyz is 200."""


# A DNS name or IPv4 address (underscores allowed: container names use them), or an IPv6 address in
# brackets, then an optional port. Nothing else can appear in a Host header a browser sends, and refusing
# the rest keeps a reflected Host from injecting anything into a response header.
_HOST_RE = re.compile(r"(?P<name>[a-z0-9_-]+(?:\.[a-z0-9_-]+)*\.?|\[[0-9a-f:.]+\])(?::(?P<port>[0-9]{1,5}))?")


def split_host(value: str) -> tuple[str, int | None] | None:
    """``(name, port)`` of a Host header value or an origin's ``host[:port]``: the name lower-cased and
    without a trailing dot, the port None when absent. None when ``value`` is not of that form (or the
    port is over 65535)."""
    match = _HOST_RE.fullmatch(value.lower())
    if match is None:
        return None
    port = None if match["port"] is None else int(match["port"])
    if port is not None and port > 65535:
        return None
    name = match["name"]
    return (name[:-1] if name.endswith(".") else name), port


class SessionRecord(BaseModel):
    """A stored conversation as every layer sees it (the wire's SessionInfo adds where its cache is)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    session_id: str
    title: str
    created_at: datetime
    updated_at: datetime
    message_count: int
    """Messages in the active conversation (archived ones excluded)."""
    token_count: int
    """Sum of the active messages' token counts."""


@dataclass(frozen=True)
class SnapshotRecord:
    """What the store remembers about a session's one KV snapshot file. The KV layer writes and reads
    these; the store keeps them in its ``snapshots`` table, column for column."""

    session_id: str
    file_name: str
    num_tokens: int
    """How many token ids (and K/V positions) the snapshot holds."""
    file_bytes: int
    """Size of the compressed file."""
    raw_bytes: int
    """Size of the K/V it holds, uncompressed, in the model's dtype."""
    fingerprint: str
    """sha256 of the model's fingerprint (name, weights hash, dtype, shapes): a snapshot of another
    model is never restored."""
    ids_digest: str
    """sha256 of the token ids, little-endian uint32."""
    created_at: datetime
    """Timezone-aware UTC."""
