"""The OpenAI-compatible HTTP API: ``GET /v1/models`` and ``POST /v1/chat/completions`` (docs/openai.md).

Translation only, like the websocket dispatcher: the body is checked by :mod:`chatd.server.openai_wire`,
the turn runs through the SessionService (the same turns, cache leases and limits as ``/ws``):

* without ``X-Chatd-Session``, the request is stateless: :meth:`SessionService.complete` runs it in an
  ephemeral cache chosen by longest shared token prefix;
* with ``X-Chatd-Session: <id>`` (or ``new``), the request's messages are reconciled with that stored
  session like an edit (:meth:`SessionService.converse`), so the conversation is durable.

Keys are ``[server] api_keys`` as ``Authorization: Bearer``; the admin token is never accepted here. A
client that goes away (streaming or not) cancels its generation; a named session keeps the partial reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPBearer

from chatd.domain import is_session_id
from chatd.errors import (
    BadRequest,
    ChatdError,
    Internal,
    InvalidParam,
    NotFound,
    RateLimited,
    TooLarge,
    Unauthorized,
    Unavailable,
)
from chatd.server import openai_wire as wire
from chatd.server.security import bearer_matches
from chatd.server.ws import key_valid
from chatd.service.core import Chatd
from chatd.service.stats import model_facts
from chatd.service.turns import Turn
from chatd.service.types import TurnResult

log = logging.getLogger(__name__)
T = TypeVar("T")

SESSION_HEADER = "X-Chatd-Session"
NEW_SESSION = "new"

# Documents the key in OpenAPI (the page's "Authorize"); the check itself is _authorize's.
API_KEY_BEARER = HTTPBearer(auto_error=False, scheme_name="apiKey", description="a key of [server] api_keys, when set")
router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(API_KEY_BEARER)])


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def error_response(exc: ChatdError) -> JSONResponse:
    return JSONResponse(wire.error_body(exc), status_code=exc.http_status)


def _authorize(request: Request) -> str:
    """Check the bearer key; return the caller's partition key (a digest of the key, never the key)."""
    core: Chatd = request.app.state.core
    header = request.headers.get("authorization")
    if bearer_matches(header, request.app.state.admin_token):
        raise Unauthorized("the admin token is not an API key")
    token = header[7:].strip() if header and header.lower().startswith("bearer ") else None
    if not key_valid(token, core.settings.server.api_keys):
        raise Unauthorized("a valid API key is required (Authorization: Bearer <key>)")
    if not core.settings.server.api_keys:
        return ""
    return hashlib.sha256((token or "").encode()).hexdigest()[:16]


