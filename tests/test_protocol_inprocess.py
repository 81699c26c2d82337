"""Protocol v1 over the websocket, in process: the real app (create_app) behind Starlette's TestClient.

No subprocess and no socket: the same endpoint, connection, dispatcher and SessionService as in
production, with the tiny model. What only a real process shows (the transport's frame-size close,
signals, restarts, the real client over a real socket, HTTP 403 at handshake) stays in
test_server_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from starlette.testclient import WebSocketTestSession
from starlette.websockets import WebSocketDisconnect, WebSocketState

from chatd import config
from chatd.config import Settings
from chatd.domain import CLOSE_IDLE, CLOSE_TOO_SLOW, CLOSE_UNAUTHORIZED, KEY_SUBPROTOCOL_PREFIX, SUBPROTOCOL
from chatd.engine.model.runner import ModelRunner
from chatd.errors import ERROR_CODES
from chatd.protocol import MAX_NESTING_DEPTH, PROTOCOL_VERSION, Pong
from chatd.server.app import create_app
from chatd.server.connection import Connection
from chatd.service.core import MAX_PAGE_LIMIT, MAX_PAGE_OFFSET

MAX_CHARS = 2000
MAX_FRAME = 16_384
API_KEY = "k-123"
Frame = dict[str, Any]


def _settings(data_dir: Path, model_dir: Path, **server: Any) -> Settings:
    # TestClient sends ``Host: testserver``; the default allow-list (loopback names) rightly refuses it.
    server = {"max_message_chars": MAX_CHARS, "max_frame_bytes": MAX_FRAME, "max_generations_per_connection": 2,
              "allowed_hosts": ["testserver"], **server}
    return config.load(env={}, overrides={"data_dir": str(data_dir), "model": {"source": str(model_dir)},
                                          "cache": {"persist_idle_s": 0, "idle_evict_s": 0}, "server": server})


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path,
           tiny_runner: ModelRunner) -> Iterator[TestClient]:
    """One app for the module (starting one costs more than most of these tests); each test uses its own
    connection and sessions."""
    with TestClient(create_app(_settings(tmp_path_factory.mktemp("inprocess"), tiny_dir),
                               runner=tiny_runner)) as client:
        yield client


@pytest.fixture
def make_client(tmp_path: Path, tiny_dir: Path, tiny_runner: ModelRunner) -> Iterator[Callable[..., TestClient]]:
    """An app of its own with extra ``[server]`` settings; stopped at the end of the test."""
    clients: list[TestClient] = []

    def make(**server: Any) -> TestClient:
        client = TestClient(create_app(_settings(tmp_path / f"data{len(clients)}", tiny_dir, **server),
                                       runner=tiny_runner))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


def _open(ws: WebSocketTestSession) -> Frame:
    hello: Frame = ws.receive_json()
    assert hello["type"] == "hello" and hello["protocol_version"] == PROTOCOL_VERSION
    return hello


def _ask(ws: WebSocketTestSession, frame: Frame) -> Frame:
    ws.send_text(json.dumps(frame))
    answer: Frame = ws.receive_json()
    return answer


def _create(ws: WebSocketTestSession, **fields: Any) -> str:
    created = _ask(ws, {"type": "session.create", "id": "c", **fields})
    assert created["type"] == "session.created" and created["id"] == "c", created
    return str(created["session"]["session_id"])


def _until_done(ws: WebSocketTestSession, request_id: str) -> tuple[list[Frame], Frame]:
    """Frames answering ``request_id`` up to its message.done (other frames are returned too)."""
    seen: list[Frame] = []
    while True:
        frame: Frame = ws.receive_json()
        if frame.get("id") == request_id and frame["type"] in ("message.done", "error"):
            return seen, frame
        seen.append(frame)


def _expect_close(ws: WebSocketTestSession) -> int:
    with pytest.raises(WebSocketDisconnect) as closed:
        while True:
            ws.receive_json()
    return closed.value.code


# ----------------------------------------------------------------------------- bad input


BAD_FRAMES: list[tuple[str, str]] = [
    ("{not json", "bad_request"),
    ("[1, 2]", "bad_request"),
    ('"just a string"', "bad_request"),
    (json.dumps({"type": "no.such.type", "id": "u1"}), "unknown_type"),
    (json.dumps({"type": 7, "id": "u2"}), "bad_request"),
    (json.dumps({"id": "m1"}), "bad_request"),
    (json.dumps({"type": "ping", "id": "m0", "extra": 1}), "bad_request"),
    (json.dumps({"type": "message.send", "id": "m2", "content": "hi"}), "bad_request"),
    (json.dumps({"type": "message.send", "id": "m3", "session_id": 5, "content": "hi"}), "bad_request"),
    (json.dumps({"type": "message.send", "id": "m4", "session_id": "x" * 20, "content": "hi",
                 "params": {"temperature": "hot"}}), "bad_request"),
    (json.dumps({"type": "message.send", "id": "m4b", "session_id": "short", "content": "hi"}), "bad_request"),
    (json.dumps({"type": "message.edit", "id": "m4c", "session_id": "x" * 20, "index": -1, "content": "hi"}),
     "bad_request"),
    (json.dumps({"type": "message.send", "id": "m5", "session_id": "nope-nope-nope-nope", "content": "hi"}),
     "not_found"),
    (json.dumps({"type": "session.resume", "id": "m6", "session_id": "nope-nope-nope-nope"}), "not_found"),
    ("x" * (MAX_FRAME + 10), "too_large"),
]


@pytest.mark.parametrize(("text", "code"), BAD_FRAMES, ids=[f"{code}-{num}" for num, (_, code) in
                                                           enumerate(BAD_FRAMES)])
def test_bad_frame_gets_its_code_and_the_connection_stays_usable(client: TestClient, text: str, code: str) -> None:
    with client.websocket_connect("/ws") as ws:
        _open(ws)
        ws.send_text(text)
        frame: Frame = ws.receive_json()
        assert frame["type"] == "error" and frame["code"] == code, frame
        assert frame["message"]
        sent = json.loads(text) if text.startswith('{"') else {}
        assert frame.get("id") == sent.get("id")
        assert _ask(ws, {"type": "ping", "id": "p"}) == {"type": "pong", "id": "p"}


def test_every_bad_frame_in_a_row_on_one_connection(client: TestClient) -> None:
    with client.websocket_connect("/ws") as ws:
        _open(ws)
        for text, code in BAD_FRAMES:
            ws.send_text(text)
            assert ws.receive_json()["code"] == code
        ws.send_bytes(b"\xff\xfe not utf-8")
        assert ws.receive_json()["code"] == "bad_request"
        # A binary frame holding a valid frame is read like a text frame.
        ws.send_bytes(json.dumps({"type": "ping", "id": "b"}).encode())
        assert ws.receive_json() == {"type": "pong", "id": "b"}
        sid = _create(ws)
        too_long = _ask(ws, {"type": "message.send", "id": "long", "session_id": sid, "content": "x" * (MAX_CHARS + 1)})
        assert too_long["code"] == "too_large" and too_long["id"] == "long"
        out_of_range = _ask(ws, {"type": "message.edit", "id": "e", "session_id": sid, "index": 5, "content": "x"})
        assert out_of_range["code"] == "bad_request" and out_of_range["id"] == "e"
        assert _ask(ws, {"type": "ping"}) == {"type": "pong"}


def _assert_quiet(caplog: pytest.LogCaptureFixture) -> None:
    """A bad frame is the client's problem: at most one WARNING line, never an ERROR or a traceback."""
    loud = [r for r in caplog.records if r.levelno > logging.WARNING or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]
    assert sum(r.levelno == logging.WARNING for r in caplog.records) <= 1


