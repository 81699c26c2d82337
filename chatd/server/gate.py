"""The readiness split of ``chatd serve``: the port answers at once, the model loads behind it.

:class:`Gate` is the ASGI application uvicorn runs. Its lifespan returns at once and starts the real
application in a background task: import it (torch, transformers: seconds), build it with
:func:`chatd.server.app.create_app`, and run that application's own lifespan (store, model, engine). Until
that is done:

* ``GET /livez`` is 200 (the process is alive);
* ``GET /readyz`` and ``GET /healthz`` are 503 with the current phase ("converting model 40 %", "loading
  model", "warming up"); once ready, ``/readyz`` is 200 and ``/healthz`` is the application's own;
* ``/ws`` accepts, sends one ``error`` frame with code ``unavailable`` and closes with 1013 (try again
  later); ``/admin``, ``/metrics`` and ``/v1`` answer 503 ``unavailable`` (OpenAI's error shape under /v1);
* anything else (the UI, /docs) is served by the application once it is built, 503 before.

When start-up fails, :attr:`Readiness.failure` holds one-line error (``ConfigError`` or ``StartupError``,
the original exception as its ``__cause__``) and ``on_failure`` is called, which stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from chatd.config import Settings
from chatd.domain import CLOSE_TRY_AGAIN_LATER, SUBPROTOCOL
from chatd.errors import ChatdError, ConfigError, StartupError, Unavailable
from chatd.preflight import redact_url
from chatd.protocol import ErrorFrame
from chatd.server.openai_wire import error_body

log = logging.getLogger("chatd.startup")

GATED_PREFIXES = ("/ws", "/admin", "/metrics", "/v1", "/healthz")
"""Paths that need the running core: refused with ``unavailable`` until ready."""
CONVERSION_LOG_STEP = 10
"""The first start logs the GGUF conversion's progress every this many percent."""


class Readiness:
    """Where start-up is. Written by the start-up task (and the conversion thread), read by requests."""

    def __init__(self) -> None:
        self.phase = "starting"
        self.ready = False
        self.failure: ChatdError | None = None
        self.started = time.monotonic()
        self.on_failure: Callable[[], None] = lambda: None

    def set_phase(self, phase: str, *, quiet: bool = False) -> None:
        if phase == self.phase:
            return
        self.phase = phase
        if not quiet:
            log.info("starting: %s (%.1f s)", phase, time.monotonic() - self.started)

    def fail(self, error: ChatdError) -> None:
        self.failure = error
        self.phase = "failed"
        self.on_failure()


def describe_failure(exc: BaseException, phase: str, settings: Settings) -> ChatdError:
    """The one-line error for an exception raised during ``phase`` of start-up."""
    if isinstance(exc, ChatdError) and isinstance(exc, ConfigError | StartupError):
        return exc
    root: BaseException = exc
    while root.__cause__ is not None or (root.__context__ is not None and not root.__suppress_context__):
        root = root.__cause__ or root.__context__  # type: ignore[assignment]
    detail = (str(root).strip().splitlines() or [""])[0][:300] or type(root).__name__
    if not isinstance(root, OSError) and type(root).__name__ not in detail:
        detail = f"{type(root).__name__}: {detail}"
    error: ChatdError
    if phase == "opening store":
        error = StartupError(f"cannot open the store {redact_url(settings.store_url)}: {detail}; "
                             "check [store] url and that the database is running and reachable")
    elif phase.startswith(("loading model", "converting model")):
        error = StartupError(f"cannot load the model {settings.model.source!r}: {detail}; check [model] source "
                             "(--debug shows the traceback)")
    else:
        error = StartupError(f"start-up failed while {phase}: {detail} (--debug shows the traceback)")
    error.__cause__ = exc
    return error


