"""The service's types (chatd.service.types) in the wire's models (chatd.protocol), and back: the one place the two
meet, so the service never validates a wire model and the wire never reaches into the service."""

from __future__ import annotations

import dataclasses

from chatd import protocol
from chatd.service import types


def session_info(info: types.SessionInfo) -> protocol.SessionInfo:
    return protocol.SessionInfo(**dataclasses.asdict(info))


def usage(value: types.Usage) -> protocol.Usage:
    return protocol.Usage(**value.to_dict())


def message(value: types.Message) -> protocol.Message:
    return protocol.Message(index=value.index, role=value.role, content=value.content, created_at=value.created_at,
                            finish_reason=value.finish_reason,
                            usage=usage(value.usage) if value.usage is not None else None,
                            unanswered=value.unanswered)


def options(params: protocol.GenerationParams | None) -> types.GenerationOptions | None:
    """A request's sampling fields as the service takes them (None: every default)."""
    if params is None:
        return None
    return types.GenerationOptions(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                                   top_k=params.top_k, seed=params.seed, stop=tuple(params.stop))
