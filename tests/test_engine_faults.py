"""One job's failure stays that job's: the engine thread keeps serving every other session.

Reliability issue, bug 1: a temperature of 1e-40 made fp32 logits overflow in ``sample()``, the error
escaped the engine thread, and no session got a reply again.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from chatd.config import GenerationSettings
from chatd.engine import worker as worker_module
from chatd.engine.model.runner import ModelRunner
from chatd.engine.model.sampling import SamplingError, SamplingParams, make_generator, sample
from chatd.engine.scheduler import WIDE_STEP_ROWS
from chatd.engine.worker import EngineWorker, GenerationResult, TextPiece
from chatd.errors import ChatdError, Internal
from chatd.server.app import create_app
from chatd.service.core import Chatd
from chatd.service.types import GenerationOptions, TurnResult


def test_tiny_temperatures_resolve_to_greedy() -> None:
    defaults = GenerationSettings(max_tokens=8, temperature=0.7, top_p=1.0, top_k=0)
    for tiny in (1e-40, 1e-10, 9.9e-4):
        assert SamplingParams.resolve(GenerationOptions(temperature=tiny), defaults).greedy
    assert not SamplingParams.resolve(GenerationOptions(temperature=1e-3), defaults).greedy


def test_sampling_at_any_positive_temperature_never_overflows() -> None:
    logits = torch.tensor([10.0, 80.0, 79.5, -30.0])
    for temperature in (1e-40, 1e-6, 1e-3, 5.0):
        params = SamplingParams(max_tokens=1, temperature=temperature, top_p=0.9, top_k=3, seed=5)
        token = sample(logits, params, make_generator(params))
        assert token in (1, 2)
        if temperature < 1e-3:
            assert token == 1


def test_non_finite_logits_raise_a_sampling_error() -> None:
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=1)
    with pytest.raises(SamplingError):
        sample(torch.tensor([0.0, float("nan"), 1.0]), params, make_generator(params))


async def test_tiny_temperature_turn_completes_and_others_keep_streaming(tiny_core: Chatd) -> None:
    svc = tiny_core.sessions
    a, b = await svc.create(), await svc.create()
    long_turn = svc.send(b.session_id, "Count slowly.", GenerationOptions(temperature=0, max_tokens=40))
    tiny = await svc.send(a.session_id, "Hello", GenerationOptions(temperature=1e-40, max_tokens=2)).wait()
    assert isinstance(tiny, TurnResult) and tiny.usage.output_tokens == 2
    other = await long_turn.wait()
    assert isinstance(other, TurnResult) and other.usage.output_tokens == 40
    assert tiny_core.worker.alive


async def test_a_failing_row_fails_only_its_own_turn(tiny_core: Chatd, monkeypatch: pytest.MonkeyPatch) -> None:
    real_sample_rows = worker_module.sample_rows

    def faulty(logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None]) -> list[int | SamplingError]:
        picks = real_sample_rows(logits, params, generators)
        return [SamplingError("injected") if p.seed == 13 and p.max_tokens == 30 else pick
                for p, pick in zip(params, picks, strict=True)]

    monkeypatch.setattr(worker_module, "sample_rows", faulty)
    svc = tiny_core.sessions
    good_info, bad_info = await svc.create(), await svc.create()
    good = svc.send(good_info.session_id, "Keep going.", GenerationOptions(temperature=0, max_tokens=30))
    bad = svc.send(bad_info.session_id, "Fail me.", GenerationOptions(temperature=1.0, seed=13, max_tokens=30))
    with pytest.raises(ChatdError) as failure:
        await bad.wait()
    assert failure.value.code == "internal"
    result = await good.wait()
    assert isinstance(result, TurnResult) and result.usage.output_tokens == 30
    # The failed session is usable again.
    again = await svc.send(bad_info.session_id, "Again.", GenerationOptions(temperature=0, max_tokens=3)).wait()
    assert isinstance(again, TurnResult)


async def test_a_dead_engine_fails_everything_promptly(tiny_core: Chatd) -> None:
    worker = tiny_core.worker

    def broken_step() -> None:
        raise RuntimeError("injected worker bug")

    worker._step = broken_step  # type: ignore[method-assign]
    svc = tiny_core.sessions
    info = await svc.create()
    with pytest.raises(ChatdError):
        await asyncio.wait_for(svc.send(info.session_id, "Hi", GenerationOptions(max_tokens=3)).wait(), 30)
    assert not worker.alive and isinstance(worker.failure, RuntimeError)
    with pytest.raises(Internal):
        await asyncio.wait_for(worker.call(lambda: 1), 5)
    # A new turn after the death fails at once instead of hanging.
    with pytest.raises(ChatdError):
        await asyncio.wait_for(svc.send(info.session_id, "Hi", GenerationOptions(max_tokens=3)).wait(), 5)
    # tiny_core's exit (shutdown) must complete too: the fixture's teardown checks it.


def test_healthz_reports_a_dead_engine(make_settings, tiny_dir, tiny_runner) -> None:  # type: ignore[no-untyped-def]
    app = create_app(make_settings(tiny_dir), runner=tiny_runner)
    with TestClient(app, base_url="http://127.0.0.1") as http:  # a Host the default allow-list accepts
        assert http.get("/healthz").status_code == 200
        core: Chatd = app.state.core

        def broken_step() -> None:
            raise RuntimeError("injected worker bug")

        core.worker._step = broken_step  # type: ignore[method-assign]
        core.worker._wake()
        for _ in range(100):
            if not core.worker.alive:
                break
            http.portal.call(asyncio.sleep, 0.05)  # type: ignore[union-attr]
        health = http.get("/healthz")
        assert health.status_code == 503 and health.json()["status"] == "engine_stopped"


async def test_small_steps_run_on_the_decode_thread_count(tiny_runner: ModelRunner,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # A step with a prompt chunk (WIDE_STEP_ROWS tokens or more) takes every thread; decode steps take
    # decode_threads.
    seen: dict[str, set[int]] = {"wide": set(), "small": set()}
    real_step = tiny_runner.step

    def step(caches: Any, runs: Any) -> torch.Tensor:
        seen["wide" if sum(map(len, runs)) >= WIDE_STEP_ROWS else "small"].add(torch.get_num_threads())
        return real_step(caches, runs)

    monkeypatch.setattr(tiny_runner, "step", step)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert EngineWorker(tiny_runner).decode_threads == 2  # 0 (auto): as many as prefill's
        worker = EngineWorker(tiny_runner, decode_threads=1)
        assert (worker.prefill_threads, worker.decode_threads) == (2, 1)
        worker.start()
        try:
            prompt = list(range(1, WIDE_STEP_ROWS + 5))
            handle = worker.generate(tiny_runner.new_cache(), prompt, SamplingParams(max_tokens=4))
            events = [event async for event in handle.events()]
            assert isinstance(events[-1], GenerationResult) and len(events[-1].generated_ids) == 4
        finally:
            worker.stop()
    finally:
        torch.set_num_threads(before)
    assert seen == {"wide": {2}, "small": {1}}


async def test_a_prompt_whose_rest_is_a_little_over_the_step_budget_finishes_in_that_step(
        tiny_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step takes up to ``prefill_chunk_tokens`` prompt tokens, but a prompt whose rest exceeds what is left by
    at most PREFILL_SLACK of the budget goes in whole (its first token a step sooner); a longer rest is split
    at the budget as before."""
    steps: list[list[int]] = []
    real_step = tiny_runner.step

    def step(caches: Any, runs: Any) -> torch.Tensor:
        steps.append([len(run) for run in runs])
        return real_step(caches, runs)

    monkeypatch.setattr(tiny_runner, "step", step)
    worker = EngineWorker(tiny_runner, prefill_chunk_tokens=64)  # a slack of 8 tokens
    worker.start()
    try:
        async def run(lengths: list[int]) -> None:
            gate = threading.Event()
            worker.submit(lambda: gate.wait(30))  # all the prompts are queued before the next step
            handles = [worker.generate(tiny_runner.new_cache(), [(5 * i + j) % 200 + 10 for j in range(n)],
                                       SamplingParams(max_tokens=1)) for i, n in enumerate(lengths)]
            gate.set()
            for handle in handles:
                events = [event async for event in handle.events()]
                assert isinstance(events[-1], GenerationResult)

        await run([30, 30, 12])  # 72 = 64 + 8: one step
        await run([30, 30, 13])  # 73: the last prompt's 4 over the slack wait for the next step
        await run([70])
        await run([73])
    finally:
        worker.stop()
    assert steps == [[30, 30, 12], [30, 30, 4], [9], [70], [64], [9]]


