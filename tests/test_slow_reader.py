"""A client that stops reading is closed with 4408 and its generations are cancelled (reliability issue, bug 9).

Before, the kernel grew the server's socket send buffer to megabytes, the connection's frame queue never
filled, and a reader that stopped reading had its generations run on to ``length``. The test talks to a
real ``chatd serve`` over a plain TCP socket that it simply stops reading from.
"""

from __future__ import annotations

import json
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
from tests.support import RawWebSocket, ServerProcess, tiny_model_dir

MAX_TOKENS = 3000  # each generation's limit: within the tiny model's 4,096 positions
SEND_QUEUE_FRAMES = 64


# The client's receive buffer, fixed before connecting: Linux would otherwise grow it on its own (``tcp_rmem``, up
# to megabytes), and how far depends on the machine, which let generations finish before anything backed up.
RECEIVE_BUFFER_BYTES = 4096


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    # Every text piece in a frame of its own (stream_interval_ms 0): the frames are what fills the buffers.
    proc = ServerProcess(tmp_path, tiny_model_dir(),
                         server={"send_queue_frames": SEND_QUEUE_FRAMES, "stream_interval_ms": 0}).start()
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
    ws = RawWebSocket(server.port, receive_buffer=RECEIVE_BUFFER_BYTES)
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
