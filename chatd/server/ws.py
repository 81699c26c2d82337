"""The websocket endpoint: protocol v1 frames in, frames out. Translation only; the work is in
SessionService.

Per connection: one reader (this coroutine), one writer task draining a bounded frame queue, and
one task per running turn. A turn never waits for the socket: frames go to the queue, and a reader
so slow that its queue fills up gets its generations cancelled and the connection closed, so a slow
client can never hold up the engine or other sessions. When the client goes away, its running
generations are cancelled and their partial replies saved.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from chatd import __version__
from chatd.domain import CLOSE_IDLE, CLOSE_TOO_SLOW, CLOSE_UNAUTHORIZED, KEY_SUBPROTOCOL_PREFIX, SUBPROTOCOL
from chatd.errors import ChatdError, RateLimited, Unauthorized
from chatd.protocol import (
    ErrorFrame,
    GenerationCancel,
    GenerationCancelled,
    Hello,
    MessageDone,
    MessageEdit,
    MessageEdited,
    MessageSend,
    Ping,
    Pong,
    SessionCreate,
    SessionCreated,
    SessionResume,
    SessionResumed,
    Token,
    _ServerFrame,
    parse_client_frame,
)
from chatd.sessions import EditResult, Turn, TurnResult

if TYPE_CHECKING:
    from chatd.config import ServerSettings
    from chatd.core import Chatd
    from chatd.server.metrics import Metrics

log = logging.getLogger(__name__)



def origin_allowed(origin: str | None, host: str | None, allowed: list[str]) -> bool:
    """Browsers send Origin: allow the server's own origin and the configured list. Programs that send
    no Origin are not browsers and are governed by the API key alone."""
    if origin is None:
        return True
    if "*" in allowed or origin in allowed:
        return True
    parts = urlsplit(origin)
    return bool(host) and parts.netloc == host


def offered_key(ws: WebSocket) -> str | None:
    auth = ws.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    if ws.headers.get("x-api-key"):
        return ws.headers["x-api-key"]
    if ws.query_params.get("api_key"):
        return ws.query_params["api_key"]
    for proto in ws.scope.get("subprotocols", []):
        if proto.startswith(KEY_SUBPROTOCOL_PREFIX):
            return str(proto[len(KEY_SUBPROTOCOL_PREFIX):])
    return None


def key_valid(key: str | None, keys: list[str]) -> bool:
    if not keys:
        return True
    if key is None:
        return False
    # Compare against every key so timing says nothing about which one matched.
    return any([hmac.compare_digest(key.encode(), k.encode()) for k in keys])


class Connection:
    def __init__(self, ws: WebSocket, core: Chatd, settings: ServerSettings, metrics: Metrics) -> None:
        self.ws = ws
        self.core = core
        self.settings = settings
        self.metrics = metrics
        self.out: asyncio.Queue[str | None] = asyncio.Queue(maxsize=settings.send_queue_frames)
        self.turns: dict[str, Turn] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.last_activity = time.monotonic()
        self.closing = False

    # ------------------------------------------------------------------ output

    def emit(self, frame: _ServerFrame) -> None:
        if self.closing:
            return
        try:
            self.out.put_nowait(frame.to_json())
        except asyncio.QueueFull:
            log.warning("closing a connection whose reader is too slow")
            self._abort(CLOSE_TOO_SLOW, "reader too slow")

    def error(self, exc: ChatdError, request_id: str | None) -> None:
        self.emit(ErrorFrame(code=exc.code, message=exc.message, id=request_id))

    def _abort(self, code: int, reason: str) -> None:
        self.closing = True
        for turn in self.turns.values():
            turn.cancel()
        self._spawn(self._close(code, reason))

    async def _close(self, code: int, reason: str) -> None:
        with contextlib.suppress(Exception):
            if self.ws.application_state == WebSocketState.CONNECTED:
                await self.ws.close(code=code, reason=reason)

    async def _writer(self) -> None:
        while True:
            text = await self.out.get()
            if text is None:
                return
            try:
                await self.ws.send_text(text)
            except Exception:  # the peer went away; the reader notices and cleans up
                return

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    # ------------------------------------------------------------------ main loop

    async def run(self) -> None:
        writer = asyncio.ensure_future(self._writer())
        watchdog = asyncio.ensure_future(self._watch_idle())
        info = self.core.runner.info
        self.emit(Hello(model=info.name, server_version=__version__, max_context=info.max_context))
        try:
            while not self.closing:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                self.last_activity = time.monotonic()
                text = message.get("text")
                if text is None:
                    data = message.get("bytes") or b""
                    try:
                        text = data.decode("utf-8")
                    except UnicodeDecodeError:
                        text = "\x00"  # not JSON: answered as bad_request below
                await self.handle(text)
        except WebSocketDisconnect:
            pass
        finally:
            self.closing = True
            for turn in list(self.turns.values()):
                turn.cancel()  # partial replies are committed by the turns themselves
            watchdog.cancel()
            writer.cancel()
            for task in list(self.tasks):
                with contextlib.suppress(BaseException):
                    await task

    async def _watch_idle(self) -> None:
        timeout = self.settings.idle_timeout_s
        while True:
            await asyncio.sleep(min(timeout / 4, 5.0))
            if not self.turns and time.monotonic() - self.last_activity > timeout:
                self._abort(CLOSE_IDLE, "idle timeout")
                return

    async def handle(self, text: str) -> None:
        try:
            frame = parse_client_frame(text, max_bytes=self.settings.max_frame_bytes)
        except ChatdError as exc:
            self.error(exc, exc.request_id)
            return
        try:
            await self.dispatch(frame)
        except ChatdError as exc:
            self.error(exc, frame.id)
        except Exception:
            log.exception("handling a %s frame failed", frame.type)
            self.emit(ErrorFrame(code="internal", message="internal error", id=frame.id))

    async def dispatch(self, frame: object) -> None:
        svc = self.core.sessions
        if isinstance(frame, Ping):
            self.emit(Pong(id=frame.id))
        elif isinstance(frame, SessionCreate):
            info = await svc.create(system=frame.system, title=frame.title)
            self.emit(SessionCreated(session=info, id=frame.id))
        elif isinstance(frame, SessionResume):
            info, messages = await svc.resume(frame.session_id)
            self.emit(SessionResumed(session=info, messages=messages, id=frame.id))
        elif isinstance(frame, MessageSend):
            self._check_generation_limits()
            turn = svc.send(frame.session_id, frame.content, frame.params)
            self._stream(turn, frame.id)
        elif isinstance(frame, MessageEdit):
            self._check_generation_limits()
            turn = svc.edit(frame.session_id, frame.index, frame.content, frame.params)
            self._stream(turn, frame.id)
        elif isinstance(frame, GenerationCancel):
            was_running = await svc.cancel(frame.session_id)
            self.emit(GenerationCancelled(session_id=frame.session_id, was_running=was_running, id=frame.id))

    def _check_generation_limits(self) -> None:
        if len(self.turns) >= self.settings.max_generations_per_connection:
            raise RateLimited(
                f"at most {self.settings.max_generations_per_connection} generations at once per connection")
        if self.core.sessions.num_generating >= self.settings.max_generations_total:
            raise RateLimited("the server is at its limit of concurrent generations; try again shortly")

    def _stream(self, turn: Turn, request_id: str | None) -> None:
        self.turns[turn.session_id] = turn
        self._spawn(self._forward(turn, request_id))

    async def _forward(self, turn: Turn, request_id: str | None) -> None:
        sid = turn.session_id
        try:
            async for piece in turn.stream():
                self.emit(Token(session_id=sid, text=piece, id=request_id))
            result = turn.result
            if isinstance(result, TurnResult):
                self.emit(MessageDone(session_id=sid, user_message=result.user_message,
                                      assistant_message=result.assistant_message,
                                      finish_reason=result.finish_reason, usage=result.usage, id=request_id))
            elif isinstance(result, EditResult):
                self.emit(MessageEdited(session_id=sid, message=result.message,
                                        invalidated_from=result.invalidated_from, id=request_id))
        except ChatdError as exc:
            self.error(exc, request_id)
        except Exception:
            log.exception("streaming a turn failed")
            self.emit(ErrorFrame(code="internal", message="internal error", id=request_id))
        finally:
            if self.turns.get(sid) is turn:
                del self.turns[sid]
            self.last_activity = time.monotonic()


async def websocket_endpoint(ws: WebSocket) -> None:
    state = ws.app.state
    core: Chatd = state.core
    settings = core.settings.server
    if not origin_allowed(ws.headers.get("origin"), ws.headers.get("host"), settings.allowed_origins):
        await ws.close(code=1008)  # before accept: the handshake is refused with 403
        return
    offered = ws.scope.get("subprotocols", [])
    await ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
    if not key_valid(offered_key(ws), settings.api_keys):
        exc = Unauthorized("a valid API key is required")
        with contextlib.suppress(Exception):
            await ws.send_text(ErrorFrame(code=exc.code, message=exc.message).to_json())
            await ws.close(code=CLOSE_UNAUTHORIZED, reason="unauthorized")
        return
    metrics: Metrics = state.metrics
    metrics.connections.inc()
    try:
        await Connection(ws, core, settings, metrics).run()
    finally:
        metrics.connections.dec()
