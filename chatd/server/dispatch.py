"""What websocket frames mean: one client frame in, the SessionService call it names, answer frames out.

Translation only; the work is in SessionService. Every answer carries the request's ``id``. A frame that
fails gets an ``error`` frame with its wire code and the connection stays usable; anything that is not a
ChatdError is logged and reported as ``internal`` without details. Turns (``message.send`` and
``message.edit``) run in their own tasks, so other frames are answered while they stream.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, assert_never

from chatd.errors import ChatdError, Internal, RateLimited
from chatd.protocol import (
    ClientFrame,
    ErrorFrame,
    GenerationCancel,
    GenerationCancelled,
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
    parse_client_frame,
)
from chatd.server import wiremap
from chatd.service.turns import Turn
from chatd.service.types import EditResult, TurnResult

if TYPE_CHECKING:
    from chatd.config import ServerSettings
    from chatd.server.connection import Connection
    from chatd.service.core import Chatd

log = logging.getLogger(__name__)


class Dispatcher:
    """The :class:`~chatd.server.connection.FrameHandler` of protocol v1 for one connection.

    Keeps the connection's running turns (at most one per session). When the connection ends, :meth:`stop`
    cancels them; each cancelled turn still commits its partial reply (SessionService does that).
    """

    def __init__(self, conn: Connection, core: Chatd, settings: ServerSettings) -> None:
        self.conn = conn
        self.core = core
        self.settings = settings
        self.turns: dict[str, Turn] = {}
        """Running turns of this connection by session id."""

    @property
    def busy(self) -> bool:
        return bool(self.turns)

    def stop(self) -> None:
        for turn in list(self.turns.values()):
            turn.cancel()

    async def handle(self, text: str) -> None:
        try:
            frame = parse_client_frame(text, max_bytes=self.settings.max_frame_bytes)
        except ChatdError as exc:
            self.conn.emit(ErrorFrame.of(exc, exc.request_id))
            return
        try:
            await self.dispatch(frame)
        except ChatdError as exc:
            self.conn.emit(ErrorFrame.of(exc, frame.id))
        except Exception:
            log.exception("handling a %s frame failed", frame.type)
            self.conn.emit(ErrorFrame.of(Internal(), frame.id))

    async def dispatch(self, frame: ClientFrame) -> None:
        """Carry out one valid frame. Raises the ChatdError to report (``handle`` turns it into a frame)."""
        svc = self.core.sessions
        emit = self.conn.emit
        match frame:
            case Ping():
                emit(Pong(id=frame.id))
            case SessionCreate():
                info = await svc.create(system=frame.system, title=frame.title)
                emit(SessionCreated(session=wiremap.session_info(info), id=frame.id))
            case SessionResume():
                info, messages = await svc.resume(frame.session_id)
                emit(SessionResumed(session=wiremap.session_info(info), messages=[wiremap.message(m) for m in messages],
                                    id=frame.id))
            case MessageSend():
                self._check_generation_limits()
                self._stream(svc.send(frame.session_id, frame.content, wiremap.options(frame.params)), frame.id)
            case MessageEdit():
                self._check_generation_limits()
                self._stream(svc.edit(frame.session_id, frame.index, frame.content, wiremap.options(frame.params)),
                             frame.id)
            case GenerationCancel():
                was_running = await svc.cancel(frame.session_id)
                emit(GenerationCancelled(session_id=frame.session_id, was_running=was_running, id=frame.id))
            case _:
                assert_never(frame)

    def _check_generation_limits(self) -> None:
        if len(self.turns) >= self.settings.max_generations_per_connection:
            raise RateLimited(
                f"at most {self.settings.max_generations_per_connection} generations at once per connection")
        if self.core.sessions.num_generating >= self.settings.max_generations_total:
            raise RateLimited("the server is at its limit of concurrent generations; try again shortly")

    def _stream(self, turn: Turn, request_id: str | None) -> None:
        self.turns[turn.session_id] = turn
        self.conn.tasks.spawn(self._forward(turn, request_id))

    async def _forward(self, turn: Turn, request_id: str | None) -> None:
        sid = turn.session_id
        emit = self.conn.emit
        try:
            async for piece in turn.stream():
                emit(Token(session_id=sid, text=piece, id=request_id))
            result = turn.result
            if isinstance(result, TurnResult):
                emit(MessageDone(session_id=sid, user_message=wiremap.message(result.user_message),
                                 assistant_message=wiremap.message(result.assistant_message),
                                 finish_reason=result.finish_reason, usage=wiremap.usage(result.usage), id=request_id))
            elif isinstance(result, EditResult):
                emit(MessageEdited(session_id=sid, message=wiremap.message(result.message),
                                   invalidated_from=result.invalidated_from, id=request_id))
        except ChatdError as exc:
            emit(ErrorFrame.of(exc, request_id))
        except Exception:
            log.exception("streaming a turn failed")
            emit(ErrorFrame.of(Internal(), request_id))
        finally:
            if self.turns.get(sid) is turn:
                del self.turns[sid]
            self.conn.touch()
