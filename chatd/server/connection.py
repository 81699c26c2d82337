"""One accepted websocket as a frame pump: text in, server frames out, knowing nothing of what they mean.

Per connection: one reader (the coroutine running :meth:`Connection.serve`), one writer task draining a
bounded queue of outgoing frames, and an idle watchdog. Whoever produces frames never waits for the
socket: :meth:`Connection.emit` only queues. A reader so slow that its queue fills up gets the connection
closed (4408) and its running work stopped, so a slow client can never hold up the engine or other
sessions. What the frames mean is the :class:`FrameHandler`'s business (chatd.server.dispatch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from chatd.domain import CLOSE_IDLE, CLOSE_TOO_SLOW
from chatd.protocol import ServerFrame
from chatd.tasks import TaskSet

log = logging.getLogger(__name__)

# Stands in for a binary frame that is not UTF-8: it is not JSON either, so it is answered as bad_request.
NOT_TEXT = "\x00"


class FrameHandler(Protocol):
    """What a :class:`Connection` drives: the meaning of frames."""

    @property
    def busy(self) -> bool:
        """True while work started by this connection runs; the idle watchdog leaves it alone then."""
        ...

    async def handle(self, text: str) -> None:
        """Answer one received frame (through :meth:`Connection.emit`). Must not raise for bad input."""
        ...

    def stop(self) -> None:
        """The connection is ending: cancel running work. Called at most twice, never awaited."""
        ...


class Connection:
    """The transport side of one accepted websocket.

    Frames go out in the order :meth:`emit` was called. Once the connection is closing, emitted frames
    are dropped. :meth:`serve` returns after the peer disconnected (or the connection was closed by
    :meth:`abort`) and every background task of this connection has finished.
    """

    def __init__(self, ws: WebSocket, *, send_queue_frames: int, idle_timeout_s: float) -> None:
        self.ws = ws
        self.idle_timeout_s = idle_timeout_s
        self.tasks = TaskSet()
        """Tasks that belong to this connection; :meth:`serve` waits for them before it returns."""
        self.closing = False
        self.last_activity = time.monotonic()
        self._out: asyncio.Queue[str] = asyncio.Queue(maxsize=send_queue_frames)
        self._handler: FrameHandler | None = None

    def touch(self) -> None:
        """Note activity now: the idle timeout counts from the latest frame received or turn finished."""
        self.last_activity = time.monotonic()

    def emit(self, frame: ServerFrame) -> None:
        """Queue ``frame`` for sending; never waits. A full queue closes the connection (too slow)."""
        if self.closing:
            return
        try:
            self._out.put_nowait(frame.to_json())
        except asyncio.QueueFull:
            log.warning("closing a connection whose reader is too slow")
            self.abort(CLOSE_TOO_SLOW, "reader too slow")

    def abort(self, code: int, reason: str) -> None:
        """Stop the handler's work and close the websocket with ``code`` (in the background)."""
        self.closing = True
        if self._handler is not None:
            self._handler.stop()
        self.tasks.spawn(self._close(code, reason))

    async def serve(self, handler: FrameHandler) -> None:
        """Read frames and hand each to ``handler`` until the peer goes away or the connection is closed.

        Frames are handled one at a time, in the order received. On the way out the handler is stopped
        (its running work cancelled) and this waits for the connection's tasks to finish.
        """
        self._handler = handler
        writer = asyncio.ensure_future(self._write())
        watchdog = asyncio.ensure_future(self._watch_idle(handler))
        try:
            while not self.closing:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                self.touch()
                text = message.get("text")
                if text is None:
                    try:
                        text = (message.get("bytes") or b"").decode("utf-8")
                    except UnicodeDecodeError:
                        text = NOT_TEXT
                await handler.handle(text)
        except WebSocketDisconnect:
            pass
        finally:
            self.closing = True
            handler.stop()
            watchdog.cancel()
            writer.cancel()
            await self.tasks.join()

    async def _write(self) -> None:
        while True:
            text = await self._out.get()
            try:
                await self.ws.send_text(text)
            except Exception:  # the peer went away; the reader notices and cleans up
                return

    async def _watch_idle(self, handler: FrameHandler) -> None:
        timeout = self.idle_timeout_s
        while True:
            await asyncio.sleep(min(timeout / 4, 5.0))
            if not handler.busy and time.monotonic() - self.last_activity > timeout:
                self.abort(CLOSE_IDLE, "idle timeout")
                return

    async def _close(self, code: int, reason: str) -> None:
        with contextlib.suppress(Exception):
            if self.ws.application_state == WebSocketState.CONNECTED:
                await self.ws.close(code=code, reason=reason)
