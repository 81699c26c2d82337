"""The OpenAI Chat Completions wire format: requests in, chatd's words out, and OpenAI's objects back.

Pure translation, no I/O: :func:`parse_request` checks a decoded JSON body field by field and names the
first field it cannot honour (a malformed value, or a feature chatd does not have) in an
:class:`~chatd.errors.InvalidParam`; nothing is ignored silently. The builders render chatd's turn results
as OpenAI's ``chat.completion`` and ``chat.completion.chunk`` objects, with chatd's own provenance of the
context in an extra ``chatd`` field, and errors in OpenAI's ``{"error": {message, type, param, code}}``.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from chatd.domain import Role, is_valid_unicode
from chatd.errors import (
    Busy,
    ChatdError,
    ContextLengthExceeded,
    InvalidParam,
    NotFound,
    RateLimited,
    TooLarge,
    Unauthorized,
)
from chatd.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS
from chatd.service.stats import ModelFacts
from chatd.service.types import GenerationOptions, Usage

MAX_MESSAGES = 10_000

ROLE_NAMES: dict[str, Role] = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
"""Accepted roles; ``developer`` is OpenAI's newer name for a system message."""

NEUTRAL: dict[str, tuple[object, ...]] = {
    "n": (1,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "store": (False,),
    "parallel_tool_calls": (),
}
"""Fields chatd has no feature for, accepted only with the value (or null) that asks for nothing."""

UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "logit_bias",
               "audio", "modalities", "prediction", "web_search_options", "reasoning_effort", "service_tier",
               "metadata", "verbosity")
"""Known OpenAI fields chatd does not implement; any value but null gets a 400 naming the field."""

SUPPORTED = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "stop",
             "seed", "stream", "stream_options", "user")


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[tuple[Role, str]]
    params: GenerationOptions
    stream: bool
    include_usage: bool
    user: str


def _fail(param: str, message: str) -> InvalidParam:
    return InvalidParam(param, f"{param}: {message}")


