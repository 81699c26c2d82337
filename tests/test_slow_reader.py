"""A client that stops reading is closed with 4408 and its generations are cancelled (reliability issue, bug 9).

Before, the kernel grew the server's socket send buffer to megabytes, the connection's frame queue never
filled, and a reader that stopped reading had its generations run on to ``length``. The test talks to a
real ``chatd serve`` over a plain TCP socket that it simply stops reading from.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from chatd.domain import CLOSE_TOO_SLOW
from chatd.protocol import Token
from chatd.server.transport import SEND_BUFFER_BYTES, WRITE_BUFFER_BYTES
from tests.support import ServerProcess, tiny_model_dir

MAX_TOKENS = 3000  # each generation's limit: within the tiny model's 4,096 positions
SEND_QUEUE_FRAMES = 64


# The client's receive buffer, fixed before connecting: Linux would otherwise grow it on its own (``tcp_rmem``, up
# to megabytes), and how far depends on the machine, which let generations finish before anything backed up.
RECEIVE_BUFFER_BYTES = 4096


class RawWebSocket:
    """The client side of a websocket over a blocking socket, by hand: it reads only when told to."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
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
        data = json.dumps(frame).encode()
        mask = os.urandom(4)
        size = len(data)
        header = bytes([0x81]) + (bytes([0x80 | size]) if size < 126 else bytes([0x80 | 126]) + struct.pack(">H", size))
        self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

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


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path, tiny_model_dir(), server={"send_queue_frames": SEND_QUEUE_FRAMES}).start()
    yield proc
    proc.stop()


def frames_held(ws: RawWebSocket, session_id: str) -> int:
    """The most token frames one connection can hold before its send queue overflows: the queue, what the
    transport's write buffer and the server's socket take, and what this client's kernel buffer takes, all counted
    in the smallest token frame (empty text) this test's requests can get, plus the frame each side has in hand."""
    smallest = len(Token(session_id=session_id, text="", id="s0").to_json()) + 2  # a 2-byte websocket header
    # Linux doubles SO_SNDBUF's value for its bookkeeping and reports SO_RCVBUF doubled already.
    held_bytes = 2 * SEND_BUFFER_BYTES + WRITE_BUFFER_BYTES + ws.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    return SEND_QUEUE_FRAMES + 2 + held_bytes // smallest


def test_a_reader_that_stops_reading_is_closed_4408_and_its_generations_cancelled(server: ServerProcess) -> None:
    ws = RawWebSocket(server.port)
    assert ws.read_json()["type"] == "hello"
    session_ids: list[str] = []
    # Enough generations that together they make at least twice the frames the connection can hold, whatever
    # the machine's speed: the backlog happens by construction (a token need not make a frame of its own, hence
    # the margin).
    num_sessions = 1
    while len(session_ids) < num_sessions:
        ws.send({"type": "session.create", "id": f"c{len(session_ids)}"})
        session_ids.append(str(ws.read_json()["session"]["session_id"]))  # type: ignore[index]
        num_sessions = max(2, -(-2 * frames_held(ws, session_ids[0]) // MAX_TOKENS))
    for num, sid in enumerate(session_ids):
        ws.send({"type": "message.send", "id": f"s{num}", "session_id": sid, "content": "go",
                 "params": {"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": num}})
    # From here on the client reads nothing until every generation ended.
    with httpx.Client(base_url=server.http_url, headers=server.admin_headers, timeout=10) as http:
        deadline = time.monotonic() + 300
        while any(s["generating"] for s in http.get("/admin/sessions").json()["sessions"]):
            assert time.monotonic() < deadline, "the generations never ended"
            time.sleep(0.5)
        replies = [http.get(f"/admin/sessions/{sid}").json()["messages"][-1] for sid in session_ids]
    assert [r["role"] for r in replies] == ["assistant"] * num_sessions
    assert [r["finish_reason"] for r in replies] == ["cancelled"] * num_sessions
    assert all(r["num_tokens"] < MAX_TOKENS for r in replies)
    assert "closing a connection whose reader is too slow" in server.log_text()

    # Reading again: the frames that were sent, then the close frame with 4408.
    tokens = 0
    while True:
        opcode, payload = ws.read()
        if opcode == 8:
            break
        tokens += json.loads(payload)["type"] == "token"
    assert struct.unpack(">H", payload[:2])[0] == CLOSE_TOO_SLOW and payload[2:] == b"reader too slow"
    assert 0 < tokens < num_sessions * MAX_TOKENS
    ws.sock.close()
    # The server lets the connection go.
    with httpx.Client(base_url=server.http_url, timeout=10) as http:
        deadline = time.monotonic() + 60
        while "chatd_websocket_connections 0.0" not in http.get("/metrics").text:
            assert time.monotonic() < deadline, "the connection was never released"
            time.sleep(0.5)
