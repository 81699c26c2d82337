"""End to end: a real `chatd serve` process on a loopback port, the real client, raw websockets for bad input."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from chatd.client import ChatClient, ChatError, ConnectionLost
from chatd.protocol import MessageDone
from tests.support import ROOT, ServerProcess, tiny_model_dir

MAX_CHARS = 2000
MAX_FRAME = 16_384


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        tmp_path_factory.mktemp("e2e"), tiny_model_dir(),
        server={"max_message_chars": MAX_CHARS, "max_frame_bytes": MAX_FRAME, "max_generations_per_connection": 2},
        cache={"restore_min_tokens": 0},
    ).start()
    yield proc
    proc.stop()


@pytest.fixture
async def client(server: ServerProcess) -> AsyncIterator[ChatClient]:
    async with await ChatClient.connect(server.ws_url) as c:
        yield c


async def _raw(server: ServerProcess) -> ClientConnection:
    ws = await connect(server.ws_url)
    hello = json.loads(await ws.recv())
    assert hello["type"] == "hello" and hello["protocol_version"] == 1
    return ws


async def _frame(ws: ClientConnection) -> dict[str, object]:
    return dict(json.loads(await asyncio.wait_for(ws.recv(), 30)))


async def test_full_conversation_with_cache_hits(client: ChatClient) -> None:
    assert client.hello is not None and client.hello.model.startswith("tiny-llama")
    session = await client.create_session(system="Be brief.", title="e2e")
    assert session.tier == "none" and session.message_count == 1
    reply = await client.send(session.session_id, "Hello there", max_tokens=12, temperature=1.0, seed=1)
    pieces = [p async for p in reply]
    done = reply.done
    assert done is not None and done.finish_reason in ("stop", "length")
    assert "".join(pieces) == done.assistant_message.content
    usage = done.usage
    assert usage.cached_tokens == 0 and usage.cache_tier == "none"
    assert usage.cached_tokens + usage.prefill_tokens == usage.input_tokens
    assert usage.output_tokens <= 12 and usage.ttft_ms > 0
    second = await client.send(session.session_id, "And again", max_tokens=8, temperature=1.0, seed=2)
    done2 = await second.result()
    assert isinstance(done2, MessageDone)
    assert done2.usage.cache_tier == "device"
    # Everything up to the previous reply's last fed token came from the cache.
    assert done2.usage.cached_tokens == usage.input_tokens + usage.output_tokens - 1
    assert done2.user_message.index == 3 and done2.assistant_message.index == 4


async def test_resume_after_client_drops(server: ServerProcess) -> None:
    first = await ChatClient.connect(server.ws_url)
    session = await first.create_session()
    await (await first.send(session.session_id, "Remember this", max_tokens=6)).result()
    assert first._ws is not None
    first._ws.transport.abort()  # the network goes away, no close handshake
    await asyncio.sleep(0.2)
    # The same client reconnects on its next call and resumes the session.
    again = await first.send(session.session_id, "Still there?", max_tokens=6)
    done = await again.result()
    assert isinstance(done, MessageDone) and done.usage.cache_tier == "device"
    assert first.reconnects == 1
    await first.close()
    async with await ChatClient.connect(server.ws_url) as other:
        info, messages = await other.resume(session.session_id)
        assert info.message_count == 4
        assert [m.role for m in messages] == ["user", "assistant", "user", "assistant"]


async def test_disconnect_mid_reply_saves_the_partial(server: ServerProcess) -> None:
    c = await ChatClient.connect(server.ws_url, reconnect=False)
    session = await c.create_session()
    reply = await c.send(session.session_id, "Talk for a long time", max_tokens=3000, temperature=1.0, seed=3)
    seen = ""
    with pytest.raises(ConnectionLost):
        async for piece in reply:
            seen += piece
            if len(seen) > 20:
                assert c._ws is not None
                c._ws.transport.abort()
    async with await ChatClient.connect(server.ws_url) as other:
        for _ in range(100):  # the server notices the drop, cancels, commits the partial
            _, messages = await other.resume(session.session_id)
            if len(messages) == 2:
                break
            await asyncio.sleep(0.1)
        assert messages[1].role == "assistant"
        assert messages[1].content.startswith(seen)
        async with httpx.AsyncClient(base_url=server.http_url, headers=server.admin_headers) as http:
            detail = (await http.get(f"/admin/sessions/{session.session_id}")).json()
        assert detail["messages"][1]["finish_reason"] == "cancelled"
        assert detail["messages"][1]["usage"]["output_tokens"] < 3000


async def test_tiny_temperature_frame_answers_and_the_engine_keeps_serving(server: ServerProcess) -> None:
    # The exact frame that used to kill the engine thread for every session (reliability bug 1).
    ws = await _raw(server)
    try:
        await ws.send(json.dumps({"type": "session.create", "id": "c"}))
        sid = (await _frame(ws))["session"]["session_id"]  # type: ignore[index]
        await ws.send(json.dumps({"type": "message.send", "id": "1", "session_id": sid, "content": "Hello",
                                  "params": {"temperature": 1e-40, "max_tokens": 2}}))
        frame = await _frame(ws)
        while frame["type"] == "token":
            frame = await _frame(ws)
        assert frame["type"] == "message.done", frame
        assert frame["usage"]["output_tokens"] == 2  # type: ignore[index]
    finally:
        await ws.close()
    async with await ChatClient.connect(server.ws_url) as other:
        session = await other.create_session()
        done = await (await other.send(session.session_id, "Still alive?", max_tokens=3)).result()
        assert isinstance(done, MessageDone) and done.usage.output_tokens == 3
    async with httpx.AsyncClient(base_url=server.http_url) as http:
        assert (await http.get("/healthz")).status_code == 200


async def test_edit_and_cancel(client: ChatClient) -> None:
    session = await client.create_session()
    await (await client.send(session.session_id, "First question", max_tokens=6)).result()
    await (await client.send(session.session_id, "Second question", max_tokens=6)).result()
    edited = await client.edit(session.session_id, 0, "First question, edited", max_tokens=6)
    done = await edited.result()
    assert isinstance(done, MessageDone)
    assert done.usage.invalidated_from is not None and done.usage.invalidated_from > 0
    assert done.usage.cached_tokens == done.usage.invalidated_from
    assert done.user_message.content == "First question, edited" and done.assistant_message.index == 1
    _, messages = await client.resume(session.session_id)
    assert len(messages) == 2

    # A sampled reply may end on its own before the cancel reaches the server (a short sample, which other
    # sessions' shared blocks can change): then nothing is cancelled, and the next seed is tried.
    for seed in range(5, 10):
        long = await client.send(session.session_id, "Go on forever", max_tokens=3000, temperature=1.0, seed=seed)
        got, cancelled = "", None
        async for piece in long:
            got += piece
            if len(got) >= 10 and cancelled is None:
                cancelled = await long.cancel()
        assert long.done is not None
        if cancelled:
            break
        assert long.done.finish_reason == "stop"  # it ended before a cancel was sent, or before it arrived
    else:
        pytest.fail("five sampled replies all ended before a cancel reached them")
    assert long.done.finish_reason == "cancelled"
    assert long.done.assistant_message.content == got
    assert not await client.cancel(session.session_id)  # nothing running any more


async def test_admin_evict_restore_delete(server: ServerProcess, client: ChatClient) -> None:
    session = await client.create_session()
    sid = session.session_id
    await (await client.send(sid, "Some history to keep", max_tokens=10)).result()
    headers = server.admin_headers
    async with httpx.AsyncClient(base_url=server.http_url, headers=headers) as http:
        listed = (await http.get("/admin/sessions", params={"tier": "device"})).json()
        assert sid in [s["session_id"] for s in listed["sessions"]]
        row = next(s for s in listed["sessions"] if s["session_id"] == sid)
        assert row["kv_bytes"] > 0 and row["tier"] == "device"
        evicted = (await http.post(f"/admin/sessions/{sid}/evict")).json()
        assert evicted == {"session_id": sid, "done": True, "tier": "disk"}
        on_disk = (await http.get("/admin/sessions", params={"tier": "disk"})).json()
        row = next(s for s in on_disk["sessions"] if s["session_id"] == sid)
        assert row["snapshot_bytes"] > 0 and row["kv_bytes"] == 0
        reply = await client.send(sid, "Back again", max_tokens=4)
        done = await reply.result()
        assert isinstance(done, MessageDone)
        assert done.usage.cache_tier == "disk" and done.usage.restore_ms is not None
        assert done.usage.cached_tokens > 0
        # Explicit restore after another eviction.
        assert (await http.post(f"/admin/sessions/{sid}/evict")).json()["done"]
        restored = (await http.post(f"/admin/sessions/{sid}/restore")).json()
        assert restored["tier"] == "device"
        detail = (await http.get(f"/admin/sessions/{sid}")).json()
        assert detail["cached_tokens"] > 0
        spans = [m["token_span"] for m in detail["messages"]]
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        stats = (await http.get("/admin/stats")).json()
        assert stats["restores"] >= 2 and stats["evictions"] >= 2
        assert 0 < stats["cached_token_ratio"] <= 1
        assert (await http.delete(f"/admin/sessions/{sid}")).status_code == 204
        assert (await http.get(f"/admin/sessions/{sid}")).status_code == 404
        assert (await http.delete(f"/admin/sessions/{sid}")).status_code == 404
    with pytest.raises(ChatError) as info:
        await client.resume(sid)
    assert info.value.code == "not_found"
    snapshots = list((server.folder / "data" / "snapshots").glob("*"))
    assert not [p for p in snapshots if sid in p.name]


def test_admin_requires_the_token(server: ServerProcess) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic dGVzdA=="}):
        for method, path in (("GET", "/admin/sessions"), ("GET", "/admin/stats"),
                             ("POST", "/admin/sessions/x/evict"), ("DELETE", "/admin/sessions/x")):
            response = httpx.request(method, f"{server.http_url}{path}", headers=headers)
            assert response.status_code == 401, (method, path, headers)
            assert response.json()["error"]["code"] == "unauthorized"
    assert httpx.get(f"{server.http_url}/docs").status_code == 200
    assert "/admin/sessions" in httpx.get(f"{server.http_url}/openapi.json").json()["paths"]


async def test_bad_input_smoke_and_the_transport_limit_closes_only_that_connection(server: ServerProcess) -> None:
    # Every bad frame and its code: tests/test_protocol_inprocess.py. Here, over a real socket: one bad
    # frame, then the transport limit, which only the real server (uvicorn's ws_max_size) enforces.
    ws = await _raw(server)
    await ws.send(json.dumps({"type": "message.send", "id": "m", "content": "no session id"}))
    assert await _frame(ws) | {"message": ""} == {"type": "error", "id": "m", "code": "bad_request", "message": ""}
    await ws.send(json.dumps({"type": "ping", "id": "p"}))
    assert await _frame(ws) == {"type": "pong", "id": "p"}
    await ws.send("y" * (MAX_FRAME * 4 + 100))
    with pytest.raises(ConnectionClosed) as closed:
        for _ in range(3):
            await _frame(ws)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    again = await _raw(server)
    await again.send(json.dumps({"type": "ping"}))
    assert (await _frame(again))["type"] == "pong"
    await again.close()


async def test_generation_limits_per_connection(server: ServerProcess) -> None:
    async with await ChatClient.connect(server.ws_url) as c:
        sessions = [await c.create_session() for _ in range(3)]
        replies = [await c.send(s.session_id, "long one", max_tokens=300) for s in sessions]
        outcomes = []
        for reply in replies:
            try:
                outcomes.append((await reply.result()).type)
            except ChatError as exc:
                outcomes.append(exc.code)
        assert outcomes.count("rate_limited") == 1 and outcomes.count("message.done") == 2


async def test_two_clients_stream_at_once_and_a_slow_reader_stalls_nobody(server: ServerProcess) -> None:
    slow = await _raw(server)
    await slow.send(json.dumps({"type": "session.create", "id": "c"}))
    sid = (await _frame(slow))["session"]["session_id"]  # type: ignore[index]
    await slow.send(json.dumps({"type": "message.send", "id": "s", "session_id": sid, "content": "go",
                                "params": {"max_tokens": 300}}))
    # `slow` never reads again while the others stream.
    async with await ChatClient.connect(server.ws_url) as a, await ChatClient.connect(server.ws_url) as b:
        sa, sb = await a.create_session(), await b.create_session()
        ra = await a.send(sa.session_id, "one", max_tokens=20, temperature=1.0, seed=11)
        rb = await b.send(sb.session_id, "two", max_tokens=20, temperature=1.0, seed=12)
        da, db = await asyncio.gather(ra.result(), rb.result())
        assert isinstance(da, MessageDone) and isinstance(db, MessageDone)
        assert ra.text == da.assistant_message.content and rb.text == db.assistant_message.content
        assert da.session_id == sa.session_id and db.session_id == sb.session_id
    await slow.close()


async def test_metrics_and_health(server: ServerProcess, client: ChatClient) -> None:
    session = await client.create_session()
    await (await client.send(session.session_id, "count me", max_tokens=4)).result()
    async with httpx.AsyncClient(base_url=server.http_url) as http:
        text = (await http.get("/metrics")).text
        health = (await http.get("/healthz")).json()
    for name in ("chatd_kv_bytes{tier=\"device\"}", "chatd_sessions{tier=\"disk\"}", "chatd_evictions_total",
                 "chatd_restores_total", "chatd_cached_tokens_total", "chatd_prefilled_tokens_total",
                 "chatd_ttft_seconds_bucket", "chatd_decode_tokens_per_second_bucket", "chatd_restore_seconds_bucket",
                 "chatd_active_generations", "chatd_websocket_connections"):
        assert name in text, name
    assert health["status"] == "ok"


async def test_restart_loses_nothing_acknowledged_and_resumes_from_snapshots(tmp_path: Path) -> None:
    proc = ServerProcess(tmp_path, tiny_model_dir(), cache={"restore_min_tokens": 0}).start()
    http = httpx.AsyncClient(base_url=proc.http_url, headers=proc.admin_headers)
    try:
        async with await ChatClient.connect(proc.ws_url, reconnect=False) as c:
            kept = await c.create_session()
            await (await c.send(kept.session_id, "turn one", max_tokens=8)).result()
            evicted = await c.create_session()
            await (await c.send(evicted.session_id, "goes to disk", max_tokens=8)).result()
            assert (await http.post(f"/admin/sessions/{evicted.session_id}/evict")).json()["done"]
            history = (await http.get(f"/admin/sessions/{evicted.session_id}")).json()
            # A turn in flight when the process dies: its user message was committed first.
            inflight = await c.send(kept.session_id, "turn two, interrupted", max_tokens=3000, temperature=1.0)
            async for _ in inflight:
                break
            proc.kill()
        proc.start()
        async with await ChatClient.connect(proc.ws_url) as c:
            _, messages = await c.resume(kept.session_id)
            assert [m.content for m in messages if m.role == "user"] == ["turn one", "turn two, interrupted"]
            info, _ = await c.resume(evicted.session_id)
            assert info.tier == "disk"
            done = await (await c.send(evicted.session_id, "after the crash", max_tokens=4)).result()
            assert isinstance(done, MessageDone)
            last = history["messages"][-1]["usage"]
            assert done.usage.cache_tier == "disk"
            # Everything the cache held before the crash came back from the snapshot: the previous
            # prompt and all reply ids but the last (a reply's final id is never fed).
            assert done.usage.cached_tokens == last["input_tokens"] + last["output_tokens"] - 1
    finally:
        await http.aclose()
        proc.kill()


async def test_graceful_shutdown_snapshots_resident_sessions(tmp_path: Path) -> None:
    proc = ServerProcess(tmp_path, tiny_model_dir(), cache={"restore_min_tokens": 0}).start()
    try:
        async with await ChatClient.connect(proc.ws_url, reconnect=False) as c:
            session = await c.create_session()
            first = await (await c.send(session.session_id, "remember me", max_tokens=8)).result()
            assert isinstance(first, MessageDone)
        # SIGTERM: uvicorn shuts down gracefully (then re-raises the signal, hence -15), and idle
        # resident caches are written to disk on the way out.
        assert proc.stop() in (0, -15)
        assert "snapshotted 1 sessions at shutdown" in proc.log_text()
        proc.start()
        async with await ChatClient.connect(proc.ws_url) as c:
            done = await (await c.send(session.session_id, "still here?", max_tokens=4)).result()
            assert isinstance(done, MessageDone)
            assert done.usage.cache_tier == "disk"
            assert done.usage.cached_tokens == first.usage.input_tokens + first.usage.output_tokens - 1
    finally:
        proc.kill()


async def test_api_key_and_origin_over_a_real_socket(tmp_path: Path) -> None:
    # Every way of offering a key, and the idle close: tests/test_protocol_inprocess.py. Here: the real
    # client's refusal and acceptance, and the HTTP 403 that only a real server sends at handshake.
    proc = ServerProcess(tmp_path, tiny_model_dir(), server={"api_keys": ["k-123"],
                                                             "allowed_origins": ["https://chat.example"]}).start()
    try:
        with pytest.raises(ChatError) as refused:
            await ChatClient.connect(proc.ws_url)
        assert refused.value.code == "unauthorized"
        async with await ChatClient.connect(proc.ws_url, api_key="k-123") as c:
            assert await c.ping() >= 0
        async with connect(f"{proc.ws_url}?api_key=k-123", origin="https://chat.example") as ws:  # type: ignore[arg-type]
            assert json.loads(await ws.recv())["type"] == "hello"
        with pytest.raises(InvalidStatus) as status:
            async with connect(f"{proc.ws_url}?api_key=k-123", origin="https://evil.example"):  # type: ignore[arg-type]
                pass
        assert status.value.response.status_code == 403
    finally:
        proc.kill()


def test_terminal_chat(server: ServerProcess) -> None:
    script = "Hello there\nSecond line\n/usage\n/edit 0 Hello again\n/history\n/session\n/quit\n"
    run = subprocess.run([sys.executable, "-m", "chatd", "chat", "--url", server.ws_url],
                         input=script, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "new session" in out
    assert "cached" in out and "(device)" in out  # /usage after the second turn
    history = out.split("[0] user: ")[-1]
    assert history.startswith("Hello again") and "[2]" not in history  # the edit dropped the later turn
    session_id = out.split("new session ", 1)[1].split()[0]
    assert out.count(session_id) == 2  # the greeting and /session
    detail = httpx.get(f"{server.http_url}/admin/sessions/{session_id}", headers=server.admin_headers).json()
    assert detail["messages"][0]["content"] == "Hello again"
    assert len(detail["messages"]) == 2
