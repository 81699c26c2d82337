"""Reliability suite: SIGKILL ``chatd serve`` at random moments and restart it on the same data folder.

Moments: in the middle of a streamed reply, while an operator eviction writes a snapshot, and while idle
sessions are being persisted in the background. After every restart:
- no acknowledged message is lost: a user message counts as acknowledged once its first token arrived
  (it is committed before generation starts), a reply once its ``message.done`` arrived; the stored
  history is exactly the acknowledged messages plus, at most, the turn that was in flight (its user
  message, marked ``unanswered`` when its reply is missing, and the reply if it was committed);
- the next greedy reply equals a fresh computation: transformers' own forward from scratch over the
  stored token ids, with no cache of any kind.
CI kills 10 times, ``--long`` 25.
"""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM
from websockets.asyncio.client import ClientConnection, connect

from chatd.chat.template import ChatTemplate
from chatd.engine.model.runner import ModelRunner
from chatd.store.models import unpack_token_ids
from tests.support import ServerProcess, reference_greedy

GREEDY_TOKENS = 8
Ack = tuple[str, str]  # (role, content)


class Tracker:
    """What the client was told: the acknowledged messages of each session and the turn in flight."""

    def __init__(self) -> None:
        self.acked: dict[str, list[Ack]] = {}
        self.in_flight: dict[str, list[Ack]] = {}

    def check(self, session_id: str, stored: list[dict[str, Any]]) -> int:
        """Compare with the stored history; returns how many acknowledged messages are missing (the test wants 0)
        and asserts that anything beyond them is the turn that was in flight."""
        have = [(m["role"], m["content"]) for m in stored]
        acked = self.acked[session_id]
        lost = sum(1 for a, b in zip(acked, have, strict=False) if a != b) + max(0, len(acked) - len(have))
        extra = stored[len(acked):]
        flight = self.in_flight.get(session_id, [])
        assert len(extra) <= 2, (acked, have)
        if extra and flight[0][0] == "assistant":
            # The user message was acknowledged (a token arrived); its reply may have been stored since, whole or
            # cut short, without the client seeing it end.
            assert len(extra) == 1 and extra[0]["role"] == "assistant", (extra, flight)
        elif extra:
            assert (extra[0]["role"], extra[0]["content"]) == flight[0], (extra, flight)
            if len(extra) == 2:
                assert extra[1]["role"] == "assistant" and not extra[0].get("unanswered")
            else:
                assert extra[0].get("unanswered") is True, extra  # an unanswered user message is marked
        # What survived becomes acknowledged: it is in the store now.
        self.acked[session_id] = [(m["role"], m["content"]) for m in stored]
        self.in_flight.pop(session_id, None)
        return lost


async def _frame(ws: ClientConnection) -> dict[str, Any]:
    return dict(json.loads(await asyncio.wait_for(ws.recv(), 60)))


async def _request(ws: ClientConnection, frame: dict[str, Any]) -> dict[str, Any]:
    await ws.send(json.dumps(frame))
    while True:
        answer = await _frame(ws)
        if answer.get("id") == frame.get("id"):
            return answer


async def _turn(ws: ClientConnection, tracker: Tracker, sid: str, content: str, params: dict[str, Any],
                stop_after: int | None = None) -> dict[str, Any] | None:
    """Send a message; acknowledge as the frames arrive. Returns message.done, or None after ``stop_after`` tokens."""
    rid = f"t{random.getrandbits(32)}"
    tracker.in_flight[sid] = [("user", content)]
    await ws.send(json.dumps({"type": "message.send", "id": rid, "session_id": sid, "content": content,
                              "params": params}))
    tokens = 0
    while True:
        frame = await _frame(ws)
        if frame.get("id") != rid:
            continue
        if frame["type"] == "token":
            if tokens == 0:
                tracker.acked[sid].append(("user", content))
                tracker.in_flight[sid] = [("assistant", "")]  # the reply, not yet seen whole
            tokens += 1
            if stop_after is not None and tokens >= stop_after:
                return None
        elif frame["type"] == "message.done":
            if tokens == 0:
                tracker.acked[sid].append(("user", content))
            tracker.acked[sid].append(("assistant", frame["assistant_message"]["content"]))
            tracker.in_flight.pop(sid, None)
            return frame
        else:
            raise AssertionError(frame)


def _stored_ids(db: Path, session_id: str) -> list[tuple[int, ...]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT token_ids FROM messages WHERE session_id = ? AND archived_by_edit IS NULL "
                            "ORDER BY position", (session_id,)).fetchall()
    return [unpack_token_ids(blob) for (blob,) in rows]


