"""Reliability suite: hypothesis-driven websocket fuzzing against a real ``chatd serve`` (tiny model).

Every example is a batch of frames (well-formed frames with fuzzed fields, random JSON, deep nesting, lone
surrogates, binary junk) sent on one connection, followed by a ``ping`` whose ``pong`` proves the
connection is still up and has answered everything before it. Whatever the server sends must be a known
frame type; no frame may be answered ``internal``; the log must hold no traceback. CI sends at least 2,000
frames; ``--long`` (or CHATD_RELIABILITY_LONG=1) at least 10,000.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.sync.client import ClientConnection, connect

from chatd.errors import ERROR_CODES
from tests.support import ServerProcess, tiny_model_dir

MAX_FRAME = 8192
SERVER_TYPES = {"hello", "session.created", "session.resumed", "token", "message.done", "message.edited",
                "generation.cancelled", "pong", "error"}
CLIENT_TYPES = ["session.create", "session.resume", "message.send", "message.edit", "generation.cancel", "ping"]
FIELDS = ["id", "type", "session_id", "content", "system", "title", "index", "params"]
PARAM_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("fuzz"), tiny_model_dir(),
                         server={"max_frame_bytes": MAX_FRAME, "max_message_chars": 2000},
                         generation={"max_tokens": 4})
    proc.start()
    yield proc
    proc.stop()


def lone_surrogates() -> st.SearchStrategy[str]:
    return st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3)


def texts() -> st.SearchStrategy[str]:
    return st.one_of(st.text(max_size=40), lone_surrogates(), st.builds(lambda a, b: a + b, st.text(max_size=10),
                                                                       lone_surrogates()))


def json_values(session_ids: list[str]) -> st.SearchStrategy[Any]:
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2**70), max_value=2**70),
                        st.floats(allow_nan=False), texts(), st.sampled_from(session_ids))
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(texts(), inner, max_size=4)), max_leaves=8)


def frames(session_ids: list[str]) -> st.SearchStrategy[str | bytes]:
    values = json_values(session_ids)
    params = st.dictionaries(st.sampled_from(PARAM_FIELDS), st.one_of(
        st.integers(-5, 6), st.floats(-1, 6, allow_nan=False), st.just(1e-40), st.lists(texts(), max_size=3), values),
        max_size=4)
    field_values = {
        "id": st.one_of(st.text(max_size=8), lone_surrogates(), st.text(min_size=129, max_size=140), values),
        "session_id": st.one_of(st.sampled_from(session_ids), st.text(max_size=70), values),
        "content": st.one_of(texts(), st.text(min_size=1990, max_size=2100), values),
        "index": st.one_of(st.integers(-2, 6), values),
        "params": st.one_of(params, values),
    }
    typed = st.builds(
        lambda kind, fields: json.dumps({"type": kind, **fields}),
        st.one_of(st.sampled_from(CLIENT_TYPES), texts()),
        st.dictionaries(st.sampled_from(FIELDS), st.none(), max_size=5).flatmap(
            lambda keys: st.fixed_dictionaries({k: field_values.get(k, values) for k in keys if k != "type"})),
    )
    nested = st.builds(lambda n, c: c * n + "1" + {"[": "]", "{\"a\":": "}"}[c] * n,
                       st.integers(1, 5000), st.sampled_from(["[", "{\"a\":"]))
    return st.one_of(
        typed, typed, typed,
        values.map(json.dumps),
        nested,
        st.text(max_size=60),
        st.binary(max_size=60),
        st.integers(MAX_FRAME - 50, MAX_FRAME + 200).map(lambda n: json.dumps({"type": "ping", "id": "x" * n})),
    )


def check(frame: dict[str, Any]) -> None:
    assert frame.get("type") in SERVER_TYPES, frame
    if frame["type"] == "error":
        assert frame["code"] in ERROR_CODES and frame["code"] != "internal", frame


def exchange(ws: ClientConnection, batch: list[str | bytes], sentinel: str) -> None:
    for frame in batch:
        ws.send(frame)
    ws.send(json.dumps({"type": "ping", "id": sentinel}))
    while True:
        answer = json.loads(ws.recv(timeout=60))
        check(answer)
        if answer == {"type": "pong", "id": sentinel}:
            return


def test_fuzzed_frames_never_reach_a_traceback(server: ServerProcess, long_mode: bool,
                                               figures: Callable[..., None]) -> None:
    examples, batch_size = (520, 20) if long_mode else (105, 20)
    with connect(server.ws_url, max_size=None) as setup:
        assert json.loads(setup.recv(timeout=30))["type"] == "hello"
        setup.send(json.dumps({"type": "session.create", "system": "fuzz"}))
        session_ids = [json.loads(setup.recv(timeout=30))["session"]["session_id"]]
    session_ids.append("A" * 24)  # well-formed, names no session
    sent = {"frames": 0, "examples": 0}
    with connect(server.ws_url, max_size=None) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "hello"

        @settings(max_examples=examples, deadline=None, database=None, derandomize=not long_mode,
                  suppress_health_check=list(HealthCheck))
        @given(batch=st.lists(frames(session_ids), min_size=batch_size, max_size=batch_size))
        def run(batch: list[str | bytes]) -> None:
            sent["examples"] += 1
            exchange(ws, batch, f"sentinel-{sent['examples']}")
            sent["frames"] += len(batch) + 1

        run()
    log = server.log_text()
    assert "Traceback" not in log
    assert httpx.get(f"{server.http_url}/healthz", timeout=10).status_code == 200
    assert sent["frames"] >= (10_000 if long_mode else 2_000)
    figures("fuzz", frames=sent["frames"], examples=sent["examples"], tracebacks=log.count("Traceback"),
            internal_errors=0, connections_dropped=0)


def test_the_fuzz_strategy_reaches_the_nasty_cases() -> None:
    # The strategy must keep producing what broke the server before: lone surrogates, deep nesting, binary.
    seen = {"surrogate": False, "deep": False, "binary": False}

    @settings(max_examples=300, deadline=None, database=None, derandomize=True)
    @given(frame=frames(["B" * 24]))
    def sample(frame: str | bytes) -> None:
        if isinstance(frame, bytes):
            seen["binary"] = True
        elif "\\ud" in frame:
            seen["surrogate"] = True
        elif frame.startswith("[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["):
            seen["deep"] = True

    sample()
    assert seen == {"surrogate": True, "deep": True, "binary": True}

