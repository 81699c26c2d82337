"""The websocket endpoint ``GET /ws``: the handshake (origin, API key, subprotocol), then a
:class:`~chatd.server.connection.Connection` pumping frames through a
:class:`~chatd.server.dispatch.Dispatcher`.

The connection owns the transport (send queue, slow readers, idle timeout); the dispatcher owns the
meaning of frames. When the client goes away, its running generations are cancelled and their partial
replies saved.
"""

from __future__ import annotations

import contextlib
import hmac
from typing import TYPE_CHECKING

from starlette.websockets import WebSocket

from chatd import __version__
from chatd.domain import CLOSE_UNAUTHORIZED, KEY_SUBPROTOCOL_PREFIX, SUBPROTOCOL
from chatd.errors import Unauthorized
from chatd.protocol import ErrorFrame, Hello
from chatd.server.connection import Connection
from chatd.server.dispatch import Dispatcher
from chatd.server.security import HostAllowList, origin_allowed

if TYPE_CHECKING:
    from chatd.server.metrics import Metrics
    from chatd.service.core import Chatd


def offered_key(ws: WebSocket) -> str | None:
    """The API key the client offered: bearer header, X-API-Key header, ``api_key`` query parameter or a
    ``chatd.key.<key>`` subprotocol, in that order of preference; None when it offered none."""
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
    """True when no keys are configured or ``key`` is one of them (compared in constant time)."""
    if not keys:
        return True
    if key is None:
        return False
    # Compare against every key so timing says nothing about which one matched.
    return any([hmac.compare_digest(key.encode(), k.encode()) for k in keys])


async def websocket_endpoint(ws: WebSocket) -> None:
    """``GET /ws``: check the origin and the API key, then pump frames through a Dispatcher until the end.

    The Host was checked by :class:`~chatd.server.security.SecurityMiddleware` already. A refused origin
    gets HTTP 403 at handshake time; a missing or wrong key gets one ``unauthorized``
    error frame and close code 4401. The subprotocol is selected when offered.
    """
    state = ws.app.state
    core: Chatd = state.core
    settings = core.settings.server
    hosts: HostAllowList = state.allowed_hosts
    if not origin_allowed(ws.headers.get("origin"), ws.headers.get("host"), hosts, settings.allowed_origins):
        await ws.close(code=1008)  # before accept: the handshake is refused with 403
        return
    offered = ws.scope.get("subprotocols", [])
    await ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
    if not key_valid(offered_key(ws), settings.api_keys):
        with contextlib.suppress(Exception):
            await ws.send_text(ErrorFrame.of(Unauthorized("a valid API key is required")).to_json())
            await ws.close(code=CLOSE_UNAUTHORIZED, reason="unauthorized")
        return
    metrics: Metrics = state.metrics
    metrics.connections.inc()
    try:
        conn = Connection(ws, send_queue_frames=settings.send_queue_frames, idle_timeout_s=settings.idle_timeout_s)
        info = core.runner.info
        conn.emit(Hello(model=info.name, server_version=__version__, max_context=info.max_context))
        await conn.serve(Dispatcher(conn, core, settings))
    finally:
        metrics.connections.dec()
