"""A peer that breaks the websocket protocol is closed with the code RFC 6455 gives and one warning line in the
log, never a traceback (a client must not be able to fill the log with stack traces), and the server goes on
serving. Raw frames over a plain socket against a real ``chatd serve``."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator

import pytest

from tests.support import RawWebSocket, ServerProcess, tiny_model_dir

WARNING = "closing a websocket connection that broke the protocol"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("edge"), tiny_model_dir()).start()
    yield proc
    proc.stop()


def _close_code(ws: RawWebSocket) -> tuple[int, bytes]:
    """Read up to the close frame; its code and reason."""
    while True:
        opcode, payload = ws.read()
        if opcode == 8:
            return struct.unpack(">H", payload[:2])[0], payload[2:]


def _still_serving(server: ServerProcess) -> None:
    ws = RawWebSocket(server.port)
    assert ws.read_json()["type"] == "hello"
    ws.send({"type": "ping", "id": "p"})
    assert ws.read_json() == {"type": "pong", "id": "p"}
    ws.sock.close()


@pytest.mark.parametrize(("name", "frame", "code"), [
    ("a text frame that is not UTF-8", dict(opcode=1, data=b'{"type": "ping", "id": "\xff\xfe"}'), 1007),
    ("a text frame cut in a multi-byte character", dict(opcode=1, data='{"type": "é'.encode()[:-1]), 1007),
    ("an unmasked client frame", dict(opcode=1, data=b'{"type": "ping"}', masked=False), 1002),
    ("a reserved opcode", dict(opcode=3, data=b"x"), 1002),
])
def test_a_protocol_error_closes_the_connection_with_one_warning_line(server: ServerProcess, name: str,
                                                                      frame: dict[str, object], code: int) -> None:
    before = server.log_text()
    ws = RawWebSocket(server.port)
    assert ws.read_json()["type"] == "hello"
    ws.send_frame(**frame)  # type: ignore[arg-type]
    assert _close_code(ws)[0] == code, name
    ws.sock.close()
    _still_serving(server)
    added = server.log_text()[len(before):]
    assert "Traceback" not in added and "UnicodeDecodeError" not in added
    warnings = [line for line in added.splitlines() if WARNING in line]
    assert len(warnings) == 1, added
    assert str(code) in warnings[0]


def test_a_fuzz_of_bad_utf8_frames_logs_one_line_each(server: ServerProcess) -> None:
    """What a fuzzer sending many such frames leaves in the log: one line per connection, nothing else."""
    before = server.log_text()
    for i in range(20):
        ws = RawWebSocket(server.port)
        assert ws.read_json()["type"] == "hello"
        ws.send_frame(1, json.dumps({"type": "ping", "id": str(i)}).encode() + b"\xc3")
        assert _close_code(ws)[0] == 1007
        ws.sock.close()
    _still_serving(server)
    added = server.log_text()[len(before):]
    assert "Traceback" not in added
    assert sum(WARNING in line for line in added.splitlines()) == 20