@contextlib.contextmanager
def conversion_progress(readiness: Readiness) -> Iterator[None]:
    """Report the first start's GGUF conversion: "converting model: reading the GGUF", then "converting model
    N %" (transformers walks the GGUF's tensors through its module-level ``tqdm``; this counts them, logging
    every CONVERSION_LOG_STEP %), "converting model: saving", and "loading model" again after it."""
    try:
        gguf_utils: Any = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    except ImportError:
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)

    def counting(iterable: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        items = list(iterable)
        total = max(1, len(items))
        logged = -CONVERSION_LOG_STEP
        for num, item in enumerate(items):
            percent = num * 100 // total
            readiness.set_phase(f"converting model {percent} %", quiet=percent - logged < CONVERSION_LOG_STEP)
            if percent - logged >= CONVERSION_LOG_STEP:
                logged = percent
            yield item
        readiness.set_phase("converting model: saving")

    class RunnerMessages(logging.Filter):
        """The runner's own log lines mark the conversion's start and end (reading the GGUF before the
        tensor walk takes most of the time; loading the converted folder follows it). Seen at log_level
        info or debug only; at warning the phase goes from "loading model" straight to the percentages."""

        def filter(self, record: logging.LogRecord) -> bool:
            message = str(record.msg)
            if message.startswith("converting "):
                readiness.set_phase("converting model: reading the GGUF")
            elif message.startswith("converted in"):
                readiness.set_phase("loading model")
            return True

    runner_log = logging.getLogger("chatd.engine.model.runner")
    marker = RunnerMessages()
    runner_log.addFilter(marker)
    gguf_utils.tqdm = counting
    try:
        yield
    finally:
        gguf_utils.tqdm = original
        runner_log.removeFilter(marker)


class Gate:
    """The ASGI application of ``chatd serve``; see the module docstring."""

    def __init__(self, settings: Settings, readiness: Readiness | None = None) -> None:
        self.settings = settings
        self.readiness = readiness or Readiness()
        self.app: ASGIApp | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        readiness = self.readiness
        try:
            readiness.set_phase("loading libraries")
            module = await asyncio.to_thread(importlib.import_module, "chatd.server.app")
            with conversion_progress(readiness):
                app = module.create_app(self.settings, on_phase=readiness.set_phase)
                self.app = app
                async with app.router.lifespan_context(app):
                    readiness.ready = True
                    readiness.set_phase("ready", quiet=True)
                    log.info("start-up took %.1f s", time.monotonic() - readiness.started)
                    await self._stop.wait()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            readiness.ready = False
            error = describe_failure(exc, readiness.phase, self.settings)
            log.debug("start-up failed", exc_info=exc)
            readiness.fail(error)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
            return
        path: str = scope.get("path", "")
        if path == "/livez":
            await _json(send, 200, {"status": "alive", "phase": self.readiness.phase})
            return
        if self.readiness.ready and self.app is not None:
            await self.app(scope, receive, send)
            return
        if path == "/readyz":
            await _json(send, 503, {"status": "starting", "phase": self.readiness.phase})
            return
        gated = any(path == p or path.startswith(p + "/") for p in GATED_PREFIXES)
        if not gated and self.app is not None and kind == "http":
            await self.app(scope, receive, send)  # the UI and /docs, while the model loads
            return
        error = Unavailable(f"chatd is starting ({self.readiness.phase}); try again when GET /readyz answers 200")
        if kind == "websocket":
            await _refuse_websocket(scope, receive, send, error)
        elif path == "/v1" or path.startswith("/v1/"):
            await _json(send, 503, error_body(error), retry_after=True)
        elif path == "/healthz":
            await _json(send, 503, {"status": "starting", "phase": self.readiness.phase}, retry_after=True)
        else:
            await _json(send, 503, {"error": {"code": error.code, "message": error.message}}, retry_after=True)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._task = asyncio.create_task(self._run(), name="chatd-startup")
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self._stop.set()
                if self._task is not None:
                    if not self.readiness.ready and self.readiness.failure is None:
                        self._task.cancel()  # stopped while loading: do not wait for the model
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._task
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _json(send: Send, status: int, body: Any, *, retry_after: bool = False) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               (b"cache-control", b"no-store")]
    if retry_after:
        headers.append((b"retry-after", b"2"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


async def _refuse_websocket(scope: Scope, receive: Receive, send: Send, error: ChatdError) -> None:
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    offered = scope.get("subprotocols", [])
    await send({"type": "websocket.accept", "subprotocol": SUBPROTOCOL if SUBPROTOCOL in offered else None})
    await send({"type": "websocket.send", "text": ErrorFrame.of(error).to_json()})
    await send({"type": "websocket.close", "code": CLOSE_TRY_AGAIN_LATER, "reason": "starting"})