SID = "x" * 20
# The JSON text holds the escape \ud800 (a lone surrogate): valid JSON, but not valid Unicode once decoded.
LONE_SURROGATE_FRAMES: list[tuple[str, str | None]] = [
    ('{"type": "ping", "id": "\\ud800"}', None),
    ('{"type": "ping", "id": "ok\\udfffok"}', None),
    ('{"type": "session.create", "id": "s1", "system": "be \\ud800 terse"}', "s1"),
    ('{"type": "session.create", "id": "s2", "title": "\\udc00"}', "s2"),
    ('{"type": "message.send", "id": "s3", "session_id": "' + SID + '", "content": "hi \\ud83d"}', "s3"),
    ('{"type": "message.edit", "id": "s4", "session_id": "' + SID + '", "index": 0, "content": "\\ud800"}', "s4"),
    ('{"type": "message.send", "id": "s5", "session_id": "' + SID + '", "content": "hi",'
     ' "params": {"stop": ["ok", "\\ude00"]}}', "s5"),
    ('{"type": "ping", "id": "s6", "\\ud800": 1}', "s6"),
    ('{"type": "\\ud800", "id": "s7"}', "s7"),
]


@pytest.mark.parametrize(("text", "echoed"), LONE_SURROGATE_FRAMES,
                         ids=["id", "id-inside", "system", "title", "content", "edit", "stop", "key", "type"])
