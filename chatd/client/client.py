"""ChatClient: an asyncio client for chatd's websocket protocol v1.

    async with await ChatClient.connect("ws://127.0.0.1:8000/ws") as client:
        session = await client.create_session(system="Be brief.")
        reply = await client.send(session.session_id, "Hello!", temperature=0)
        async for text in reply:
            print(text, end="", flush=True)
        print(reply.done.usage)

Frames are matched to requests by their ``id``, so one client can run several replies at once (in
different sessions). When the connection drops, pending requests and replies fail with
:class:`ConnectionLost`; the next call reconnects (with backoff) and re-sends ``session.resume`` for
every session this client used, so the server starts restoring their caches right away. A reply cut
off by a drop is saved by the server as far as it got: ``await client.resume(session_id)`` shows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.typing import Subprotocol

from chatd.domain import SUBPROTOCOL
from chatd.protocol import (
    ClientFrame,
    ErrorFrame,
    GenerationCancel,
    GenerationCancelled,
    GenerationParams,
    Hello,
    Message,
    MessageDone,
    MessageEdit,
    MessageEdited,
    MessageSend,
    Ping,
    ServerFrame,
    SessionCreate,
    SessionCreated,
    SessionInfo,
    SessionResume,
    SessionResumed,
    Token,
    parse_server_frame,
)

log = logging.getLogger(__name__)


class ChatError(Exception):
    """An ``error`` frame from the server (``code`` is the stable wire code), or a client-side failure."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ConnectionLost(ChatError):
    """The connection dropped before the answer arrived. The next call reconnects."""

    def __init__(self, message: str = "connection lost", session_id: str | None = None) -> None:
        super().__init__("connection_lost", message)
        self.session_id = session_id


class Reply:
    """A streaming reply: iterate for text pieces; afterwards :attr:`done` (a ``message.done``) or
    :attr:`edited` (a ``message.edited``, when a system or assistant message was edited) is set.

    Iteration raises :class:`ChatError` for an error frame (e.g. ``busy``, ``context_length_exceeded``)
    and :class:`ConnectionLost` when the connection drops mid-reply.
    """

    def __init__(self, client: ChatClient, request_id: str, session_id: str) -> None:
        self._client = client
        self.request_id = request_id
        self.session_id = session_id
        self._frames: asyncio.Queue[ServerFrame | BaseException] = asyncio.Queue()
        self.done: MessageDone | None = None
        self.edited: MessageEdited | None = None
        self.text = ""

    def _push(self, item: ServerFrame | BaseException) -> None:
        self._frames.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[str]:
        while self.done is None and self.edited is None:
            item = await self._frames.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, Token):
                self.text += item.text
                yield item.text
            elif isinstance(item, MessageDone):
                self.done = item
            elif isinstance(item, MessageEdited):
                self.edited = item

    async def result(self) -> MessageDone | MessageEdited:
        """Drain the stream; return the final frame."""
        async for _ in self:
            pass
        final = self.done or self.edited
        assert final is not None
        return final

    async def cancel(self) -> bool:
        """Ask the server to stop; the reply still ends with its ``message.done`` ("cancelled")."""
        return await self._client.cancel(self.session_id)