async def _read_body(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"the request body exceeds the limit of {limit} bytes")
    body = bytearray()
    async for piece in request.stream():
        body.extend(piece)
        if len(body) > limit:
            raise TooLarge(f"the request body exceeds the limit of {limit} bytes")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise InvalidParam(None, "the request body is not valid JSON") from None


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body has been read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """``work``, or ClientGone as soon as the client disconnects (``work`` is then cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise ClientGone()
    return task.result()


@router.get("/models")
async def list_models(request: Request) -> Response:
    try:
        _authorize(request)
    except ChatdError as exc:
        return error_response(exc)
    core: Chatd = request.app.state.core
    return JSONResponse({"object": "list", "data": [wire.model_object(model_facts(core.runner.info),
                                                                       request.app.state.started_at)]})


@router.get("/models/{model}")
async def get_model(model: str, request: Request) -> Response:
    try:
        _authorize(request)
        core: Chatd = request.app.state.core
        if model != core.runner.info.name:
            raise NotFound(f"the model {model!r} does not exist")
    except ChatdError as exc:
        return error_response(exc)
    return JSONResponse(wire.model_object(model_facts(core.runner.info), request.app.state.started_at))


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    """Start the turn, wait for its first event (so that a refused request gets its real HTTP status), then
    answer whole or as Server-Sent Events."""
    core: Chatd = request.app.state.core
    try:
        partition = _authorize(request)
        settings = core.settings.server
        req = wire.parse_request(await _read_body(request, settings.max_frame_bytes))
        model = core.runner.info.name
        if req.model != model:
            raise NotFound(f"the model {req.model!r} does not exist (this server has {model!r})")
        if not core.worker.alive:
            raise Unavailable("the engine has stopped")
        if core.sessions.num_generating >= settings.max_generations_total:
            raise RateLimited("the server is at its limit of concurrent generations; try again shortly")
        session_id = await _named_session(request, core)
        if session_id is None:
            turn = core.sessions.complete(req.messages, req.params, partition=f"{partition}:{req.user}")
        else:
            turn = core.sessions.converse(session_id, req.messages, req.params)
        try:
            events = turn.stream()
            first = await _unless_gone(request, _first_event(events))
        except BaseException:
            turn.cancel()
            raise
    except ClientGone:
        return Response(status_code=499)
    except ChatdError as exc:
        return error_response(exc)
    headers = {SESSION_HEADER: session_id} if session_id else {}
    if req.stream:
        return StreamingResponse(_sse(request, turn, events, first, req, model, session_id),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
    try:
        text = await _unless_gone(request, _collect(events, first))
    except ClientGone:
        turn.cancel()
        return Response(status_code=499)
    except ChatdError as exc:
        return error_response(exc)
    result = turn.result
    assert isinstance(result, TurnResult)
    body = wire.completion(wire.completion_id(), model, text, result.finish_reason, result.usage, session_id)
    return JSONResponse(body, headers=headers)


async def _named_session(request: Request, core: Chatd) -> str | None:
    """The session named by ``X-Chatd-Session`` (``new`` creates one), or None for a stateless request."""
    value = request.headers.get(SESSION_HEADER)
    if value is None:
        return None
    value = value.strip()
    if value == NEW_SESSION:
        return (await core.sessions.create()).session_id
    if not is_session_id(value):
        raise InvalidParam(SESSION_HEADER, f"{SESSION_HEADER} must be a session id or {NEW_SESSION!r}")
    await core.sessions.turns.require(value)
    return value


_END = object()


async def _first_event(events: AsyncIterator[str]) -> str | object:
    """The turn's first text piece, or _END when it finished without one; raises the turn's error."""
    async for piece in events:
        return piece
    return _END


async def _collect(events: AsyncIterator[str], first: str | object) -> str:
    pieces = [first] if isinstance(first, str) else []
    if first is not _END:
        pieces.extend([piece async for piece in events])
    return "".join(pieces)


async def _sse(request: Request, turn: Turn, events: AsyncIterator[str], first: str | object,
               req: wire.ChatRequest, model: str, session_id: str | None) -> AsyncIterator[str]:
    """The stream: a role chunk, content chunks, a finish chunk (with chatd's provenance), the usage chunk
    when asked for, ``[DONE]``. A client that disconnects cancels the turn (also while no token flows)."""
    cid, created = wire.completion_id(), int(time.time())

    def event(body: dict[str, Any]) -> str:
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def piece_chunk(delta: dict[str, Any]) -> str:
        return event(wire.chunk(cid, model, created, delta=delta, with_usage=req.include_usage,
                                session_id=session_id))

    async def cancel_when_gone() -> None:
        await _disconnected(request)
        turn.cancel()

    watcher = asyncio.ensure_future(cancel_when_gone())
    try:
        yield piece_chunk({"role": "assistant", "content": ""})
        if isinstance(first, str):
            yield piece_chunk({"content": first})
            try:
                async for piece in events:
                    yield piece_chunk({"content": piece})
            except ChatdError as exc:
                yield event(wire.error_body(exc))
                return
            except Exception:
                log.exception("streaming a chat completion failed")
                yield event(wire.error_body(Internal()))
                return
        result = turn.result
        assert isinstance(result, TurnResult)
        yield event(wire.chunk(cid, model, created, delta={}, reason=result.finish_reason, usage=result.usage,
                               with_usage=req.include_usage, session_id=session_id, final=True))
        if req.include_usage:
            yield event(wire.chunk(cid, model, created, usage=result.usage, session_id=session_id))
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        if turn.result is None:
            turn.cancel()


def is_openai_path(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def http_error(status: int, detail: str) -> JSONResponse:
    """A routing error (404, 405) on a /v1 path, in OpenAI's shape."""
    exc: ChatdError = NotFound(detail) if status == 404 else BadRequest(detail)
    response = error_response(exc)
    response.status_code = status
    return response
