"""``chatd chat``: an interactive terminal chat built on ChatClient.

Commands: ``/edit N text`` (replace message N and regenerate), ``/usage`` (last turn's usage),
``/history``, ``/session`` (print the session id, to resume later with --session), ``/quit``.
"""

from __future__ import annotations

import asyncio
import sys

from chatd.client.client import ChatClient, ChatError, ConnectionLost, Reply
from chatd.protocol import Message, Usage

HELP = "commands: /edit N text, /usage, /history, /session, /help, /quit"


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


async def _stream(reply: Reply) -> Usage | None:
    try:
        async for text in reply:
            sys.stdout.write(text)
            sys.stdout.flush()
    except ConnectionLost:
        print("\n(connection lost; the partial reply was saved — it reconnects on the next message)")
        return None
    print()
    if reply.done is not None:
        if reply.done.finish_reason != "stop":
            print(f"({reply.done.finish_reason})")
        return reply.done.usage
    if reply.edited is not None:
        print(f"(message {reply.edited.message.index} edited)")
    return None


async def run_terminal_chat(url: str, *, api_key: str | None = None, session_id: str | None = None,
                            system: str | None = None) -> int:
    try:
        client = await ChatClient.connect(url, api_key)
    except ChatError as exc:
        print(f"cannot connect: {exc.message}", file=sys.stderr)
        return 1
    loop = asyncio.get_running_loop()
    last_usage: Usage | None = None
    async with client:
        assert client.hello is not None
        if session_id:
            info, messages = await client.resume(session_id)
            print(f"resumed session {info.session_id} ({info.message_count} messages, cache: {info.tier})")
            _print_history(messages)
        else:
            info = await client.create_session(system=system)
            print(f"new session {info.session_id} with {client.hello.model}")
        print(HELP)
        while True:
            try:
                line = await loop.run_in_executor(None, input, "> ")
            except (EOFError, KeyboardInterrupt):
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
                    last_usage = await _stream(await client.edit(info.session_id, int(index), text)) or last_usage
                elif line.startswith("/"):
                    print(HELP)
                else:
                    last_usage = await _stream(await client.send(info.session_id, line)) or last_usage
            except ChatError as exc:
                print(f"error: {exc.code}: {exc.message}")