def test_lone_surrogates_are_a_bad_request_and_the_connection_stays_open(
        client: TestClient, caplog: pytest.LogCaptureFixture, text: str, echoed: str | None) -> None:
    with client.websocket_connect("/ws") as ws:
        _open(ws)
        ws.send_text(text)
        frame: Frame = ws.receive_json()
        assert frame["type"] == "error" and frame["code"] == "bad_request", frame
        assert "Unicode" in frame["message"]
        # An id that cannot be encoded is not echoed; a good one is.
        assert frame.get("id") == echoed
        assert _ask(ws, {"type": "ping", "id": "p"}) == {"type": "pong", "id": "p"}
    _assert_quiet(caplog)


def test_a_valid_surrogate_pair_is_a_character_not_an_error(client: TestClient) -> None:
    with client.websocket_connect("/ws") as ws:
        _open(ws)
        ws.send_text('{"type": "ping", "id": "\\ud83d\\ude00"}')
        assert ws.receive_json() == {"type": "pong", "id": "\U0001F600"}


DEEP = 2000
DEEP_FRAMES = [
    "[" * DEEP + "]" * DEEP,
    '{"a":' * DEEP + "1" + "}" * DEEP,
    '{"type": "ping", "id": "d1", "x": ' + "[" * DEEP + "]" * DEEP + "}",
    '{"type": "ping", "id": "d2", "x": ' + "[" * (MAX_NESTING_DEPTH + 1) + "]" * (MAX_NESTING_DEPTH + 1) + "}",
]


@pytest.mark.parametrize("text", DEEP_FRAMES, ids=["array", "object", "in-frame", "just-over"])
def test_too_deep_nesting_is_a_bad_request_and_the_connection_stays_open(
        client: TestClient, caplog: pytest.LogCaptureFixture, text: str) -> None:
    with client.websocket_connect("/ws") as ws:
        _open(ws)
        ws.send_text(text)
        frame: Frame = ws.receive_json()
        assert frame["type"] == "error" and frame["code"] == "bad_request", frame
        assert f"nested deeper than {MAX_NESTING_DEPTH}" in frame["message"]
        assert _ask(ws, {"type": "ping", "id": "p"}) == {"type": "pong", "id": "p"}
    _assert_quiet(caplog)


def test_nesting_up_to_the_limit_is_parsed_and_brackets_in_strings_do_not_count(client: TestClient) -> None:
    inner = MAX_NESTING_DEPTH - 1  # the frame object itself is one level
    with client.websocket_connect("/ws") as ws:
        _open(ws)
        # Nested as deep as allowed: it parses, so the answer names the unknown field, not the depth.
        ws.send_text('{"type": "ping", "id": "n", "x": ' + "[" * inner + "]" * inner + "}")
        frame: Frame = ws.receive_json()
        assert frame["code"] == "bad_request" and "nested" not in frame["message"] and "x" in frame["message"]
        brackets = '[{\\"[' * DEEP
        assert _ask(ws, {"type": "ping", "id": brackets[:100]}) == {"type": "pong", "id": brackets[:100]}
        sid = _create(ws, title="[" * 150 + "{" * 50)
        assert len(sid) >= 16


