"""Reliability suite: a bounded load and soak test against a real ``chatd serve`` (tiny model).

Many websocket connect / disconnect cycles (every fifth one creates a session and runs a short turn, every
seventh one drops the connection in the middle of a reply), with several clients at once, plus admin and
health requests. The server's resident memory, file descriptors and threads are read from /proc before and
after. File descriptors and threads must come back to where they were; memory may grow only a little
(allocator caches, the KV of the sessions created). CI runs 300 cycles, ``--long`` 2,000.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from websockets.asyncio.client import connect

from tests.support import ServerProcess, proc_resources, tiny_model_dir

CLIENTS = 4


@pytest.fixture
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("soak"), tiny_model_dir(), cache={"restore_min_tokens": 0})
    proc.start()
    yield proc
    proc.stop()


async def _cycle(server: ServerProcess, num: int) -> str:
    async with connect(server.ws_url) as ws:
        assert json.loads(await ws.recv())["type"] == "hello"
        if num % 5 == 0:
            await ws.send(json.dumps({"type": "session.create", "id": "c"}))
            sid = json.loads(await ws.recv())["session"]["session_id"]
            await ws.send(json.dumps({"type": "message.send", "id": "s", "session_id": sid, "content": f"hi {num}",
                                      "params": {"max_tokens": 60 if num % 7 == 0 else 6}}))
            while True:
                frame = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if num % 7 == 0 and frame["type"] == "token":
                    return "dropped mid-reply"  # leaving the block closes the connection mid-reply
                if frame["type"] in ("message.done", "error"):
                    assert frame["type"] == "message.done", frame
                    return "turn"
        await ws.send(json.dumps({"type": "ping", "id": "p"}))
        assert json.loads(await ws.recv())["type"] == "pong"
        return "ping"


async def _settle(server: ServerProcess) -> None:
    """Wait until the server holds no connection and runs no generation."""
    async with httpx.AsyncClient(base_url=server.http_url, timeout=10) as http:
        deadline = time.monotonic() + 60
        while True:
            metrics = (await http.get("/metrics")).text
            if "chatd_websocket_connections 0.0" in metrics and "chatd_active_generations 0.0" in metrics:
                return
            assert time.monotonic() < deadline, "connections or generations never ended"
            await asyncio.sleep(0.2)


async def test_load_and_soak_leave_fds_and_threads_flat(server: ServerProcess, long_mode: bool,
                                                        figures: Callable[..., None]) -> None:
    cycles = 2000 if long_mode else 300
    assert server.process is not None
    pid = server.process.pid
    for num in range(CLIENTS * 2):  # warm-up: imports, thread pools, allocator
        await _cycle(server, num * 5)
    await _settle(server)
    before = proc_resources(pid)
    kinds: dict[str, int] = {}
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=server.http_url, headers=server.admin_headers, timeout=30) as http:
        for base in range(0, cycles, CLIENTS):
            done = await asyncio.gather(*(_cycle(server, num) for num in range(base, min(base + CLIENTS, cycles))))
            for kind in done:
                kinds[kind] = kinds.get(kind, 0) + 1
            if base % 40 == 0:
                assert (await http.get("/admin/stats")).status_code == 200
                assert (await http.get("/healthz")).status_code == 200
    seconds = time.monotonic() - started
    await _settle(server)
    after = proc_resources(pid)
    assert "Traceback" not in server.log_text()
    assert sum(kinds.values()) == cycles
    assert after["fds"] <= before["fds"] + 2, (before, after)
    assert after["threads"] <= before["threads"] + 2, (before, after)
    assert after["rss_kib"] - before["rss_kib"] < 96 * 1024, (before, after)
    figures("soak", cycles=cycles, clients=CLIENTS, kinds=kinds, seconds=round(seconds, 1), before=before,
            after=after)
