"""Command line: ``chatd serve | chat | db upgrade|downgrade|current``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from typing import Any

from chatd import __version__, config
from chatd.errors import ConfigError


def _settings(args: argparse.Namespace) -> config.Settings:
    overrides: dict[str, Any] = {}
    server: dict[str, Any] = {}
    if getattr(args, "host", None):
        server["host"] = args.host
    if getattr(args, "port", None) is not None:
        server["port"] = args.port
    if server:
        overrides["server"] = server
    return config.load(args.config, overrides=overrides)


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # transformers and alembic are chatty at INFO.
    for name in ("alembic", "httpx", "transformers"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from chatd.server.app import create_app
    from chatd.server.transport import WebSocketProtocol

    settings = _settings(args)
    _logging(settings.log_level)
    app = create_app(settings)
    uvicorn.run(
        app, host=settings.server.host, port=settings.server.port, ws=WebSocketProtocol,
        # The transport limit sits above the protocol's own frame limit, so an oversized frame gets a
        # "too_large" error and the connection stays usable; only absurd frames close it (1009).
        ws_max_size=settings.server.max_frame_bytes * 4, ws_ping_interval=20.0, ws_ping_timeout=20.0,
        log_level=settings.log_level, timeout_graceful_shutdown=30,
    )
    return 0


def cmd_db(args: argparse.Namespace) -> int:
    from chatd.store import db

    settings = _settings(args)
    _logging(settings.log_level)
    if args.action == "upgrade":
        db.upgrade(settings.store_url, args.revision or "head")
    elif args.action == "downgrade":
        db.downgrade(settings.store_url, args.revision or "base")
    print(db.current_revision(settings.store_url) or "empty")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from chatd.client.terminal import run_terminal_chat

    url = args.url
    if url is None:
        settings = _settings(args)
        url = f"ws://{settings.server.host}:{settings.server.port}/ws"
    return asyncio.run(run_terminal_chat(url, api_key=args.api_key, session_id=args.session, system=args.system))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chatd", description="Session-aware chat backend.")
    parser.add_argument("--version", action="version", version=f"chatd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the server (websocket /ws, admin API, UI at /)")
    serve.add_argument("--config", help="config file (default: $CHATD_CONFIG or ./config.toml)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.set_defaults(func=cmd_serve)

    chat = sub.add_parser("chat", help="interactive terminal chat against a running server")
    chat.add_argument("--url", help="websocket URL (default: from the config's [server] host/port)")
    chat.add_argument("--config")
    chat.add_argument("--api-key")
    chat.add_argument("--session", help="resume this session id instead of starting a new one")
    chat.add_argument("--system", help="system prompt for a new session")
    chat.set_defaults(func=cmd_chat)

    dbp = sub.add_parser("db", help="database migrations")
    dbp.add_argument("action", choices=["upgrade", "downgrade", "current"])
    dbp.add_argument("revision", nargs="?")
    dbp.add_argument("--config")
    dbp.set_defaults(func=cmd_db)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"chatd: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