def test_error_codes_sent_are_the_known_ones() -> None:
    assert {code for _, code in BAD_FRAMES} <= set(ERROR_CODES)


# ----------------------------------------------------------------------------- frames that work


def test_ping_pong_echoes_the_request_id(client: TestClient) -> None:
    with client.websocket_connect("/ws") as ws:
        hello = _open(ws)
        assert hello["model"].startswith("tiny-llama") and hello["max_context"] > 0
        assert _ask(ws, {"type": "ping", "id": "p1"}) == Pong(id="p1").model_dump(exclude_none=True)
        assert _ask(ws, {"type": "ping"}) == {"type": "pong"}


def test_create_send_done_with_usage_then_the_cache_is_reused(client: TestClient) -> None:
    with client.websocket_connect("/ws") as ws:
        _open(ws)
        sid = _create(ws, system="Be brief.", title="in process")
        ws.send_text(json.dumps({"type": "message.send", "id": "s1", "session_id": sid, "content": "Hello there",
                                 "params": {"max_tokens": 8, "temperature": 1.0, "seed": 1}}))
        tokens, done = _until_done(ws, "s1")
        assert done["type"] == "message.done" and done["session_id"] == sid
        assert all(t["type"] == "token" and t["id"] == "s1" and t["session_id"] == sid for t in tokens)
        assert "".join(t["text"] for t in tokens) == done["assistant_message"]["content"]
        assert done["finish_reason"] in ("stop", "length")
        assert done["user_message"] | {"created_at": None} == {"index": 1, "role": "user", "content": "Hello there",
                                                                "created_at": None}
        usage = done["usage"]
        assert usage["cached_tokens"] == 0 and usage["cache_tier"] == "none"
        assert usage["cached_tokens"] + usage["prefill_tokens"] == usage["input_tokens"]
        assert 0 < usage["output_tokens"] <= 8

        ws.send_text(json.dumps({"type": "message.send", "id": "s2", "session_id": sid, "content": "Again",
                                 "params": {"max_tokens": 4}}))
        _, second = _until_done(ws, "s2")
        assert second["usage"]["cache_tier"] == "device"
        assert second["usage"]["cached_tokens"] == usage["input_tokens"] + usage["output_tokens"] - 1

        resumed = _ask(ws, {"type": "session.resume", "id": "r", "session_id": sid})
        assert resumed["type"] == "session.resumed" and resumed["id"] == "r"
        assert [m["role"] for m in resumed["messages"]] == ["system", "user", "assistant", "user", "assistant"]
        assert resumed["messages"][2]["usage"] == usage


def test_edit_of_an_assistant_message_answers_message_edited(client: TestClient) -> None:
    with client.websocket_connect("/ws") as ws:
        _open(ws)
        sid = _create(ws)
        ws.send_text(json.dumps({"type": "message.send", "id": "s", "session_id": sid, "content": "Hi",
                                 "params": {"max_tokens": 4}}))
        _until_done(ws, "s")
        edited = _ask(ws, {"type": "message.edit", "id": "e", "session_id": sid, "index": 1, "content": "Hello."})
        assert edited["type"] == "message.edited" and edited["id"] == "e"
        assert edited["message"]["content"] == "Hello." and edited["invalidated_from"] > 0


