"""What tests share: model folders and the server process (from devtools) and a from-scratch reference
decoder (devtools.reference), the same ones the benchmarks use; an in-process server for fault
injection; a reader of a process's resources."""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import threading
from pathlib import Path

import uvicorn

from chatd.config import Settings
from chatd.engine.model.runner import ModelRunner
from chatd.server.app import create_app
from chatd.server.transport import WebSocketProtocol
from chatd.service.core import Chatd
from chatd.service.types import GenerationOptions, TurnResult
from devtools.models import CACHE_DIR, ROOT, packaged_model_dir, tiny_model_dir
from devtools.reference import reference_greedy
from devtools.servers import LoopbackServer, ServerProcess, free_port

__all__ = [
    "CACHE_DIR",
    "ROOT",
    "InProcessServer",
    "RawWebSocket",
    "ServerProcess",
    "free_port",
    "packaged_model_dir",
    "proc_resources",
    "reference_greedy",
    "tiny_model_dir",
]


class RawWebSocket:
    """The client side of a websocket over a blocking socket, by hand: it reads only when told to."""

    def __init__(self, port: int, *, receive_buffer: int | None = None) -> None:
        """Connect and upgrade; ``receive_buffer`` fixes the socket's receive buffer (no autotuning)."""
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.sock.settimeout(60)
        self.sock.connect(("127.0.0.1", port))
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                           ).encode())
        self.buffer = b""
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += self._recv()
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 101"), head

    def _recv(self) -> bytes:
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("closed")
        return data

    def _exactly(self, n: int) -> bytes:
        while len(self.buffer) < n:
            self.buffer += self._recv()
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    def send(self, frame: dict[str, object]) -> None:
        self.send_frame(1, json.dumps(frame).encode())

    def send_frame(self, opcode: int, data: bytes, *, masked: bool = True) -> None:
        """One final frame of ``opcode`` carrying ``data`` as is (a text frame need not be UTF-8 here)."""
        size = len(data)
        mask = os.urandom(4) if masked else b""
        flag = 0x80 if masked else 0
        length = bytes([flag | size]) if size < 126 else bytes([flag | 126]) + struct.pack(">H", size)
        body = bytes(b ^ mask[i % 4] for i, b in enumerate(data)) if masked else data
        self.sock.sendall(bytes([0x80 | opcode]) + length + mask + body)

    def read(self) -> tuple[int, bytes]:
        """The next frame: (opcode, payload)."""
        first, second = self._exactly(2)
        size = second & 0x7F
        if size == 126:
            size = struct.unpack(">H", self._exactly(2))[0]
        elif size == 127:
            size = struct.unpack(">Q", self._exactly(8))[0]
        return first & 0x0F, self._exactly(size)

    def read_json(self) -> dict[str, object]:
        opcode, payload = self.read()
        assert opcode == 1, (opcode, payload[:80])
        return dict(json.loads(payload))


class InProcessServer(LoopbackServer):
    """uvicorn serving ``create_app`` on a loopback port, in a thread of this process, so a test can inject
    faults into the running core while real websocket clients talk to it."""

    def __init__(self, settings: Settings, runner: ModelRunner) -> None:
        self.port = free_port()
        self.admin_token = "test-admin-token"
        # The Host allow-list names the configured port.
        server = settings.server.model_copy(update={"port": self.port, "admin_token": self.admin_token})
        settings = settings.model_copy(update={"server": server})
        self.app = create_app(settings, runner=runner)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, ws=WebSocketProtocol, log_level="warning",
                                lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)

    @property
    def core(self) -> Chatd:
        return self.app.state.core  # type: ignore[no-any-return]

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        for _ in range(600):
            if self.server.started:
                return self
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn exited")
            threading.Event().wait(0.05)
        raise RuntimeError("uvicorn did not start")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def proc_resources(pid: int) -> dict[str, int]:
    """Resident memory (KiB), open file descriptors and threads of process ``pid``, from /proc."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss_kib": int(status["VmRSS"].split()[0]), "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(status["Threads"])}


async def assert_cache_paths_exact(runner: ModelRunner, settings: Settings) -> None:
    """Through the service on ``runner``: a turn after an eviction to disk (restored from the snapshot), a session
    started from another's resident prefix, and a turn after an edit each reply as a session that computed the
    same history straight through (greedy), so the cache's K/V are the bits a recompute gives."""
    def greedy(n: int) -> GenerationOptions:
        return GenerationOptions(max_tokens=n, temperature=0.0)

    system = "You answer in one careful sentence. " * 6
    async with Chatd.open(settings, runner=runner, background=False) as core:
        svc = core.sessions
        straight = (await svc.create(system=system)).session_id
        first = await svc.send(straight, "Question?", greedy(6)).wait()
        second = await svc.send(straight, "And then?", greedy(8)).wait()
        assert isinstance(first, TurnResult) and isinstance(second, TurnResult)

        evicted = (await svc.create(system=system)).session_id
        shared = await svc.send(evicted, "Question?", greedy(6)).wait()
        assert isinstance(shared, TurnResult) and shared.usage.cached_tokens > 0  # the other session's prefix
        assert await svc.evict(evicted)
        back = await svc.send(evicted, "And then?", greedy(8)).wait()
        assert isinstance(back, TurnResult) and back.usage.cache_tier == "disk"
        assert back.assistant_message.content == second.assistant_message.content

        edited = (await svc.create(system=system)).session_id
        await svc.send(edited, "Something else entirely?", greedy(6)).wait()
        assert isinstance(await svc.edit(edited, 1, "Question?", greedy(6)).wait(), TurnResult)
        after_edit = await svc.send(edited, "And then?", greedy(8)).wait()
        assert isinstance(after_edit, TurnResult)
        assert after_edit.assistant_message.content == second.assistant_message.content