def test_sigkill_at_random_moments_loses_no_acknowledged_message(
        tmp_path: Path, tiny_dir: Path, tiny_runner: ModelRunner, long_mode: bool,
        figures: Callable[..., None]) -> None:
    kills = 25 if long_mode else 10
    rng = random.Random(20261203)
    reference_model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    template = ChatTemplate(tiny_runner.tokenizer)
    eos = tiny_runner.info.eos_token_ids
    # A token frame per token (no coalescing), so that a kill after a few frames comes while the reply runs.
    server = ServerProcess(tmp_path, tiny_dir, server={"stream_interval_ms": 0},
                           cache={"persist_idle_s": 0.2, "idle_evict_s": 0.8, "restore_min_tokens": 0})
    db = tmp_path / "data" / "chatd.db"
    tracker = Tracker()
    tally = {"kills": 0, "moments": {"mid_reply": 0, "evicting": 0, "persisting": 0}, "acked_messages": 0,
             "lost": 0, "fresh_equal": 0, "unanswered_marked": 0}

    async def round_(num: int) -> None:
        async with connect(server.ws_url) as ws:
            assert (await _frame(ws))["type"] == "hello"
            if not tracker.acked:
                for _ in range(3):
                    created = await _request(ws, {"type": "session.create", "id": "c", "system": "Be brief."})
                    tracker.acked[created["session"]["session_id"]] = [("system", "Be brief.")]
            # After the restart: nothing acknowledged is lost.
            for sid in tracker.acked:
                resumed = await _request(ws, {"type": "session.resume", "id": "r", "session_id": sid})
                tally["lost"] += tracker.check(sid, resumed["messages"])
            # The next reply equals a fresh computation over the stored ids.
            sid = rng.choice(list(tracker.acked))
            done = await _turn(ws, tracker, sid, f"check {num}", {"temperature": 0, "max_tokens": GREEDY_TOKENS})
            assert done is not None
            ids = _stored_ids(db, sid)
            reply_ids = ids[-1]
            start, end = template.content_span("assistant", len(ids) - 1, reply_ids)
            prompt = template.conversation_ids(ids[:-1]) + list(reply_ids[:start])
            fresh = reference_greedy(reference_model, prompt, GREEDY_TOKENS, eos)
            content = list(reply_ids[start:end])
            assert fresh[:len(content)] == content, (num, fresh, content)
            assert len(content) == GREEDY_TOKENS or fresh[len(content)] in eos
            tally["fresh_equal"] += 1
            # Then a kill at a random moment.
            moment = rng.choice(["mid_reply", "evicting", "persisting"])
            target = rng.choice(list(tracker.acked))
            params = {"temperature": 1.0, "seed": num, "max_tokens": rng.randint(40, 200)}
            if moment == "mid_reply":
                await _turn(ws, tracker, target, f"message {num}", params, stop_after=rng.randint(1, 30))
            elif moment == "evicting":
                await _turn(ws, tracker, target, f"message {num}", params)
                async with httpx.AsyncClient(base_url=server.http_url, headers=server.admin_headers) as http:
                    others = [s for s in tracker.acked if s != target]
                    evicts = [asyncio.ensure_future(http.post(f"/admin/sessions/{s}/evict")) for s in others]
                    await asyncio.sleep(rng.uniform(0, 0.05))
                    server.kill()
                    await asyncio.gather(*evicts, return_exceptions=True)
            else:
                await _turn(ws, tracker, target, f"message {num}", params)
                await asyncio.sleep(rng.uniform(0.1, 1.2))  # background persistence and idle eviction run
            server.kill()
            tally["moments"][moment] += 1
            tally["kills"] += 1

    for num in range(kills):
        server.start()
        asyncio.run(round_(num))
    server.start()
    asyncio.run(_final_check(server, tracker, tally))
    server.stop()
    tally["acked_messages"] = sum(len(v) for v in tracker.acked.values())
    assert tally["lost"] == 0
    assert tally["kills"] == kills and tally["fresh_equal"] == kills
    figures("sigkill", **tally)


async def _final_check(server: ServerProcess, tracker: Tracker, tally: dict[str, Any]) -> None:
    async with connect(server.ws_url) as ws:
        assert (await _frame(ws))["type"] == "hello"
        for sid in tracker.acked:
            resumed = await _request(ws, {"type": "session.resume", "id": "r", "session_id": sid})
            tally["unanswered_marked"] += sum(bool(m.get("unanswered")) for m in resumed["messages"])
            tally["lost"] += tracker.check(sid, resumed["messages"])


def test_the_tracker_counts_a_lost_message() -> None:
    # The check above must be able to fail: a history missing an acknowledged reply counts as a loss.
    tracker = Tracker()
    tracker.acked["s"] = [("user", "a"), ("assistant", "b")]
    assert tracker.check("s", [{"role": "user", "content": "a"}]) == 1
    tracker.acked["s"] = [("user", "a")]
    tracker.in_flight["s"] = [("user", "c")]
    with pytest.raises(AssertionError):  # an unanswered user message that is not marked
        tracker.check("s", [{"role": "user", "content": "a"}, {"role": "user", "content": "c"}])