def test_second_send_while_generating_is_busy_and_the_first_is_unaffected(client: TestClient) -> None:
    with client.websocket_connect("/ws") as ws:
        _open(ws)
        sid = _create(ws)
        ws.send_text(json.dumps({"type": "message.send", "id": "g1", "session_id": sid, "content": "go",
                                 "params": {"max_tokens": 3000, "temperature": 1.0, "seed": 1}}))
        ws.send_text(json.dumps({"type": "message.send", "id": "g2", "session_id": sid, "content": "again"}))
        frame = ws.receive_json()
        while frame.get("id") != "g2":
            assert frame["type"] == "token" and frame["id"] == "g1"
            frame = ws.receive_json()
        assert frame["type"] == "error" and frame["code"] == "busy"
        ws.send_text(json.dumps({"type": "generation.cancel", "session_id": sid}))
        frames, done = _until_done(ws, "g1")
        assert [f for f in frames if f.get("id") == "g2"] == []
        assert done["type"] == "message.done" and done["user_message"]["content"] == "go"
        assert done["user_message"]["index"] == 0 and done["assistant_message"]["index"] == 1


def test_generation_limit_per_connection_is_rate_limited(client: TestClient) -> None:
    with client.websocket_connect("/ws") as ws:
        _open(ws)
        sids = [_create(ws) for _ in range(3)]
        for num, sid in enumerate(sids):
            ws.send_text(json.dumps({"type": "message.send", "id": f"g{num}", "session_id": sid, "content": "long",
                                     "params": {"max_tokens": 3000, "temperature": 1.0, "seed": 1}}))
        frame = ws.receive_json()
        while frame["type"] == "token":
            frame = ws.receive_json()
        assert frame["type"] == "error" and frame["code"] == "rate_limited" and frame["id"] == "g2"
        for sid in sids[:2]:
            ws.send_text(json.dumps({"type": "generation.cancel", "session_id": sid}))
        endings: dict[str, str] = {}
        while len(endings) < 2:
            frame = ws.receive_json()
            if frame["type"] in ("message.done", "error"):
                endings[frame["id"]] = frame["type"]
        assert endings == {"g0": "message.done", "g1": "message.done"}


def test_cancel_stops_the_reply_and_keeps_the_partial(client: TestClient) -> None:
    with client.websocket_connect("/ws") as ws:
        _open(ws)
        sid = _create(ws)
        assert _ask(ws, {"type": "generation.cancel", "id": "x", "session_id": sid}) == {
            "type": "generation.cancelled", "id": "x", "session_id": sid, "was_running": False}
        ws.send_text(json.dumps({"type": "message.send", "id": "g", "session_id": sid, "content": "Go on forever",
                                 "params": {"max_tokens": 3000, "temperature": 1.0, "seed": 5}}))
        first = ws.receive_json()
        assert first["type"] == "token" and first["id"] == "g"
        ws.send_text(json.dumps({"type": "generation.cancel", "id": "x2", "session_id": sid}))
        frames, done = _until_done(ws, "g")
        cancelled = [f for f in frames if f["type"] == "generation.cancelled"]
        assert cancelled == [{"type": "generation.cancelled", "id": "x2", "session_id": sid, "was_running": True}]
        assert done["finish_reason"] == "cancelled"
        text = first["text"] + "".join(f["text"] for f in frames if f["type"] == "token")
        assert done["assistant_message"]["content"] == text
        assert done["usage"]["output_tokens"] < 3000


def test_disconnect_mid_reply_cancels_and_saves_the_partial(client: TestClient) -> None:
    with client.websocket_connect("/ws") as ws:
        _open(ws)
        sid = _create(ws)
        ws.send_text(json.dumps({"type": "message.send", "id": "g", "session_id": sid, "content": "Talk a lot",
                                 "params": {"max_tokens": 3000, "temperature": 1.0, "seed": 3}}))
        assert ws.receive_json()["type"] == "token"
    with client.websocket_connect("/ws") as ws:
        _open(ws)
        for _ in range(200):  # the server notices the drop, cancels the turn, commits the partial reply
            messages = _ask(ws, {"type": "session.resume", "id": "r", "session_id": sid})["messages"]
            if len(messages) == 2:
                break
            time.sleep(0.05)
        reply = messages[-1]
        assert reply["role"] == "assistant" and reply["finish_reason"] == "cancelled"
        assert reply["usage"]["output_tokens"] < 3000


