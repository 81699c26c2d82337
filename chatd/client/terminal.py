"""``chatd chat``: an interactive terminal chat built on ChatClient.

Commands: ``/edit N text`` (replace message N and regenerate), ``/usage`` (last turn's usage),
``/history``, ``/session`` (print the session id, to resume later with --session), ``/quit``.

Every error is one line (never a traceback). Ctrl+C during a reply stops the reply (the partial reply is
kept, as with ``generation.cancel``); a second Ctrl+C, or one at the prompt, quits.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from chatd.client.client import ChatClient, ChatError, ConnectionLost, Reply
from chatd.protocol import Message, Usage

HELP = "commands: /edit N text, /usage, /history, /session, /help, /quit"
WS_PATH = "/ws"
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class ReplyOptions:
    max_tokens: int | None = None
    temperature: float | None = None


def websocket_url(url: str) -> tuple[str, str | None]:
    """``url`` as chatd's websocket URL, and a note saying what was changed (None when nothing was).

    ``http(s)://`` becomes ``ws(s)://``, a URL without a scheme gets ``ws://``, and a URL without a path gets
    ``/ws``. Raises ValueError (one line) for what cannot be a chatd URL."""
    original = url.strip()
    changes = []
    if "://" not in original:
        original, url = f"ws://{original}", f"ws://{original}"
        changes.append("added ws://")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ValueError(f"{url!r} is not a URL ({exc})") from None
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss"):
        raise ValueError(f"{url!r}: the scheme must be ws:// or wss:// (chatd's websocket is at ws://HOST:PORT/ws)")
    if scheme != parts.scheme:
        changes.append(f"{parts.scheme}:// is the HTTP address; using {scheme}://")
    if not parts.hostname:
        raise ValueError(f"{url!r} has no host name (expected ws://HOST:PORT/ws)")
    path = parts.path
    if path in ("", "/"):
        path = WS_PATH
        changes.append("chatd's websocket is at /ws")
    fixed = urlunsplit((scheme, parts.netloc, path, parts.query, ""))
    return fixed, (f"note: connecting to {fixed} ({'; '.join(changes)})" if changes and fixed != original else None)


def _format_usage(usage: Usage) -> str:
    parts = [f"cached {usage.cached_tokens}/{usage.input_tokens} ({usage.cache_tier})",
             f"prefilled {usage.prefill_tokens}", f"out {usage.output_tokens}",
             f"ttft {usage.ttft_ms:.0f} ms", f"{usage.decode_tokens_per_s:.1f} tok/s"]
    if usage.restore_ms is not None:
        parts.append(f"restore {usage.restore_ms:.0f} ms")
    if usage.invalidated_from is not None:
        parts.append(f"invalidated from token {usage.invalidated_from}")
    return " · ".join(parts)


def _print_history(messages: list[Message]) -> None:
    for m in messages:
        print(f"[{m.index}] {m.role}: {m.content}")


def _connect_error(url: str, exc: ChatError) -> str:
    """One line for a failed connection, with what to do."""
    if exc.code == "refused" and "HTTP 403" in exc.message and urlsplit(url).path != WS_PATH:
        return f"cannot connect to {url}: the server refused it (HTTP 403); chatd's websocket path is /ws"
    if exc.code == "refused" and "HTTP 403" in exc.message:
        return (f"cannot connect to {url}: the server refused it (HTTP 403): its [server] allowed_hosts does not "
                "list this host name, or this is not chatd")
    if exc.code == "unauthorized":
        return f"cannot connect to {url}: {exc.message} (pass --api-key)"
    if exc.code == "unavailable":
        return f"cannot connect to {url}: {exc.message}"
    if isinstance(exc, ConnectionLost):
        return f"cannot connect to {url}: no answer ({exc.message.rsplit(': ', 1)[-1]}); is chatd serve running?"
    return f"cannot connect to {url}: {exc.message}"


class LineReader:
    """``input()`` on a daemon thread, so the event loop keeps running (and exiting never waits for a line)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._prompts: list[str] = []
        self._wanted = threading.Event()
        self._lines: asyncio.Queue[str | None] = asyncio.Queue()
        threading.Thread(target=self._run, name="chatd-input", daemon=True).start()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            try:
                line: str | None = input(self._prompts.pop() if self._prompts else "")
            except (EOFError, OSError):
                line = None
            self._loop.call_soon_threadsafe(self._lines.put_nowait, line)
            if line is None:
                return

    async def read(self, prompt: str) -> str | None:
        """The next line; None at end of input."""
        self._prompts.append(prompt)
        self._wanted.set()
        return await self._lines.get()


