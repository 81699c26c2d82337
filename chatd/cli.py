"""Command line: ``chatd serve | chat | models | db upgrade|downgrade|current``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from chatd import __version__, config, logs, preflight
from chatd.errors import ChatdError, ConfigError


def _settings(args: argparse.Namespace) -> config.Settings:
    overrides: dict[str, Any] = {}
    server: dict[str, Any] = {}
    if getattr(args, "host", None):
        server["host"] = args.host
    if getattr(args, "port", None) is not None:
        server["port"] = args.port
    if server:
        overrides["server"] = server
    if getattr(args, "model", None):
        overrides["model"] = {"source": args.model}
    return config.load(args.config, overrides=overrides)


def cmd_serve(args: argparse.Namespace) -> int:
    """Validate everything cheap first (config, store URL, model path, data folder, the port), then serve: the
    port answers at once (/livez, /readyz), the model loads behind it (chatd.server.gate)."""
    settings = _settings(args)
    logs.setup(settings.log_level, settings.server.log_format)
    preflight.check(settings)
    sock = preflight.listen(settings.server.host, settings.server.port)

    # Imported after the checks: a bad configuration is reported before any heavy import.
    import uvicorn

    from chatd.server.gate import Gate, Readiness
    from chatd.server.security import HostAllowList, SecurityMiddleware
    from chatd.server.transport import WebSocketProtocol

    readiness = Readiness()
    app = SecurityMiddleware(Gate(settings, readiness), hosts=HostAllowList.from_settings(settings.server))
    server = uvicorn.Server(uvicorn.Config(
        app, ws=WebSocketProtocol, log_config=None, lifespan="on",
        # The transport limit sits above the protocol's own frame limit, so an oversized frame gets a
        # "too_large" error and the connection stays usable; only absurd frames close it (1009).
        ws_max_size=settings.server.max_frame_bytes * 4, ws_ping_interval=20.0, ws_ping_timeout=20.0,
        log_level=settings.log_level, timeout_graceful_shutdown=30,
    ))

    def stop() -> None:
        server.should_exit = True

    readiness.on_failure = stop
    bound = sock.getsockname()
    logging.getLogger("chatd").info("listening on http://%s:%d (the model loads in the background; GET /readyz)",
                                    settings.server.host, bound[1])
    server.run(sockets=[sock])
    if readiness.failure is not None:
        raise readiness.failure
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    """What the configured model source holds and how chatd would run it (nothing is loaded)."""
    import json

    from chatd.engine.model.catalog import describe_source

    settings = _settings(args)
    try:
        facts = describe_source(settings.model.source)
    except ValueError as exc:
        raise ConfigError(f"model.source: {exc}") from exc
    print(json.dumps(facts.to_json(), indent=2) if args.json else facts.describe())
    return 0


def cmd_db(args: argparse.Namespace) -> int:
    from chatd.store import db

    settings = _settings(args)
    logs.setup(settings.log_level, settings.server.log_format)
    if args.action == "upgrade":
        db.upgrade(settings.store_url, args.revision or "head")
    elif args.action == "downgrade":
        db.downgrade(settings.store_url, args.revision or "base")
    print(db.current_revision(settings.store_url) or "empty")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from chatd.client.terminal import ReplyOptions, run_terminal_chat

    url = args.url
    if url is None:
        settings = _settings(args)
        host = settings.server.host
        if host in ("0.0.0.0", "::", "[::]", ""):
            host = "127.0.0.1"
        url = f"ws://{host}:{settings.server.port}/ws"
    options = ReplyOptions(max_tokens=args.max_tokens, temperature=args.temperature)
    return asyncio.run(run_terminal_chat(url, api_key=args.api_key, session_id=args.session, system=args.system,
                                         options=options))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _temperature(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 5.0:
        raise argparse.ArgumentTypeError("must be between 0 and 5")
    return value


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    parser = argparse.ArgumentParser(prog="chatd", description="Session-aware chat backend.", parents=[common])
    parser.add_argument("--version", action="version", version=f"chatd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", parents=[common],
                           help="run the server (websocket /ws, OpenAI API /v1, admin API, UI at /)")
    serve.add_argument("--config", help="config file (default: $CHATD_CONFIG or ./config.toml)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--model", help="model source: packaged, a .gguf file, a transformers folder or a hub id")
    serve.set_defaults(func=cmd_serve)

    models = sub.add_parser("models", parents=[common],
                            help="what the model source holds (architecture, parameters, quantisation per tensor "
                                 "kind, KV bytes per token) and whether the compact forward runs it")
    models.add_argument("--config")
    models.add_argument("--model", help="a model source other than the config's")
    models.add_argument("--json", action="store_true", help="one JSON object")
    models.set_defaults(func=cmd_models)

    chat = sub.add_parser("chat", parents=[common], help="interactive terminal chat against a running server")
    chat.add_argument("--url", help="websocket URL, ws://HOST:PORT/ws (default: from the config's [server] host/port)")
    chat.add_argument("--config")
    chat.add_argument("--api-key")
    chat.add_argument("--session", help="resume this session id instead of starting a new one")
    chat.add_argument("--system", help="system prompt for a new session")
    chat.add_argument("--max-tokens", type=_positive_int, help="longest reply, in tokens (default: the server's)")
    chat.add_argument("--temperature", type=_temperature, help="0 = greedy, up to 5 (default: the server's)")
    chat.set_defaults(func=cmd_chat)

    dbp = sub.add_parser("db", parents=[common], help="database migrations")
    dbp.add_argument("action", choices=["upgrade", "downgrade", "current"])
    dbp.add_argument("revision", nargs="?")
    dbp.add_argument("--config")
    dbp.set_defaults(func=cmd_db)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0, 2 for a configuration error, 1 for a failure at run time (start-up included), 130 for
    Ctrl+C. Errors are one line on stderr; ``--debug`` adds the traceback."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ChatdError as exc:
        if args.debug:
            traceback.print_exception(exc)
        print(f"chatd: {exc.message}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug:
            raise
        print(f"chatd: unexpected error: {type(exc).__name__}: {exc} (--debug shows the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