# ----------------------------------------------------------------------------- handshake and transport


def test_subprotocol_is_selected_when_offered(client: TestClient) -> None:
    with client.websocket_connect("/ws", subprotocols=[SUBPROTOCOL]) as ws:
        assert ws.accepted_subprotocol == SUBPROTOCOL
        _open(ws)
    with client.websocket_connect("/ws") as ws:
        assert ws.accepted_subprotocol is None
        _open(ws)


def test_api_key_is_required_and_accepted_in_every_form(make_client: Callable[..., TestClient]) -> None:
    client = make_client(api_keys=[API_KEY, "other-key"])
    for headers, url in (({}, "/ws"), ({"Authorization": "Bearer wrong"}, "/ws"), ({}, "/ws?api_key=wrong")):
        with client.websocket_connect(url, headers=headers) as ws:
            refusal = ws.receive_json()
            assert refusal["type"] == "error" and refusal["code"] == "unauthorized"
            assert _expect_close(ws) == CLOSE_UNAUTHORIZED
    accepted: list[tuple[dict[str, str], str, list[str]]] = [
        ({"Authorization": f"Bearer {API_KEY}"}, "/ws", []),
        ({"X-API-Key": API_KEY}, "/ws", []),
        ({}, f"/ws?api_key={API_KEY}", []),
        ({}, "/ws", [SUBPROTOCOL, KEY_SUBPROTOCOL_PREFIX + API_KEY]),
    ]
    for headers, url, subprotocols in accepted:
        with client.websocket_connect(url, headers=headers, subprotocols=subprotocols) as ws:
            _open(ws)
            assert _ask(ws, {"type": "ping"}) == {"type": "pong"}
            if subprotocols:
                assert ws.accepted_subprotocol == SUBPROTOCOL


def test_foreign_origin_is_refused_before_accept(make_client: Callable[..., TestClient]) -> None:
    client = make_client(allowed_origins=["https://chat.example"])
    with pytest.raises(WebSocketDisconnect) as refused:
        with client.websocket_connect("/ws", headers={"Origin": "https://evil.example"}):
            pass
    assert refused.value.code == 1008  # the server turns a close before accept into HTTP 403
    for origin in ("https://chat.example", "http://testserver"):  # listed, and an allowed host
        with client.websocket_connect("/ws", headers={"Origin": origin}) as ws:
            _open(ws)


def test_idle_connection_is_closed(make_client: Callable[..., TestClient]) -> None:
    client = make_client(idle_timeout_s=0.2)
    with client.websocket_connect("/ws") as ws:
        _open(ws)
        assert _expect_close(ws) == CLOSE_IDLE


class _StuckSocket:
    """Just enough of a Starlette WebSocket whose peer never reads: sends never complete."""

    def __init__(self) -> None:
        self.application_state = WebSocketState.CONNECTED
        self.incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.closed_with: int | None = None

    async def receive(self) -> dict[str, Any]:
        return await self.incoming.get()

    async def send_text(self, text: str) -> None:
        await asyncio.Event().wait()

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.closed_with = code
        self.application_state = WebSocketState.DISCONNECTED
        self.incoming.put_nowait({"type": "websocket.disconnect", "code": code})


class _Handler:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.stops = 0

    @property
    def busy(self) -> bool:
        return True

    async def handle(self, text: str) -> None:
        for _ in range(100):
            self.conn.emit(Pong(id=text))

    def stop(self) -> None:
        self.stops += 1


async def test_a_reader_too_slow_for_its_queue_is_closed_and_its_work_stopped() -> None:
    ws = _StuckSocket()
    conn = Connection(ws, send_queue_frames=16, idle_timeout_s=60)  # type: ignore[arg-type]
    handler = _Handler(conn)
    ws.incoming.put_nowait({"type": "websocket.receive", "text": "flood"})
    await asyncio.wait_for(conn.serve(handler), 30)
    assert ws.closed_with == CLOSE_TOO_SLOW
    assert handler.stops >= 1 and conn.closing
    conn.emit(Pong())  # a closing connection drops frames instead of failing