async def test_a_steps_events_reach_the_loop_in_one_call(tiny_runner: ModelRunner,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every event the engine emits during a step (a text piece per session, a result where one ends) is
    sent to the event loop in one ``call_soon_threadsafe``, in order, not one wake-up per session."""
    loop = asyncio.get_running_loop()
    calls: list[object] = []
    real = loop.call_soon_threadsafe

    def counted(callback: Any, *args: Any) -> Any:
        calls.append(callback)
        return real(callback, *args)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counted)
    steps = []
    real_step = tiny_runner.step

    def step(caches: Any, runs: Any) -> torch.Tensor:
        steps.append(len(runs))
        return real_step(caches, runs)

    monkeypatch.setattr(tiny_runner, "step", step)
    worker = EngineWorker(tiny_runner)
    worker.start()
    try:
        caches = [tiny_runner.new_cache() for _ in range(4)]
        handles = [worker.generate(cache, [5, 6, 7 + i], SamplingParams(max_tokens=6, temperature=0.0))
                   for i, cache in enumerate(caches)]
        results = [[event async for event in handle.events()] for handle in handles]
    finally:
        worker.stop()
    for events in results:
        assert isinstance(events[-1], GenerationResult) and len(events[-1].generated_ids) == 6
        assert "".join(e.text for e in events[:-1] if isinstance(e, worker_module.TextPiece)) == events[-1].text
    # 4 sessions x 6 tokens = 24 pieces and 4 results, at most one delivery per step
    assert sum(1 for callback in calls if callback is worker_module._deliver) <= len(steps) < 24


async def test_the_engines_deliveries_keep_their_order_and_end_with_it(tiny_runner: ModelRunner) -> None:
    """The engine thread hands its deliveries to the event loop (call results, generation events) to its
    courier thread, which makes them in the order they were handed over; stopping the worker ends both."""
    before = set(threading.enumerate())
    worker = EngineWorker(tiny_runner)
    worker.start()
    started = [thread for thread in threading.enumerate() if thread not in before]
    assert {thread.name for thread in started} == {"chatd-engine", "chatd-engine-courier"}
    settled: list[int] = []
    try:
        handle = worker.generate(tiny_runner.new_cache(), [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0))
        futures = [worker.submit(lambda i=i: i) for i in range(50)]
        for future in futures:
            future.add_done_callback(lambda done: settled.append(done.result()))
        await asyncio.gather(*futures)
        events = [event async for event in handle.events()]
    finally:
        assert worker.stop()
    assert settled == list(range(50))
    assert isinstance(events[-1], GenerationResult) and len(events[-1].generated_ids) == 4
    assert not [thread for thread in started if thread.is_alive()]


async def test_text_pieces_are_sent_at_most_once_per_stream_interval(tiny_runner: ModelRunner) -> None:
    """The first piece of a generation goes at once; text decoded within ``stream_interval_s`` of the last piece
    sent waits and goes with the next one (or with the end), so the pieces joined are the whole text either way.
    With no interval every decoded piece is a piece of its own."""
    prompt = list(tiny_runner.tokenizer("Once upon a time, in a lighthouse by the sea,").input_ids)
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=11)

    async def pieces(interval: float) -> tuple[list[str], str]:
        worker = EngineWorker(tiny_runner, stream_interval_s=interval)
        worker.start()
        try:
            cache = tiny_runner.new_cache()
            handle = worker.generate(cache, prompt, params)
            events = [event async for event in handle.events()]
            cache.free()
        finally:
            worker.stop()
        result = events[-1]
        assert isinstance(result, GenerationResult)
        texts = [event.text for event in events if isinstance(event, TextPiece)]
        return texts, result.text

    every, text = await pieces(0.0)
    assert len(every) > 2 and "".join(every) == text  # the tiny model decodes a piece for most tokens
    coalesced, same_text = await pieces(3600.0)
    assert same_text == text
    assert coalesced == [every[0], "".join(every[1:])]  # the first at once, the rest with the end
