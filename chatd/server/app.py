"""create_app: the FastAPI application, its lifespan (the core lives in app.state) and error mapping."""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from chatd import __version__, logs
from chatd.config import Settings
from chatd.engine.model.runner import ModelRunner
from chatd.errors import ChatdError, Internal, Unauthorized, describe_validation_errors
from chatd.server import admin, docs, openai_api
from chatd.server.metrics import CONTENT_TYPE, Metrics
from chatd.server.security import WILDCARD_BIND, HostAllowList, SecurityMiddleware, bearer_matches
from chatd.server.ws import websocket_endpoint
from chatd.service.core import Chatd

log = logging.getLogger(__name__)

METRICS_BEARER = HTTPBearer(auto_error=False, scheme_name="metricsToken",
                            description="[server] metrics_token, when set")
STATIC_DIR = Path(__file__).resolve().parent.parent.parent / "static"
ADMIN_TOKEN_FILE = "admin_token"


def admin_token(settings: Settings) -> str:
    """The configured admin token, or one generated once into ``<data_dir>/admin_token`` (mode 0600)."""
    if settings.server.admin_token:
        return settings.server.admin_token
    path = settings.data_path / ADMIN_TOKEN_FILE
    if path.exists():
        token = path.read_text().strip()
        if token:
            return token
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    log.info("generated an admin token in %s", path)
    return token


def _error(code: str, message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def create_app(settings: Settings, *, runner: ModelRunner | None = None,
               on_phase: Callable[[str], None] | None = None) -> FastAPI:
    """The chatd application. ``runner`` lets tests share an already loaded model; ``on_phase`` hears the
    start-up phases (``chatd serve`` answers /readyz with them, see chatd.server.gate)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with Chatd.open(settings, runner=runner, on_phase=on_phase) as core:
            core.on_turn(logs.log_turn)
            app.state.core = core
            app.state.metrics = Metrics(core)
            app.state.admin_token = admin_token(settings)
            app.state.started_at = int(time.time())
            log.info("chatd ready: model %s on %s", core.runner.info.name, core.runner.info.device)
            yield

    app = FastAPI(title="chatd", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Session-aware chat backend: websocket chat at /ws, an OpenAI-compatible API under /v1, "
                              "session admin under /admin.")
    hosts = HostAllowList.from_settings(settings.server)
    app.state.allowed_hosts = hosts
    # Outermost, so that every answer (errors included) is stamped and no route runs for a foreign Host.
    app.add_middleware(SecurityMiddleware, hosts=hosts)
    if settings.server.host in WILDCARD_BIND and not settings.server.allowed_hosts:
        log.warning("listening on all interfaces, but only loopback Host names are accepted: "
                    "list the names clients use in [server] allowed_hosts")

    def require_metrics_token(request: Request) -> None:
        """/metrics is open unless ``metrics_token`` is set; the admin token never stands in for it."""
        token = settings.server.metrics_token
        if token and not bearer_matches(request.headers.get("authorization"), token):
            raise Unauthorized("metrics token required (Authorization: Bearer <token>)")

    # Errors under /v1 (the OpenAI API) come in OpenAI's shape, all others in chatd's.
    @app.exception_handler(ChatdError)
    async def chatd_error(request: Request, exc: ChatdError) -> JSONResponse:
        if openai_api.is_openai_path(request.url.path):
            return openai_api.error_response(exc)
        return _error(exc.code, exc.message, exc.http_status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = describe_validation_errors(exc.errors(), root="request")
        return _error("bad_request", problems or "invalid request", 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if openai_api.is_openai_path(request.url.path):
            return openai_api.http_error(exc.status_code, str(exc.detail))
        code = {404: "not_found", 401: "unauthorized", 405: "bad_request"}.get(exc.status_code, "bad_request")
        return _error(code, str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        if openai_api.is_openai_path(request.url.path):
            return openai_api.error_response(Internal())
        return _error("internal", "internal error", 500)

    @app.get("/healthz", tags=["ops"])
    async def healthz(request: Request) -> JSONResponse:
        """200 while the engine thread runs; 503 once it has died (no generation can succeed then)."""
        core: Chatd = request.app.state.core
        ok = core.worker.alive
        body = {"status": "ok" if ok else "engine_stopped", "model": core.runner.info.name, "version": __version__}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/livez", tags=["ops"])
    async def livez() -> dict[str, str]:
        """200 as soon as the port is open, also while the model loads: the process is alive."""
        return {"status": "alive"}

    @app.get("/readyz", tags=["ops"])
    async def readyz() -> dict[str, str]:
        """200 once chatd serves (503 with the start-up phase before, e.g. "loading model")."""
        return {"status": "ready"}

    @app.get("/metrics", tags=["ops"], dependencies=[Depends(require_metrics_token), Depends(METRICS_BEARER)])
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)

    app.add_api_websocket_route("/ws", websocket_endpoint)
    app.include_router(admin.router)
    app.include_router(openai_api.router)
    docs.install(app)
    if STATIC_DIR.is_dir():
        app.mount("/", StaticFiles(directory=STATIC_DIR, html=True), name="ui")
    return app