# ----------------------------------------------------------------------------- admin HTTP, in process


def _admin_headers(client: TestClient) -> dict[str, str]:
    return {"Authorization": f"Bearer {client.app.state.admin_token}"}  # type: ignore[attr-defined]


MALFORMED_IDS = ["short", "has.dots.and.is.long.enough", "with%20a%20space%20long%20enough", "a" * 65]


@pytest.mark.parametrize("session_id", MALFORMED_IDS, ids=["short", "dots", "space", "too-long"])
def test_admin_routes_answer_404_for_an_id_outside_the_format(
        client: TestClient, caplog: pytest.LogCaptureFixture, session_id: str) -> None:
    headers = _admin_headers(client)
    for method, path in (("GET", f"/admin/sessions/{session_id}"),
                         ("POST", f"/admin/sessions/{session_id}/evict"),
                         ("POST", f"/admin/sessions/{session_id}/restore"),
                         ("DELETE", f"/admin/sessions/{session_id}")):
        answer = client.request(method, path, headers=headers)
        assert answer.status_code == 404, (method, path, answer.text)
        assert answer.json()["error"]["code"] == "not_found"
    # Without the token, the token is what is missing (the id is not looked at first).
    assert client.delete(f"/admin/sessions/{session_id}").status_code == 401
    _assert_quiet(caplog)


