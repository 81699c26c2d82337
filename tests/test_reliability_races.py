"""Reliability suite: races between a running generation and other changes to the same session.

Each round runs four scenarios over real websocket clients and the admin API of a real uvicorn:
- edit during generation: the edit gets ``busy``, the reply completes, an edit afterwards works;
- evict during generation gets 409 ``busy``; delete during generation cancels it and removes everything;
- two senders on one session: exactly one gets ``busy``, exactly one turn is stored;
- double resume of an evicted session: both answers agree, and the next turn continues from the cache.
A wrong state is any deviation; CI runs 4 rounds (16 races), ``--long`` 16 (64).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from chatd.client import ChatClient, ChatError
from chatd.config import Settings
from chatd.engine.model.runner import ModelRunner
from chatd.protocol import MessageDone
from tests.support import InProcessServer

LONG = 300  # tokens: long enough that the other request lands while it runs


@pytest.fixture
def served(make_settings: Callable[..., Settings], tiny_dir: Path, tiny_runner: ModelRunner) -> Iterator[
        InProcessServer]:
    with InProcessServer(make_settings(tiny_dir, cache={"restore_min_tokens": 0}), tiny_runner) as server:
        yield server


async def _outcome(coro: object) -> str:
    try:
        result = await coro  # type: ignore[misc]
    except ChatError as exc:
        return exc.code
    return str(getattr(result, "type", "ok"))


async def edit_during_generation(a: ChatClient, b: ChatClient, http: httpx.AsyncClient) -> list[str]:
    sid = (await a.create_session()).session_id
    reply = await a.send(sid, "tell me a long story", max_tokens=LONG, temperature=1.0, seed=1)
    async for _ in reply:
        break  # generating now
    edit = await _outcome((await b.edit(sid, 0, "changed my mind", max_tokens=4)).result())
    done = await reply.result()
    wrong = []
    if edit != "busy":
        wrong.append(f"edit during generation answered {edit}")
    if not isinstance(done, MessageDone) or done.finish_reason != "length":
        wrong.append(f"the reply ended {done}")
    after = await _outcome((await b.edit(sid, 0, "changed my mind", max_tokens=4)).result())
    _, messages = await b.resume(sid)
    if after != "message.done" or [m.content for m in messages][:1] != ["changed my mind"] or len(messages) != 2:
        wrong.append(f"edit afterwards: {after}, {[m.content for m in messages]}")
    return wrong


async def evict_or_delete_during_generation(a: ChatClient, b: ChatClient, http: httpx.AsyncClient) -> list[str]:
    wrong = []
    sid = (await a.create_session()).session_id
    reply = await a.send(sid, "keep going", max_tokens=LONG)
    async for _ in reply:
        break
    evicted = await http.post(f"/admin/sessions/{sid}/evict")
    if evicted.status_code != 409 or evicted.json()["error"]["code"] != "busy":
        wrong.append(f"evict during generation: {evicted.status_code}")
    await reply.result()
    gone = (await a.create_session()).session_id
    reply = await a.send(gone, "keep going", max_tokens=LONG)
    async for _ in reply:
        break
    deleted = await http.delete(f"/admin/sessions/{gone}")
    ended = await _outcome(reply.result())
    if deleted.status_code != 204:
        wrong.append(f"delete during generation: {deleted.status_code}")
    if ended not in ("message.done", "not_found"):
        wrong.append(f"the deleted session's reply ended {ended}")
    if await _outcome(b.resume(gone)) != "not_found":
        wrong.append("the deleted session is still there")
    if (await http.get(f"/admin/sessions/{gone}")).status_code != 404:
        wrong.append("the admin API still shows the deleted session")
    return wrong


async def two_senders(a: ChatClient, b: ChatClient, http: httpx.AsyncClient) -> list[str]:
    sid = (await a.create_session()).session_id
    first, second = await asyncio.gather(a.send(sid, "from a", max_tokens=40), b.send(sid, "from b", max_tokens=40))
    outcomes = sorted(await asyncio.gather(_outcome(first.result()), _outcome(second.result())))
    _, messages = await a.resume(sid)
    wrong = []
    if outcomes != ["busy", "message.done"]:
        wrong.append(f"two senders: {outcomes}")
    if [m.role for m in messages] != ["user", "assistant"]:
        wrong.append(f"two senders stored {[m.role for m in messages]}")
    return wrong


async def double_resume(a: ChatClient, b: ChatClient, http: httpx.AsyncClient) -> list[str]:
    sid = (await a.create_session(system="Be brief.")).session_id
    first = await (await a.send(sid, "remember me " * 10, max_tokens=30, temperature=0)).result()
    assert isinstance(first, MessageDone)
    wrong = []
    if not (await http.post(f"/admin/sessions/{sid}/evict")).json()["done"]:
        wrong.append("evict failed")
    (_, one), (_, two) = await asyncio.gather(a.resume(sid), b.resume(sid))
    if [m.model_dump() for m in one] != [m.model_dump() for m in two]:
        wrong.append("the two resumes disagree")
    done = await (await b.send(sid, "still there?", max_tokens=8, temperature=0)).result()
    assert isinstance(done, MessageDone)
    expected_cached = first.usage.input_tokens + first.usage.output_tokens - 1
    if done.usage.cache_tier not in ("disk", "device") or done.usage.cached_tokens != expected_cached:
        wrong.append(f"after a double resume: {done.usage}")
    return wrong


SCENARIOS = [edit_during_generation, evict_or_delete_during_generation, two_senders, double_resume]


async def test_races_leave_no_wrong_state(served: InProcessServer, long_mode: bool,
                                          figures: Callable[..., None]) -> None:
    rounds = 16 if long_mode else 4
    wrong: list[str] = []
    async with await ChatClient.connect(served.ws_url) as a, await ChatClient.connect(served.ws_url) as b, \
            httpx.AsyncClient(base_url=served.http_url, headers=served.admin_headers, timeout=60) as http:
        for _ in range(rounds):
            for scenario in SCENARIOS:
                wrong += [f"{scenario.__name__}: {problem}" for problem in await scenario(a, b, http)]
    core = served.core
    assert not core.sessions.num_generating
    assert wrong == []
    figures("races", rounds=rounds, races=rounds * len(SCENARIOS), wrong_states=len(wrong))
