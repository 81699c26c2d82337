"""Browser-facing hardening: the Host allow-list, the Origin rule built on it, and response headers.

DNS rebinding lets a foreign page reach a loopback server under the attacker's own name: the browser then
sends ``Host`` and ``Origin`` that both carry that name, so neither may be trusted as the server's
identity. The allow-list below is the server's identity instead; :class:`SecurityMiddleware` refuses
every request whose Host is not on it and stamps the security headers on HTTP answers.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chatd.config import ServerSettings
from chatd.domain import split_host

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
WILDCARD_BIND = ("0.0.0.0", "::", "[::]", "")

# The UI (static/) is ES modules and a stylesheet from the same origin, a data: favicon, fetch() to /admin
# and one websocket back to the host that served the page. Nothing inline: no inline scripts, no style
# attributes (the JS sets styles through the CSSOM, which CSP does not govern).
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self' ws://{host} wss://{host}; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
_COMMON_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
)
# The Swagger UI page (chatd.server.docs; its assets come from this server) starts with an inline script: a
# strict CSP would blank it, and it shows nothing the OpenAPI document does not.
_NO_CSP_PATHS = frozenset({"/docs"})


@dataclass(frozen=True)
class HostRule:
    """One allowed host name; ``ports`` None means any port, else the ports allowed (None = no port)."""

    name: str
    ports: frozenset[int | None] | None

    def matches(self, name: str, port: int | None) -> bool:
        return name == self.name and (self.ports is None or port in self.ports)


@dataclass(frozen=True)
class HostAllowList:
    """Which ``host[:port]`` values name this server. ``any_host`` is ``allowed_hosts = ["*"]``."""

    rules: tuple[HostRule, ...]
    any_host: bool = False

    @classmethod
    def from_settings(cls, server: ServerSettings) -> HostAllowList:
        """The configured list, or the default one: ``host`` and the loopback names, with the configured
        port or none (any port when the port is 0, as the bound one is not known here)."""
        if "*" in server.allowed_hosts:
            return cls(rules=(), any_host=True)
        if server.allowed_hosts:
            rules = []
            for entry in server.allowed_hosts:
                parsed = split_host(entry)
                assert parsed is not None, "config validated the entries"
                name, port = parsed
                rules.append(HostRule(name, None if port is None else frozenset({port})))
            return cls(rules=tuple(rules))
        host = server.host.lower()
        own = f"[{host}]" if ":" in host and not host.startswith("[") else host
        names = dict.fromkeys((own, *LOOPBACK_NAMES))  # ordered, without duplicates
        ports: frozenset[int | None] | None = None if server.port == 0 else frozenset({None, server.port})
        return cls(rules=tuple(HostRule(name, ports) for name in names if name))

    def allows(self, value: str | None) -> bool:
        """True when ``value`` (a Host header, or an origin's netloc) is well formed and allowed. A missing
        or malformed value is refused even with ``*``: no browser sends one."""
        parsed = split_host(value) if value else None
        if parsed is None:
            return False
        return self.any_host or any(rule.matches(*parsed) for rule in self.rules)


def origin_allowed(origin: str | None, host: str | None, hosts: HostAllowList, allowed_origins: list[str]) -> bool:
    """Browsers send Origin: allow an http(s) origin whose ``host[:port]`` is an allowed host, and the
    ``allowed_origins`` list (``*`` = any). Programs that send no Origin are not browsers and are governed
    by the Host check and the API key alone.

    The request's own Host is used only when ``allowed_hosts`` is ``*``: the operator has then given up on
    naming the server, so the page's own origin (Origin equal to Host) is the only way to recognise it. A
    foreign page's origin still differs from Host, so cross-site pages stay refused."""
    if origin is None:
        return True
    if "*" in allowed_origins or origin in allowed_origins:
        return True
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc or "@" in parts.netloc:
        return False
    if hosts.any_host:
        own = split_host(host) if host else None
        return own is not None and split_host(parts.netloc) == own
    return hosts.allows(parts.netloc)


def bearer_matches(authorization: str | None, expected: str) -> bool:
    """True when ``authorization`` is ``Bearer <expected>`` (compared in constant time)."""
    header = authorization or ""
    token = header[7:].strip() if header.lower().startswith("bearer ") else ""
    return bool(token) and hmac.compare_digest(token.encode(), expected.encode())


class SecurityMiddleware:
    """Pure ASGI: refuses a request whose Host is not allowed (HTTP 400 with the JSON error body; a
    websocket handshake is closed before accept, which the server answers with 403), and adds the security
    headers to every HTTP answer: the UI's CSP, framing, sniffing and referrer rules everywhere, and
    ``Cache-Control: no-store`` under ``/admin``."""

    def __init__(self, app: ASGIApp, *, hosts: HostAllowList) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = _header(scope, b"host")
        if not self.hosts.allows(host):
            if scope["type"] == "websocket":
                await receive()  # websocket.connect: the handshake, answered by the close below
                await send({"type": "websocket.close", "code": 1008, "reason": ""})
                return
            response = JSONResponse(
                {"error": {"code": "bad_request", "message": "this server does not answer to that Host header"}},
                status_code=400)
            await response(scope, receive, self._stamping(scope, send, None))
            return
        if scope["type"] == "websocket":
            await self.app(scope, receive, send)
            return
        await self.app(scope, receive, self._stamping(scope, send, host))

    def _stamping(self, scope: Scope, send: Send, host: str | None) -> Send:
        path: str = scope.get("path", "")
        extra = list(_COMMON_HEADERS)
        if host is not None and path not in _NO_CSP_PATHS:
            # host passed the allow-list, which also checked its syntax: safe to put into a header.
            extra.append((b"content-security-policy", _CSP.format(host=host).encode("latin-1")))
        if path == "/admin" or path.startswith("/admin/"):
            extra.append((b"cache-control", b"no-store"))
        names = {name for name, _ in extra}

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                message = {**message, "headers": headers + extra}
            await send(message)

        return stamped


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None