def test_admin_pagination_is_bounded(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    headers = _admin_headers(client)
    for query in (f"offset={MAX_PAGE_OFFSET + 1}", "offset=9223372036854775808", "offset=-1",
                  f"limit={MAX_PAGE_LIMIT + 1}", "limit=0"):
        answer = client.get(f"/admin/sessions?{query}", headers=headers)
        assert answer.status_code == 400, (query, answer.text)
        assert answer.json()["error"]["code"] == "bad_request"
    page = client.get(f"/admin/sessions?offset={MAX_PAGE_OFFSET}&limit={MAX_PAGE_LIMIT}", headers=headers)
    assert page.status_code == 200 and page.json()["sessions"] == []
    assert page.json()["offset"] == MAX_PAGE_OFFSET and page.json()["limit"] == MAX_PAGE_LIMIT
    _assert_quiet(caplog)


# ----------------------------------------------------------------------------- browser-facing hardening

PORT = 8123


def _refused(client: TestClient, headers: dict[str, str]) -> int:
    """The close code of a websocket handshake that must be refused before accept."""
    with pytest.raises(WebSocketDisconnect) as refused:
        with client.websocket_connect("/ws", headers=headers):
            pass
    return refused.value.code


def test_dns_rebinding_handshake_is_refused(make_client: Callable[..., TestClient]) -> None:
    # The default allow-list, no API keys: what a fresh install runs with.
    client = make_client(allowed_hosts=[], port=PORT)
    rebind = f"rebind.example:{PORT}"
    assert _refused(client, {"Host": rebind, "Origin": f"http://{rebind}"}) == 1008
    assert _refused(client, {"Host": rebind}) == 1008  # a program with a foreign Host, too
    # An allowed Host does not make a foreign Origin acceptable.
    assert _refused(client, {"Host": f"127.0.0.1:{PORT}", "Origin": f"http://{rebind}"}) == 1008


def test_foreign_host_on_http_gets_400(make_client: Callable[..., TestClient]) -> None:
    client = make_client(allowed_hosts=[], port=PORT)
    for path in ("/healthz", "/", "/metrics", "/admin/stats"):
        for host in (f"rebind.example:{PORT}", "testserver", f"localhost:{PORT + 1}", "bad host;", ""):
            answer = client.get(path, headers={"Host": host})
            assert answer.status_code == 400, (path, host, answer.text)
            assert answer.json()["error"]["code"] == "bad_request"
            assert set(answer.json()["error"]) == {"code", "message"}


def test_loopback_hosts_and_browser_origins_are_allowed_by_default(
        make_client: Callable[..., TestClient]) -> None:
    client = make_client(allowed_hosts=[], port=PORT)
    for name in ("127.0.0.1", "localhost", "[::1]", "LOCALHOST"):
        for host in (name, f"{name}:{PORT}"):
            assert client.get("/healthz", headers={"Host": host}).status_code == 200, host
    own = f"127.0.0.1:{PORT}"
    for origin in (f"http://{own}", f"http://localhost:{PORT}", "http://[::1]"):
        with client.websocket_connect("/ws", headers={"Host": own, "Origin": origin}) as ws:
            _open(ws)
    assert _refused(client, {"Host": own, "Origin": f"http://127.0.0.1:{PORT + 1}"}) == 1008
    assert _refused(client, {"Host": own, "Origin": "null"}) == 1008


def test_configured_hosts_and_origins(make_client: Callable[..., TestClient]) -> None:
    client = make_client(allowed_hosts=["chat.example", "api.example:8443"], allowed_origins=["https://app.example"])
    for host, status in (("chat.example", 200), ("chat.example:9000", 200), ("api.example:8443", 200),
                         ("api.example", 400), ("127.0.0.1:8000", 400)):  # the list replaces the defaults
        assert client.get("/healthz", headers={"Host": host}).status_code == status, host
    for origin in ("https://chat.example", "https://app.example", "https://api.example:8443"):
        with client.websocket_connect("/ws", headers={"Host": "chat.example", "Origin": origin}) as ws:
            _open(ws)
    assert _refused(client, {"Host": "chat.example", "Origin": "https://evil.example"}) == 1008

    # "*" turns the Host check off; a browser must still come from the page's own origin or the list.
    client = make_client(allowed_hosts=["*"], allowed_origins=["https://app.example"])
    assert client.get("/healthz", headers={"Host": "anything.example"}).status_code == 200
    for origin in ("http://anything.example", "https://app.example"):
        with client.websocket_connect("/ws", headers={"Host": "anything.example", "Origin": origin}) as ws:
            _open(ws)
    assert _refused(client, {"Host": "anything.example", "Origin": "https://evil.example"}) == 1008


def test_security_headers_on_the_ui_and_admin(client: TestClient) -> None:
    for path in ("/", "/app.js", "/style.css"):
        answer = client.get(path)
        assert answer.status_code == 200, path
        csp = answer.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert "connect-src 'self' ws://testserver wss://testserver" in csp
        assert answer.headers["x-frame-options"] == "DENY"
        assert answer.headers["x-content-type-options"] == "nosniff"
        assert answer.headers["referrer-policy"] == "no-referrer"
        assert "cache-control" not in answer.headers or "no-store" not in answer.headers["cache-control"]
    for headers in (_admin_headers(client), {}):  # answers and refusals alike
        answer = client.get("/admin/stats", headers=headers)
        assert answer.status_code in (200, 401)
        assert answer.headers["cache-control"] == "no-store"
        assert answer.headers["x-content-type-options"] == "nosniff"


def test_metrics_token(make_client: Callable[..., TestClient], client: TestClient) -> None:
    assert client.get("/metrics").status_code == 200  # open by default
    guarded = make_client(metrics_token="m-secret")
    assert guarded.get("/metrics").status_code == 401
    assert guarded.get("/metrics").json()["error"]["code"] == "unauthorized"
    assert guarded.get("/metrics", headers=_admin_headers(guarded)).status_code == 401
    assert guarded.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    answer = guarded.get("/metrics", headers={"Authorization": "Bearer m-secret"})
    assert answer.status_code == 200 and "chatd_" in answer.text
    assert guarded.get("/admin/stats", headers={"Authorization": "Bearer m-secret"}).status_code == 401
    assert guarded.get("/admin/stats", headers=_admin_headers(guarded)).status_code == 200