class ChatClient:
    def __init__(self, url: str, api_key: str | None = None, *, reconnect: bool = True,
                 max_frame_bytes: int = 1 << 22, open_timeout: float = 10.0, request_timeout: float = 60.0) -> None:
        self.url = url
        self.api_key = api_key
        self.reconnect = reconnect
        self.max_frame_bytes = max_frame_bytes
        self.open_timeout = open_timeout
        self.request_timeout = request_timeout
        self.hello: Hello | None = None
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[str, asyncio.Future[ServerFrame] | Reply] = {}
        self._ids = itertools.count(1)
        self._sessions: set[str] = set()
        self._connect_lock = asyncio.Lock()
        self._closed = False
        self.reconnects = 0

    @classmethod
    async def connect(cls, url: str, api_key: str | None = None, **options: Any) -> ChatClient:
        """Connect and wait for the server's ``hello``. Raises ChatError on refusal (bad key: unauthorized)."""
        client = cls(url, api_key, **options)
        await client._ensure_connected()
        return client

    async def __aenter__(self) -> ChatClient:
        await self._ensure_connected()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    @property
    def connected(self) -> bool:
        return self._ws is not None and self._reader is not None and not self._reader.done()

    # ------------------------------------------------------------------ connection

    async def _open(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        try:
            ws = await connect(self.url, additional_headers=headers, max_size=self.max_frame_bytes,
                               open_timeout=self.open_timeout, subprotocols=[Subprotocol(SUBPROTOCOL)])
        except InvalidStatus as exc:
            raise ChatError("refused", f"the server refused the connection (HTTP {exc.response.status_code})") from None
        first = parse_server_frame(await asyncio.wait_for(ws.recv(), self.open_timeout))
        if isinstance(first, ErrorFrame):
            await ws.close()
            raise ChatError(first.code, first.message)
        if not isinstance(first, Hello):
            await ws.close()
            raise ChatError("protocol", f"expected hello, got {first.type}")
        self.hello = first
        self._ws = ws
        self._reader = asyncio.ensure_future(self._read(ws))

    async def _ensure_connected(self) -> None:
        if self._closed:
            raise ChatError("closed", "the client is closed")
        if self.connected:
            return
        async with self._connect_lock:
            if self.connected:
                return
            first_time = self.hello is None
            delay = 0.2
            attempts = 1 if first_time or not self.reconnect else 8
            for attempt in range(attempts):
                try:
                    await self._open()
                    break
                except (OSError, TimeoutError, ConnectionClosed) as exc:
                    if attempt == attempts - 1:
                        raise ConnectionLost(f"cannot connect to {self.url}: {exc}") from None
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
            if not first_time:
                self.reconnects += 1
                for session_id in list(self._sessions):
                    with contextlib.suppress(ChatError, ConnectionClosed):
                        await self._send_frame(SessionResume(session_id=session_id, id=self._next_id()))

    async def _read(self, ws: ClientConnection) -> None:
        try:
            async for raw in ws:
                frame = parse_server_frame(raw)
                rid = frame.id or ""
                target = self._pending.get(rid)
                if isinstance(target, Reply):
                    if isinstance(frame, ErrorFrame):
                        target._push(ChatError(frame.code, frame.message))
                        self._pending.pop(rid, None)
                    else:
                        target._push(frame)
                        if isinstance(frame, MessageDone | MessageEdited):
                            self._pending.pop(rid, None)
                elif target is not None:
                    self._pending.pop(rid, None)
                    if not target.done():
                        target.set_result(frame)
                elif isinstance(frame, ErrorFrame):
                    log.warning("server error: %s: %s", frame.code, frame.message)
        except ConnectionClosed:
            pass
        finally:
            self._ws = None
            pending, self._pending = self._pending, {}
            for target in pending.values():
                if isinstance(target, Reply):
                    target._push(ConnectionLost("connection lost mid-reply", target.session_id))
                elif not target.done():
                    target.set_exception(ConnectionLost())

    def _next_id(self) -> str:
        return f"c{next(self._ids)}"

    async def _send_frame(self, frame: ClientFrame) -> None:
        if self._ws is None:
            raise ConnectionLost()
        try:
            await self._ws.send(frame.model_dump_json(exclude_none=True))
        except ConnectionClosed:
            raise ConnectionLost() from None

    async def _request(self, frame: ClientFrame) -> ServerFrame:
        await self._ensure_connected()
        frame.id = self._next_id()
        future: asyncio.Future[ServerFrame] = asyncio.get_running_loop().create_future()
        self._pending[frame.id] = future
        try:
            await self._send_frame(frame)
            answer = await asyncio.wait_for(future, self.request_timeout)
        finally:
            self._pending.pop(frame.id, None)
        if isinstance(answer, ErrorFrame):
            raise ChatError(answer.code, answer.message)
        return answer

    async def _start_reply(self, frame: MessageSend | MessageEdit) -> Reply:
        await self._ensure_connected()
        frame.id = self._next_id()
        reply = Reply(self, frame.id, frame.session_id)
        self._pending[frame.id] = reply
        self._sessions.add(frame.session_id)
        try:
            await self._send_frame(frame)
        except BaseException:
            self._pending.pop(frame.id, None)
            raise
        return reply

    # ------------------------------------------------------------------ API

    async def create_session(self, system: str | None = None, title: str | None = None) -> SessionInfo:
        answer = await self._request(SessionCreate(system=system, title=title))
        assert isinstance(answer, SessionCreated)
        self._sessions.add(answer.session.session_id)
        return answer.session

    async def resume(self, session_id: str) -> tuple[SessionInfo, list[Message]]:
        """The session and its messages; the server starts restoring its cache."""
        answer = await self._request(SessionResume(session_id=session_id))
        assert isinstance(answer, SessionResumed)
        self._sessions.add(session_id)
        return answer.session, answer.messages

    async def send(self, session_id: str, content: str, *, max_tokens: int | None = None,
                   temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                   seed: int | None = None, stop: list[str] | None = None) -> Reply:
        """Send a user message; returns the streaming :class:`Reply`."""
        params = GenerationParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                  seed=seed, stop=stop or [])
        return await self._start_reply(MessageSend(session_id=session_id, content=content, params=params))

    async def edit(self, session_id: str, index: int, content: str, *, max_tokens: int | None = None,
                   temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                   seed: int | None = None, stop: list[str] | None = None) -> Reply:
        """Replace message ``index`` (later messages are dropped); a user message gets a new reply."""
        params = GenerationParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                  seed=seed, stop=stop or [])
        return await self._start_reply(MessageEdit(session_id=session_id, index=index, content=content,
                                                   params=params))

    async def cancel(self, session_id: str) -> bool:
        """Stop the session's running generation; True when one was running."""
        answer = await self._request(GenerationCancel(session_id=session_id))
        assert isinstance(answer, GenerationCancelled)
        return answer.was_running

    async def ping(self) -> float:
        """Round-trip time in seconds."""
        started = time.monotonic()
        await self._request(Ping())
        return time.monotonic() - started

    async def close(self) -> None:
        self._closed = True
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            with contextlib.suppress(BaseException):
                await self._reader
