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
import socket

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

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
    applied when the connection upgrades."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        limit_send_buffer(transport)
        transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)
        super().connection_made(transport)
