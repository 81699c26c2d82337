"""The websocket transport ``chatd serve`` runs: uvicorn's sans-I/O ``websockets`` protocol with a fixed socket
send buffer.

The slow-reader limit (close 4408, generations cancelled) counts frames queued in
:class:`~chatd.server.connection.Connection` that the socket would not take. Linux grows a socket's send buffer
on its own (``tcp_wmem``, up to 4 MiB by default), so a client that stopped reading could leave megabytes of
frames in the kernel while the queue stayed empty and its generations ran on to ``length``. A fixed
``SO_SNDBUF`` turns that growth off: what the server holds for one connection is then bounded by this buffer,
the transport's write buffer (``WRITE_BUFFER_BYTES``) and ``send_queue_frames`` frames, and a reader that
stops gets closed once those fill.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

log = logging.getLogger(__name__)

SEND_BUFFER_BYTES = 64 * 1024
"""``SO_SNDBUF`` of every websocket connection (Linux doubles it for bookkeeping). Token frames are ~100 bytes,
so this is room for hundreds of them; only a reader that stopped fills it."""
WRITE_BUFFER_BYTES = 64 * 1024
"""The transport's write buffer high-water mark: past it the protocol stops sending until the socket drains."""


def limit_send_buffer(transport: asyncio.BaseTransport, size: int = SEND_BUFFER_BYTES) -> None:
    """Fix the socket's send buffer at ``size`` bytes (no autotuning); a transport without a socket is left alone."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)


class WebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O ``websockets`` protocol (``ws="websockets-sansio"``) with :func:`limit_send_buffer`
    applied when the connection upgrades, and one edge for a peer that breaks the protocol: the connection is closed
    with the code RFC 6455 gives (1002 for a malformed frame, 1007 for a text frame that is not UTF-8, 1009 for one
    over the size limit) and one warning line is logged, never a traceback (a client must not be able to fill the
    log with stack traces)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        limit_send_buffer(transport)
        transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)
        super().connection_made(transport)

    def send_receive_event_to_app(self) -> None:
        if self.curr_msg_data_type == "text" and not self.close_sent:
            try:
                b"".join(self.frames).decode()
            except UnicodeDecodeError:
                self.frames = []
                self.conn.send_close(1007, "invalid UTF-8")
                self.handle_parser_exception()
                return
        super().send_receive_event_to_app()

    def handle_parser_exception(self) -> None:
        close = self.conn.close_sent
        cause = self.conn.parser_exc
        log.warning("closing a websocket connection that broke the protocol (%s%s)",
                    f"{close.code} {close.reason}".strip() if close is not None else "no close frame",
                    f": {cause}" if cause is not None else "")
        super().handle_parser_exception()
