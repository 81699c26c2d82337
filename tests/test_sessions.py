"""Session service behaviour with the tiny model: cancel, concurrency, limits, edits, errors."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from chatd.errors import BadRequest, Busy, ContextLengthExceeded, NotFound
from chatd.server.admin import render_stats
from chatd.service.core import Chatd
from chatd.service.types import EditResult, GenerationOptions, TurnResult


def greedy(n: int) -> GenerationOptions:
    return GenerationOptions(temperature=0, max_tokens=n)


async def test_cancel_mid_reply_keeps_partial_and_other_session_is_unaffected(tiny_core: Chatd) -> None:
    svc = tiny_core.sessions
    alone = await svc.create()
    reference = await svc.send(alone.session_id, "Tell me a story.", greedy(24)).wait()
    assert isinstance(reference, TurnResult)

    a = await svc.create()
    b_info = await svc.create()
    long_turn = svc.send(a.session_id, "Count to a thousand.", greedy(2000))
    other = svc.send(b_info.session_id, "Tell me a story.", greedy(24))
    pieces: list[str] = []
    async for piece in long_turn.stream():
        pieces.append(piece)
        if len(pieces) == 5:
            assert await svc.cancel(a.session_id)
    result = long_turn.result
    assert isinstance(result, TurnResult)
    assert result.finish_reason == "cancelled"
    assert 5 <= result.usage.output_tokens < 2000
    assert result.assistant_message.content == "".join(pieces)
    stored = await tiny_core.repo.get_messages(a.session_id)
    assert stored[-1].role == "assistant" and stored[-1].finish_reason == "cancelled"
    assert stored[-1].content == "".join(pieces)

    other_result = await other.wait()
    assert isinstance(other_result, TurnResult)
    assert other_result.assistant_message.content == reference.assistant_message.content
    assert other_result.finish_reason == reference.finish_reason

    # The cancelled session keeps working, and reuses its cache.
    follow = await svc.send(a.session_id, "Thanks.", greedy(4)).wait()
    assert isinstance(follow, TurnResult)
    assert follow.usage.cache_tier == "device" and follow.usage.cached_tokens > 0


async def test_concurrent_sessions_interleave_and_match_solo_runs(tiny_core: Chatd) -> None:
    svc = tiny_core.sessions
    prompts = ["First conversation.", "Second one, a bit longer than the first.", "Third."]
    solo = []
    for text in prompts:
        info = await svc.create()
        solo.append(await svc.send(info.session_id, text, greedy(20)).wait())
    sessions = [await svc.create() for _ in prompts]
    order: list[int] = []
    # The engine takes its first step only once all three generations are queued (each turn first
    # commits its user message, which may take longer than a whole reply on a busy machine).
    worker = tiny_core.worker
    real_step = worker._step
    deadline = time.monotonic() + 30

    def gated_step() -> None:
        if worker.num_active < len(prompts) and time.monotonic() < deadline:
            time.sleep(0.001)
            return
        real_step()

    worker._step = gated_step  # type: ignore[method-assign]

    async def run(i: int) -> TurnResult:
        turn = svc.send(sessions[i].session_id, prompts[i], greedy(20))
        async for _ in turn.stream():
            order.append(i)
        assert isinstance(turn.result, TurnResult)
        return turn.result

    results = await asyncio.gather(*(run(i) for i in range(len(prompts))))
    for got, want in zip(results, solo, strict=True):
        assert isinstance(want, TurnResult)
        assert got.assistant_message.content == want.assistant_message.content
    # Step-by-step interleaving: no session streams all its text before another starts.
    first_done = {i: max(k for k, j in enumerate(order) if j == i) for i in set(order)}
    first_start = {i: min(k for k, j in enumerate(order) if j == i) for i in set(order)}
    assert all(first_start[j] < first_done[i] for i in first_done for j in first_start if i != j)


async def test_model_runs_only_on_the_engine_thread(tiny_core: Chatd) -> None:
    seen: set[str] = set()
    runner = tiny_core.runner
    original_step = runner.step

    def step(*args: object, **kwargs: object) -> object:
        seen.add(threading.current_thread().name)
        return original_step(*args, **kwargs)  # type: ignore[arg-type]

    runner.step = step  # type: ignore[method-assign]
    try:
        info = await tiny_core.sessions.create()
        await tiny_core.sessions.send(info.session_id, "Hello", greedy(5)).wait()
    finally:
        runner.step = original_step  # type: ignore[method-assign]
    assert seen == {"chatd-engine"}


async def test_context_overflow_is_refused_before_any_work(make_settings, tiny_dir, tiny_runner) -> None:  # type: ignore[no-untyped-def]
    settings = make_settings(tiny_dir, model={"max_context": 96})
    async with Chatd.open(settings, runner=tiny_runner, background=False) as core:
        svc = core.sessions
        info = await svc.create()
        ok = await svc.send(info.session_id, "Hi", greedy(8)).wait()
        assert isinstance(ok, TurnResult)
        before = await core.repo.get_messages(info.session_id)
        with pytest.raises(ContextLengthExceeded):
            await svc.send(info.session_id, "word " * 200, greedy(8)).wait()
        with pytest.raises(ContextLengthExceeded):
            await svc.send(info.session_id, "Hi again", greedy(500)).wait()
        assert await core.repo.get_messages(info.session_id) == before  # nothing committed
        # Without an explicit max_tokens the reply is limited to what the context has left.
        last = await svc.send(info.session_id, "Hi again", GenerationOptions(temperature=0)).wait()
        assert isinstance(last, TurnResult)
        assert last.usage.input_tokens + last.usage.output_tokens <= 96


async def test_busy_while_generating(tiny_core: Chatd) -> None:
    svc = tiny_core.sessions
    info = await svc.create()
    turn = svc.send(info.session_id, "A long answer please", greedy(200))
    with pytest.raises(Busy):
        svc.send(info.session_id, "again", greedy(4))
    with pytest.raises(Busy):
        svc.edit(info.session_id, 0, "edit", greedy(4))
    await svc.cancel(info.session_id)
    await turn.wait()
    await svc.send(info.session_id, "now it works", greedy(3)).wait()


async def test_bad_input_changes_nothing(tiny_core: Chatd) -> None:
    svc = tiny_core.sessions
    with pytest.raises(NotFound):
        await svc.send("does-not-exist-000000", "hi", greedy(3)).wait()
    info = await svc.create()
    with pytest.raises(BadRequest):
        await svc.send(info.session_id, "   ", greedy(3)).wait()
    with pytest.raises(BadRequest):
        await svc.edit(info.session_id, 0, "no messages yet", greedy(3)).wait()
    assert await tiny_core.repo.get_messages(info.session_id) == []


async def test_text_that_is_not_valid_unicode_is_a_bad_request_and_leaves_nothing_behind(
        tiny_core: Chatd, caplog: pytest.LogCaptureFixture) -> None:
    # Python callers reach the service without the wire's parser: a lone surrogate must still be refused
    # before anything is stored (the tokenizer and the store cannot encode it).
    svc = tiny_core.sessions
    num_sessions = await tiny_core.repo.count_sessions()
    for fields in ({"system": "be \ud800 terse"}, {"title": "\udc00"}, {"system": "fine", "title": "t\udfff"}):
        with pytest.raises(BadRequest, match="Unicode"):
            await svc.create(**fields)
    assert await tiny_core.repo.count_sessions() == num_sessions
    info = await svc.create(system="You are terse.")
    messages = await tiny_core.repo.get_messages(info.session_id)
    for content in ("hi \ud83d", "\udfff"):
        with pytest.raises(BadRequest, match="Unicode"):
            await svc.send(info.session_id, content, greedy(3)).wait()
        with pytest.raises(BadRequest, match="Unicode"):
            await svc.edit(info.session_id, 0, content, greedy(3)).wait()
    assert await tiny_core.repo.get_messages(info.session_id) == messages
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    # A character outside the BMP (a surrogate pair in JSON or UTF-16) is fine.
    done = await svc.send(info.session_id, "smile \U0001F600", greedy(2)).wait()
    assert isinstance(done, TurnResult) and done.user_message.content == "smile \U0001F600"


async def test_edit_assistant_message_generates_nothing_and_next_turn_reuses_prefix(tiny_core: Chatd) -> None:
    svc = tiny_core.sessions
    info = await svc.create(system="Be brief.")
    await svc.send(info.session_id, "Hello", greedy(6)).wait()
    await svc.send(info.session_id, "More", greedy(6)).wait()
    before = await tiny_core.repo.get_messages(info.session_id)
    result = await svc.edit(info.session_id, 2, "Hi! (edited)", greedy(6)).wait()
    assert isinstance(result, EditResult)
    assert result.message.content == "Hi! (edited)" and result.message.role == "assistant"
    after = await tiny_core.repo.get_messages(info.session_id)
    assert len(after) == 3 and after[2].content == "Hi! (edited)"
    header = len(tiny_core.sessions.template.generation_prompt_ids)
    prefix = sum(len(m.token_ids) for m in before[:2])
    assert result.invalidated_from >= prefix + header
    turn = await svc.send(info.session_id, "Next", greedy(4)).wait()
    assert isinstance(turn, TurnResult)
    # The cache is cut exactly where the edited reply starts to differ.
    assert turn.usage.cached_tokens == result.invalidated_from


async def test_seeded_sampling_is_reproducible(tiny_core: Chatd) -> None:
    svc = tiny_core.sessions
    params = GenerationOptions(temperature=1.0, top_p=0.9, top_k=40, seed=7, max_tokens=12)
    outs = []
    for _ in range(2):
        info = await svc.create()
        result = await svc.send(info.session_id, "Say something", params).wait()
        assert isinstance(result, TurnResult)
        outs.append(result.assistant_message.content)
    assert outs[0] == outs[1]


async def test_stop_string_truncates_and_stores_matching_ids(tiny_core: Chatd) -> None:
    svc = tiny_core.sessions
    info = await svc.create()
    free = await svc.send(info.session_id, "Go", greedy(30)).wait()
    assert isinstance(free, TurnResult)
    text = free.assistant_message.content
    assert len(text) > 6
    stop = text[4:7]
    info2 = await svc.create()
    stopped = await svc.send(info2.session_id, "Go", GenerationOptions(temperature=0, max_tokens=30,
                                                                       stop=[stop])).wait()
    assert isinstance(stopped, TurnResult)
    assert stopped.finish_reason == "stop"
    assert stopped.assistant_message.content == text[: text.find(stop)]
    stored = (await tiny_core.repo.get_messages(info2.session_id))[-1]
    template = tiny_core.sessions.template
    start, end = template.content_span("assistant", stored.index, stored.token_ids)
    decoded = tiny_core.runner.tokenizer.decode(list(stored.token_ids[start:end]), skip_special_tokens=True)
    assert decoded == stopped.assistant_message.content


SHARED_SYSTEM = "You are a meticulous assistant who answers in full sentences. " * 6


async def test_a_new_session_starts_from_another_sessions_resident_prefix(tiny_core: Chatd) -> None:
    svc = tiny_core.sessions
    system_tokens = len(svc.template.message_ids("system", SHARED_SYSTEM, 0))
    a = await svc.create(system=SHARED_SYSTEM)
    first = await svc.send(a.session_id, "Hello", greedy(8)).wait()
    b = await svc.create(system=SHARED_SYSTEM)
    shared = await svc.send(b.session_id, "Hello", greedy(8)).wait()
    assert isinstance(first, TurnResult) and isinstance(shared, TurnResult)
    assert first.usage.cached_tokens == 0
    assert shared.usage.cache_tier == "device" and shared.usage.cached_tokens >= system_tokens
    assert shared.usage.cached_tokens + shared.usage.prefill_tokens == shared.usage.input_tokens
    assert tiny_core.counters.num_prefix_shares == 1
    assert tiny_core.counters.num_prefix_shared_tokens == shared.usage.cached_tokens
    assert render_stats(await tiny_core.stats())["prefix_shared_tokens"] == shared.usage.cached_tokens
    # With nothing resident to share, the same conversation computed from scratch gives the same reply.
    await tiny_core.kv.drop(a.session_id)
    await tiny_core.kv.drop(b.session_id)
    c = await svc.create(system=SHARED_SYSTEM)
    fresh = await svc.send(c.session_id, "Hello", greedy(8)).wait()
    assert isinstance(fresh, TurnResult) and fresh.usage.cached_tokens == 0
    assert shared.assistant_message.content == fresh.assistant_message.content
    # Editing the shared part of one session leaves the other's cache alone: its next turn equals a
    # recomputation of its own history.
    d = await svc.create(system=SHARED_SYSTEM)
    await svc.send(d.session_id, "Hello", greedy(8)).wait()
    edited = await svc.edit(d.session_id, 0, "Answer in French. " + SHARED_SYSTEM, greedy(8)).wait()
    assert isinstance(edited, EditResult)
    kept = await svc.send(c.session_id, "And then?", greedy(8)).wait()
    assert isinstance(kept, TurnResult) and kept.usage.cache_tier == "device"
    await tiny_core.kv.drop(c.session_id)
    await tiny_core.kv.drop(d.session_id)  # its cache still holds (valid) K/V of the old system prompt
    redo = await svc.edit(c.session_id, kept.user_message.index, "And then?", greedy(8)).wait()
    assert isinstance(redo, TurnResult) and redo.usage.cached_tokens == 0
    assert redo.assistant_message.content == kept.assistant_message.content


async def test_prefix_sharing_can_be_turned_off(make_settings, tiny_dir, tiny_runner) -> None:  # type: ignore[no-untyped-def]
    settings = make_settings(tiny_dir, cache={"share_prefixes": False})
    async with Chatd.open(settings, runner=tiny_runner, background=False) as core:
        for _ in range(2):
            info = await core.sessions.create(system=SHARED_SYSTEM)
            result = await core.sessions.send(info.session_id, "Hello", greedy(4)).wait()
            assert isinstance(result, TurnResult) and result.usage.cached_tokens == 0
        assert core.counters.num_prefix_shares == 0