class Interrupts:
    """Ctrl+C: stops the reply being streamed; with none (or a second time for the same reply), quits."""

    def __init__(self, loop: asyncio.AbstractEventLoop, main: asyncio.Task[int]) -> None:
        self.loop = loop
        self.main = main
        self.reply: Reply | None = None
        self.stopping = False
        self.quit = False
        self._tasks: set[asyncio.Task[object]] = set()

    def __enter__(self) -> Interrupts:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            self.loop.add_signal_handler(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            self.loop.remove_signal_handler(signal.SIGINT)

    def _on_sigint(self) -> None:
        if self.reply is not None and not self.stopping:
            self.stopping = True
            print("\n(stopping the reply; Ctrl+C again quits)", flush=True)
            task: asyncio.Task[object] = self.loop.create_task(self.reply.cancel())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        self.quit = True
        self.main.cancel()

    async def stream(self, reply: Reply) -> Usage | None:
        """Print the reply as it arrives; its usage (None for an edit that generated nothing)."""
        self.reply, self.stopping = reply, False
        try:
            async for text in reply:
                sys.stdout.write(text)
                sys.stdout.flush()
        except ConnectionLost:
            print("\n(connection lost; the partial reply was saved — it reconnects on the next message)")
            return None
        finally:
            self.reply = None
        print()
        if reply.done is not None:
            if reply.done.finish_reason != "stop":
                print(f"({reply.done.finish_reason})")
            return reply.done.usage
        if reply.edited is not None:
            print(f"(message {reply.edited.message.index} edited)")
        return None


async def run_terminal_chat(url: str, *, api_key: str | None = None, session_id: str | None = None,
                            system: str | None = None, options: ReplyOptions | None = None) -> int:
    """The interactive chat; returns the exit status (0, 1 for an error, 130 when quit with Ctrl+C)."""
    main = asyncio.current_task()
    assert main is not None
    with Interrupts(asyncio.get_running_loop(), main) as interrupts:
        try:
            return await _chat(url, api_key, session_id, system, options or ReplyOptions(), interrupts)
        except asyncio.CancelledError:
            if interrupts.quit:
                print()
                return EXIT_INTERRUPTED
            raise


async def _chat(url: str, api_key: str | None, session_id: str | None, system: str | None,
                options: ReplyOptions, interrupts: Interrupts) -> int:
    try:
        url, note = websocket_url(url)
    except ValueError as exc:
        print(f"chatd chat: {exc}", file=sys.stderr)
        return 2
    if note:
        print(note, file=sys.stderr)
    try:
        client = await ChatClient.connect(url, api_key)
    except ChatError as exc:
        print(f"chatd chat: {_connect_error(url, exc)}", file=sys.stderr)
        return 1
    except Exception as exc:  # an invalid URI, a TLS failure, ...: one line, never a traceback
        print(f"chatd chat: cannot connect to {url}: {exc}", file=sys.stderr)
        return 1
    reader = LineReader(asyncio.get_running_loop())
    last_usage: Usage | None = None
    async with client:
        assert client.hello is not None
        try:
            if session_id:
                info, messages = await client.resume(session_id)
                print(f"resumed session {info.session_id} ({info.message_count} messages, cache: {info.tier})")
                _print_history(messages)
            else:
                info = await client.create_session(system=system)
                print(f"new session {info.session_id} with {client.hello.model}")
        except ChatError as exc:
            if exc.code == "not_found":
                print(f"chatd chat: no session {session_id!r} on {url} (check the id: /session prints it)",
                      file=sys.stderr)
            elif exc.code == "bad_request" and session_id:
                print(f"chatd chat: {session_id!r} is not a session id ({exc.message})", file=sys.stderr)
            else:
                print(f"chatd chat: {exc.code}: {exc.message}", file=sys.stderr)
            return 1
        print(HELP)
        while True:
            line = await reader.read("> ")
            if line is None:
                print()
                return 0
            line = line.strip()
            if not line:
                continue
            try:
                if line in ("/quit", "/exit"):
                    return 0
                if line == "/help":
                    print(HELP)
                elif line == "/session":
                    print(info.session_id)
                elif line == "/usage":
                    print(_format_usage(last_usage) if last_usage else "no turn yet")
                elif line == "/history":
                    _print_history((await client.resume(info.session_id))[1])
                elif line.startswith("/edit "):
                    _, index, text = ([*line.split(" ", 2), "", ""])[:3]
                    if not index.isdigit() or not text:
                        print("usage: /edit N new text")
                        continue
                    reply = await client.edit(info.session_id, int(index), text, max_tokens=options.max_tokens,
                                              temperature=options.temperature)
                    last_usage = await interrupts.stream(reply) or last_usage
                elif line.startswith("/"):
                    print(HELP)
                else:
                    reply = await client.send(info.session_id, line, max_tokens=options.max_tokens,
                                              temperature=options.temperature)
                    last_usage = await interrupts.stream(reply) or last_usage
            except ChatError as exc:
                print(f"error: {exc.code}: {exc.message}")