def _number(body: dict[str, Any], name: str, *, integer: bool, low: float, high: float,
            low_open: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or (integer and not isinstance(value, int)):
        raise _fail(name, f"must be {'an integer' if integer else 'a number'}")
    if value < low or value > high or (low_open and value == low):
        raise _fail(name, f"must be {'>' if low_open else '>='} {low} and <= {high}")
    return value


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise _fail(param, "must be a string")
    if not is_valid_unicode(value):
        raise _fail(param, "is not valid Unicode (it holds a lone surrogate)")
    return value


def _content(value: Any, param: str) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(value, str):
        return _text(value, param)
    if not isinstance(value, list):
        raise _fail(param, "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(value):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _fail(where, "must be an object")
        kind = part.get("type")
        if kind != "text":
            raise _fail(f"{where}.type", f"content parts of type {kind!r} are not supported (only text)")
        for key in part:
            if key not in ("type", "text"):
                raise _fail(f"{where}.{key}", "is not supported")
        texts.append(_text(part.get("text"), f"{where}.text"))
    return "".join(texts)


def _messages(value: Any) -> list[tuple[Role, str]]:
    if not isinstance(value, list) or not value:
        raise _fail("messages", "must be a non-empty list")
    if len(value) > MAX_MESSAGES:
        raise _fail("messages", f"at most {MAX_MESSAGES} messages")
    out: list[tuple[Role, str]] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _fail(where, "must be an object")
        role = message.get("role")
        if role not in ROLE_NAMES:
            raise _fail(f"{where}.role", f"role {role!r} is not supported (system, developer, user, assistant)")
        for key, field_value in message.items():
            if key in ("role", "content") or (key == "refusal" and field_value is None):
                continue
            raise _fail(f"{where}.{key}", "is not supported")
        out.append((ROLE_NAMES[role], _content(message.get("content"), f"{where}.content")))
    if out[-1][0] != "user":
        raise _fail(f"messages[{len(out) - 1}].role", "the last message must be a user message")
    return out


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS:
        raise _fail("stop", f"must be a string or a list of at most {MAX_STOP_STRINGS} strings")
    for stop in stops:
        if not isinstance(stop, str) or not 1 <= len(stop) <= MAX_STOP_CHARS or not is_valid_unicode(stop):
            raise _fail("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
    return list(stops)


def parse_request(body: Any) -> ChatRequest:
    """A checked chat completion request. Raises InvalidParam naming the first field it cannot honour."""
    if not isinstance(body, dict):
        raise InvalidParam(None, "the request body must be a JSON object")
    for name, value in body.items():
        if name in SUPPORTED or value is None:
            continue
        if name in NEUTRAL:
            if value not in NEUTRAL[name] or isinstance(value, bool) != isinstance(NEUTRAL[name][0], bool):
                raise _fail(name, f"{value!r} is not supported" + (
                    f" (only {NEUTRAL[name][0]!r})" if NEUTRAL[name] else ""))
            continue
        raise _fail(name, "is not supported by chatd" if name in UNSUPPORTED else "unknown field")
    model = _text(body.get("model"), "model")
    messages = _messages(body.get("messages"))
    max_tokens = _number(body, "max_tokens", integer=True, low=1, high=1 << 20)
    max_completion = _number(body, "max_completion_tokens", integer=True, low=1, high=1 << 20)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise _fail("max_tokens", "give max_tokens or max_completion_tokens, not two different values")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _fail("stream", "must be a boolean")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise _fail("stream_options", "is only allowed when stream is true")
        if not isinstance(options, dict):
            raise _fail("stream_options", "must be an object")
        for key, value in options.items():
            if key != "include_usage" or not isinstance(value, bool):
                raise _fail(f"stream_options.{key}", "is not supported (only include_usage: bool)")
        include_usage = bool(options.get("include_usage"))
    user = body.get("user")
    if user is not None:
        user = _text(user, "user")
        if len(user) > 256:
            raise _fail("user", "at most 256 characters")
    params = GenerationOptions(
        max_tokens=max_completion if max_completion is not None else max_tokens,
        temperature=_number(body, "temperature", integer=False, low=0, high=2),
        top_p=_number(body, "top_p", integer=False, low=0, high=1, low_open=True),
        top_k=_number(body, "top_k", integer=True, low=0, high=1 << 20),
        seed=_number(body, "seed", integer=True, low=0, high=(1 << 63) - 1),
        stop=tuple(_stop(body.get("stop"))),
    )
    return ChatRequest(model, messages, params, bool(stream), include_usage, user or "")


# ----------------------------------------------------------------------------- answers


def completion_id() -> str:
    return "chatcmpl-" + secrets.token_urlsafe(18)


def finish_reason(reason: str) -> str:
    """OpenAI's finish reason; a cancelled reply (the server shutting down) ends as ``stop``."""
    return "length" if reason == "length" else "stop"


def usage_object(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.input_tokens, "completion_tokens": usage.output_tokens,
            "total_tokens": usage.input_tokens + usage.output_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def provenance(usage: Usage | None, session_id: str | None, reason: str | None = None) -> dict[str, Any]:
    """chatd's extra field: where the context came from, and the named session, if any."""
    extra: dict[str, Any] = {"session_id": session_id}
    if usage is not None:
        extra.update(cache_tier=usage.cache_tier, cached_tokens=usage.cached_tokens,
                     prefill_tokens=usage.prefill_tokens, restore_ms=usage.restore_ms, ttft_ms=usage.ttft_ms,
                     decode_tokens_per_s=usage.decode_tokens_per_s, invalidated_from=usage.invalidated_from,
                     finish_reason=reason)
    return extra


def completion(cid: str, model: str, text: str, reason: str, usage: Usage, session_id: str | None) -> dict[str, Any]:
    return {
        "id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                     "finish_reason": finish_reason(reason), "logprobs": None}],
        "usage": usage_object(usage),
        "chatd": provenance(usage, session_id, reason),
    }


def chunk(cid: str, model: str, created: int, *, delta: dict[str, Any] | None = None, reason: str | None = None,
          usage: Usage | None = None, with_usage: bool = False, session_id: str | None = None,
          final: bool = False) -> dict[str, Any]:
    """One ``chat.completion.chunk``. ``delta`` None with ``usage``: the usage-only chunk (empty choices).
    ``with_usage``: the client asked for usage, so other chunks carry ``usage: null``."""
    body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
    if delta is None and usage is not None:
        body["choices"] = []
        body["usage"] = usage_object(usage)
    else:
        body["choices"] = [{"index": 0, "delta": delta or {}, "logprobs": None,
                            "finish_reason": None if reason is None else finish_reason(reason)}]
        if with_usage:
            body["usage"] = None
    body["chatd"] = provenance(usage if final else None, session_id, reason if final else None)
    return body


def model_object(model: ModelFacts, created: int) -> dict[str, Any]:
    """OpenAI's model object, with what chatd runs under ``chatd`` (as ``/admin/stats`` model says it)."""
    return {"id": model.name, "object": "model", "created": created, "owned_by": "chatd",
            "chatd": {"architecture": model.architecture, "parameters": model.parameters,
                      "max_context": model.max_context, "weights": model.weights, "weights_from": model.weights_from,
                      "kv_dtype": model.dtype, "compact_forward": model.weights != "transformers"}}


_CODES: dict[type[ChatdError], tuple[str, str]] = {
    Unauthorized: ("invalid_request_error", "invalid_api_key"),
    ContextLengthExceeded: ("invalid_request_error", "context_length_exceeded"),
    TooLarge: ("invalid_request_error", "request_too_large"),
    NotFound: ("invalid_request_error", "not_found"),
    Busy: ("invalid_request_error", "busy"),
    RateLimited: ("rate_limit_error", "rate_limit_exceeded"),
}


def error_body(exc: ChatdError) -> dict[str, Any]:
    """OpenAI's error object for a chatd error (its HTTP status is ``exc.http_status``)."""
    kind, code = next(((k, c) for cls, (k, c) in _CODES.items() if isinstance(exc, cls)),
                      ("server_error" if exc.http_status >= 500 else "invalid_request_error", exc.code))
    param = getattr(exc, "param", None)
    if isinstance(exc, ContextLengthExceeded):
        param = "messages"
    return {"error": {"message": exc.message, "type": kind, "param": param, "code": code}}
