"""A reply that cannot be stored (reliability issue, bug 7).

The database disk filled up during a reply: 40 tokens were streamed, then ``internal``, and the history
ended on an unanswered user message that nothing marked. Now the commit is retried a bounded number of
times, the client is told ``reply_not_saved``, and the user message stays marked ``unanswered`` so the next
turn (and every reader of the history) can tell.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.exc import OperationalError

from chatd.client import ChatClient, ChatError
from chatd.config import Settings
from chatd.engine.model.runner import ModelRunner
from chatd.errors import ReplyNotSaved
from chatd.server import wiremap
from chatd.service import turns as turns_module
from chatd.service.core import Chatd
from chatd.service.types import GenerationOptions, TurnResult
from chatd.store.repo import Repo
from tests.support import InProcessServer


def disk_full() -> OperationalError:
    """What SQLAlchemy raises when SQLite cannot grow the database (SQLITE_FULL)."""
    return OperationalError("INSERT INTO messages ...", {}, sqlite3.OperationalError("database or disk is full"))


class FailingReplies:
    """Wraps ``Repo.append_message``: the next ``failures`` assistant appends raise a full-disk error."""

    def __init__(self, repo: Repo, failures: int) -> None:
        self.real = repo.append_message
        self.failures = failures
        self.attempts = 0

    async def __call__(self, session_id: str, role: str, *args: Any, **kwargs: Any) -> Any:
        if role == "assistant":
            self.attempts += 1
            if self.failures > 0:
                self.failures -= 1
                raise disk_full()
        return await self.real(session_id, role, *args, **kwargs)


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turns_module, "REPLY_COMMIT_DELAYS_S", (0.01, 0.01, 0.01))


PARAMS = GenerationOptions(temperature=0, max_tokens=8)


async def test_a_reply_that_cannot_be_stored_is_reported_and_its_user_message_marked(
        tiny_core: Chatd, monkeypatch: pytest.MonkeyPatch) -> None:
    svc = tiny_core.sessions
    sid = (await svc.create(system="Be brief.")).session_id
    failing = FailingReplies(tiny_core.repo, failures=100)
    monkeypatch.setattr(tiny_core.repo, "append_message", failing)
    turn = svc.send(sid, "Hello", PARAMS)
    pieces: list[str] = []
    with pytest.raises(ReplyNotSaved) as raised:
        async for piece in turn.stream():
            pieces.append(piece)
    assert raised.value.code == "reply_not_saved" and raised.value.http_status == 503
    assert pieces  # the reply was generated and streamed before the store refused it
    assert failing.attempts == len(turns_module.REPLY_COMMIT_DELAYS_S) + 1  # retried, bounded
    assert not svc.is_generating(sid)

    monkeypatch.setattr(tiny_core.repo, "append_message", failing.real)
    stored = await tiny_core.repo.get_messages(sid)
    assert [(m.role, m.unanswered) for m in stored] == [("system", False), ("user", True)]
    _, resumed = await svc.resume(sid)
    assert resumed[-1].unanswered is True and resumed[-1].content == "Hello"
    assert '"unanswered":true' in wiremap.message(resumed[-1]).model_dump_json(exclude_none=True)

    # The next turn sees the marked message, and its own reply is stored and answered.
    result = await svc.send(sid, "Are you there?", PARAMS).wait()
    assert isinstance(result, TurnResult)
    stored = await tiny_core.repo.get_messages(sid)
    assert [(m.role, m.unanswered) for m in stored] == [
        ("system", False), ("user", True), ("user", False), ("assistant", False)]
    # Retrying the lost one: an edit of it with the same content generates its reply and clears the mark.
    again = await svc.edit(sid, 1, "Hello", PARAMS).wait()
    assert isinstance(again, TurnResult) and again.assistant_message.index == 2
    stored = await tiny_core.repo.get_messages(sid)
    assert [(m.role, m.unanswered) for m in stored] == [("system", False), ("user", False), ("assistant", False)]


async def test_a_store_that_recovers_within_the_retries_loses_nothing(
        tiny_core: Chatd, monkeypatch: pytest.MonkeyPatch) -> None:
    svc = tiny_core.sessions
    sid = (await svc.create()).session_id
    failing = FailingReplies(tiny_core.repo, failures=2)
    monkeypatch.setattr(tiny_core.repo, "append_message", failing)
    result = await svc.send(sid, "Hello", PARAMS).wait()
    assert isinstance(result, TurnResult) and failing.attempts == 3
    stored = await tiny_core.repo.get_messages(sid)
    assert [(m.role, m.unanswered) for m in stored] == [("user", False), ("assistant", False)]
    assert stored[-1].content == result.assistant_message.content


async def test_a_failed_engine_leaves_the_user_message_marked(tiny_core: Chatd,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    svc = tiny_core.sessions
    sid = (await svc.create()).session_id

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected generation failure")

    monkeypatch.setattr(tiny_core.worker, "generate", broken)
    with pytest.raises(Exception):  # noqa: B017 - the kind is the service's business; the mark is checked
        await svc.send(sid, "Hello", PARAMS).wait()
    stored = await tiny_core.repo.get_messages(sid)
    assert [(m.role, m.unanswered) for m in stored] == [("user", True)]


async def test_a_turn_the_engine_refuses_ends_only_after_its_message_is_stored(
        tiny_core: Chatd, monkeypatch: pytest.MonkeyPatch) -> None:
    # The user message's commit runs alongside the cache's preparation; when the engine then refuses the
    # job at once, the turn's failure must not be reported while the commit is still on its way.
    svc = tiny_core.sessions
    sid = (await svc.create()).session_id
    real_append = tiny_core.repo.append_message

    async def slow_append(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.3)
        return await real_append(*args, **kwargs)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected generation failure")

    monkeypatch.setattr(tiny_core.repo, "append_message", slow_append)
    monkeypatch.setattr(tiny_core.worker, "generate", broken)
    with pytest.raises(Exception):  # noqa: B017 - the kind is the service's business; the mark is checked
        await svc.send(sid, "Hello", PARAMS).wait()
    stored = await tiny_core.repo.get_messages(sid)
    assert [(m.role, m.unanswered) for m in stored] == [("user", True)]


# ----------------------------------------------------------------------------- over a real server


@pytest.fixture
def served(make_settings: Callable[..., Settings], tiny_dir: Path, tiny_runner: ModelRunner) -> Iterator[
        InProcessServer]:
    with InProcessServer(make_settings(tiny_dir), tiny_runner) as server:
        yield server


async def test_over_a_real_server_the_client_is_told_the_reply_was_not_saved(served: InProcessServer) -> None:
    failing = FailingReplies(served.core.repo, failures=100)
    served.core.repo.append_message = failing  # type: ignore[method-assign]
    async with await ChatClient.connect(served.ws_url) as client:
        session = await client.create_session()
        reply = await client.send(session.session_id, "Hello", max_tokens=8, temperature=0)
        with pytest.raises(ChatError) as raised:
            await asyncio.wait_for(reply.result(), 60)
        assert raised.value.code == "reply_not_saved"
        assert reply.text  # the tokens had streamed
        served.core.repo.append_message = failing.real  # type: ignore[method-assign]
        _, messages = await client.resume(session.session_id)
        assert [(m.role, m.unanswered) for m in messages] == [("user", True)]
        # The connection stays usable and the next turn is stored.
        done = await (await client.send(session.session_id, "Again", max_tokens=4, temperature=0)).result()
        assert done.type == "message.done"
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{served.port}") as http:
        token = served.app.state.admin_token
        detail = (await http.get(f"/admin/sessions/{session.session_id}",
                                 headers={"Authorization": f"Bearer {token}"})).json()
    assert [m.get("unanswered") for m in detail["messages"]] == [True, None, None]
