"""The paged KV pool under the engine and the KV manager: attention over runs of blocks, decoding over
fragmented block tables, prefix sharing by reference, and the pool's accounting through eviction and
deletion."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from chatd.config import Settings
from chatd.engine.model.runner import ModelRunner
from chatd.engine.pool.free_blocks import block_runs
from chatd.engine.pool.kvcache import KVPool, SessionKV, any_layer_kv, attend
from chatd.kv import manager as manager_module
from chatd.service.core import Chatd
from chatd.service.types import GenerationOptions, TurnResult
from tests.support import reference_greedy

SYSTEM = "You are a meticulous assistant who answers in full sentences and checks every step twice. " * 5


def greedy(n: int) -> GenerationOptions:
    return GenerationOptions(max_tokens=n, temperature=0)


# ----------------------------------------------------------------------------- attention over runs


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new", [1, 9])
@pytest.mark.parametrize("lengths", [[48, 16, 37], [48, 20, 5]])  # the 9-token chunk spans runs in the second
def test_attention_over_several_runs_equals_one_contiguous_call(kv_dtype: torch.dtype, new: int,
                                                                lengths: list[int]) -> None:
    gen = torch.Generator().manual_seed(1)
    kv_heads, group, head_dim = 3, 3, 64
    total = sum(lengths)
    keys = torch.randn(1, kv_heads, total, head_dim, generator=gen).to(kv_dtype)
    values = torch.randn(1, kv_heads, total, head_dim, generator=gen).to(kv_dtype)
    query = torch.randn(1, kv_heads, group * new, head_dim, generator=gen)
    # A chunk of `new` tokens at the end: token j sees positions <= total - new + j.
    mask = None if new == 1 else (torch.ones(new, total, dtype=torch.bool).tril(total - new).repeat(group, 1))
    runs, start = [], 0
    for n in lengths:
        runs.append((keys[:, :, start:start + n], values[:, :, start:start + n]))
        start += n
    expected = F.scaled_dot_product_attention(query, keys.float(), values.float(), attn_mask=mask, scale=0.125)
    got = attend(query, runs, mask, 0.125)
    assert torch.allclose(got, expected, atol=1e-5)
    two = [runs[0], (torch.cat([r[0] for r in runs[1:]], 2), torch.cat([r[1] for r in runs[1:]], 2))]
    assert torch.allclose(attend(query, two, mask, 0.125), expected, atol=1e-5)


# ----------------------------------------------------------------------------- the real model


def _fragmented_caches(runner: ModelRunner, prompts: list[list[int]], piece: int) -> list[SessionKV]:
    """Prefill the prompts ``piece`` tokens at a time, round robin, with no room reserved: their blocks
    interleave in the pool, so every table is several runs."""
    caches = [runner.new_cache() for _ in prompts]
    longest = max(len(p) for p in prompts)
    for start in range(0, longest, piece):
        for cache, prompt in zip(caches, prompts, strict=True):
            if start < len(prompt):
                runner.prefill(cache, prompt[start:start + piece])
    return caches


def test_batched_decode_over_fragmented_block_tables_equals_transformers_greedy(
        real_runner: ModelRunner, real_reference: torch.nn.Module) -> None:
    tok = real_runner.tokenizer
    texts = ["The capital of France is", "Write a haiku about the sea. A haiku has three lines and",
             "List three primes: 2, 3 and", "Water boils at a temperature of"]
    prompts = [tok(t * 4)["input_ids"] for t in texts]  # 20-70 tokens: several blocks each
    steps = 12
    expected = [reference_greedy(real_reference, p, steps, frozenset()) for p in prompts]
    caches = _fragmented_caches(real_runner, prompts, piece=16)
    assert all(len(block_runs(c.block_ids)) > 1 for c in caches)
    # The first token comes from each prompt's last logits; then one batched step per token.
    nxt = [expected[i][0] for i in range(len(prompts))]
    got: list[list[int]] = [[t] for t in nxt]
    for _ in range(steps - 1):
        nxt = real_runner.decode(caches, nxt).argmax(-1).tolist()
        for row, token in zip(got, nxt, strict=True):
            row.append(token)
    assert got == expected
    for cache in caches:
        cache.free()
    real_runner.pool.allocator.verify()


def test_a_shared_prefix_is_read_in_place_and_never_written_by_the_sharer(real_runner: ModelRunner) -> None:
    tok = real_runner.tokenizer
    prefix = tok(SYSTEM)["input_ids"]
    owner = real_runner.new_cache()
    real_runner.prefill(owner, prefix)
    before = [t.clone() for t in any_layer_kv(owner, 3)]
    sharer = real_runner.new_cache()
    sharer.share_prefix(owner, len(prefix) - 5)  # ends inside a block: that one block is copied
    shared = set(owner.block_ids) & set(sharer.block_ids)
    assert len(shared) == (len(prefix) - 5) // real_runner.pool.block_size
    assert all(real_runner.pool.allocator.ref_count(b) == 2 for b in shared)
    tail = tok(" Different words from here on, nothing like the owner's.")["input_ids"]
    logits = real_runner.prefill(sharer, tail)
    fresh = real_runner.new_cache()
    expected = real_runner.prefill(fresh, prefix[:-5] + tail)
    assert torch.allclose(logits, expected, atol=1e-4)
    after = any_layer_kv(owner, 3)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    for cache in (owner, sharer, fresh):
        cache.free()
    real_runner.pool.allocator.verify()


def test_pool_size_is_the_budget() -> None:
    pool = KVPool.for_budget(10 * 1024 * 1024, 30, 3, 64, torch.float32, "cpu")
    assert pool.num_bytes <= 10 * 1024 * 1024 < pool.num_bytes + pool.bytes_per_block
    assert pool.bytes_per_token == 30 * 2 * 3 * 64 * 4


# ----------------------------------------------------------------------------- through the KV manager


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def _verify(core: Chatd) -> None:
    await core.worker.call(core.runner.pool.allocator.verify)


async def test_sessions_with_one_system_prompt_hold_it_once_and_give_every_block_back(tiny_core: Chatd) -> None:
    svc = tiny_core.sessions
    pool = tiny_core.runner.pool
    results = []
    ids = []
    for _ in range(4):
        info = await svc.create(system=SYSTEM)
        ids.append(info.session_id)
        result = await svc.send(info.session_id, "Hello", greedy(6)).wait()
        assert isinstance(result, TurnResult)
        results.append(result)
    system_tokens = len(svc.template.message_ids("system", SYSTEM, 0))
    assert results[0].usage.cached_tokens == 0
    assert all(r.usage.cached_tokens >= system_tokens - pool.block_size for r in results[1:])
    stats = pool.stats()
    assert stats.num_shared_blocks >= system_tokens // pool.block_size
    # Four sessions of the same prompt hold well under twice one session's blocks.
    one = len(tiny_core.kv._entries[ids[0]].cache.block_ids)
    assert stats.num_used_blocks - stats.num_spare_blocks < 2 * one
    await _verify(tiny_core)
    for session_id in ids:
        assert await tiny_core.delete(session_id)
    await _until(lambda: pool.stats().num_used_blocks == 0)
    stats = pool.stats()
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks and stats.num_tables == 0
    assert stats.num_cached_blocks == 0  # deleted conversations leave nothing findable
    await _verify(tiny_core)


async def test_a_released_prefix_stays_findable_until_its_room_is_needed(tiny_core: Chatd) -> None:
    svc = tiny_core.sessions
    a = await svc.create(system=SYSTEM)
    first = await svc.send(a.session_id, "Hello", greedy(6)).wait()
    assert isinstance(first, TurnResult)
    assert await tiny_core.kv.evict(a.session_id)  # snapshot, and the blocks go to the cached LRU
    await _until(lambda: tiny_core.runner.pool.stats().num_cached_blocks > 0)
    b = await svc.create(system=SYSTEM)
    second = await svc.send(b.session_id, "Hello", greedy(6)).wait()
    assert isinstance(second, TurnResult)
    assert second.usage.cache_tier == "device" and second.usage.cached_tokens > 0
    assert second.assistant_message.content == first.assistant_message.content
    await _verify(tiny_core)


async def _two_rounds(core: Chatd, num_sessions: int, *, check: bool) -> list[tuple[str, str]]:
    """Each session's first turn, then each one's second turn; the replies per session."""
    svc = core.sessions
    sessions = []
    first: list[str] = []
    for i in range(num_sessions):
        info = await svc.create(system=SYSTEM)
        sessions.append(info.session_id)
        result = await svc.send(info.session_id, f"Question {i}?", greedy(5)).wait()
        assert isinstance(result, TurnResult)
        first.append(result.assistant_message.content)
        if check:
            await _verify(core)
            assert core.kv.resident_bytes <= core.kv.budget_bytes
    second: list[str] = []
    for session_id in sessions:
        result = await svc.send(session_id, "And then?", greedy(5)).wait()
        assert isinstance(result, TurnResult)
        second.append(result.assistant_message.content)
        if check:
            await _verify(core)
    return list(zip(first, second, strict=True))


async def test_eviction_with_shared_blocks_never_takes_a_block_another_session_reads(
        make_settings: Callable[..., Settings], tiny_dir: Path, tiny_runner: ModelRunner) -> None:
    alone = make_settings(tiny_dir, cache={"share_prefixes": False})
    async with Chatd.open(alone, runner=tiny_runner, background=False) as core:
        expected = await _two_rounds(core, 6, check=False)
        assert core.counters.num_evictions == 0 and core.counters.num_prefix_shares == 0
    # A budget of 16 blocks: a turn needs about half of it, so turns keep evicting one another, while the
    # system prompt's blocks are shared by whoever is resident.
    budget_mb = 16 * 16 * tiny_runner.info.bytes_per_token / (1024 * 1024)
    crowded = make_settings(tiny_dir, cache={"device_budget_mb": budget_mb}, data_dir=str(alone.data_path) + "-2")
    async with Chatd.open(crowded, runner=tiny_runner, background=False) as core:
        assert await _two_rounds(core, 6, check=True) == expected
        assert core.counters.num_evictions > 0 and core.counters.num_prefix_shares > 0
        assert core.counters.num_restores > 0


# ----------------------------------------------------------------------------- sessions starting together


def _hold_engine(core: Chatd) -> threading.Event:
    """Keep the engine thread busy (as in a long step) until the returned event is set."""
    gate = threading.Event()
    core.worker.submit(lambda: gate.wait(30))
    return gate


async def test_sessions_starting_together_queue_their_caches_for_one_visit_of_the_engine(tiny_core: Chatd) -> None:
    kv = tiny_core.kv
    gate = _hold_engine(tiny_core)
    prompts = [[(7 * i + j) % 200 + 10 for j in range(40)] for i in range(8)]
    acquires = [asyncio.ensure_future(kv.acquire(f"s{i}", prompt, 20)) for i, prompt in enumerate(prompts)]
    try:
        # While the engine is busy, every new session's cache is already queued for it: none waits for
        # another's to be made first (one step each, when they were made one at a time).
        await _until(lambda: tiny_core.worker._inbox.qsize() == len(prompts))
        assert not any(a.done() for a in acquires)
    finally:
        gate.set()
    leases = await asyncio.gather(*acquires)
    assert [lease.prompt_ids for lease in leases] == [tuple(p) for p in prompts]
    assert all(lease.cache.capacity >= 60 for lease in leases)
    for lease in leases:
        kv.release(lease)
    await _verify(tiny_core)


async def test_a_new_turn_joins_the_step_right_after_its_cache_is_made(tiny_core: Chatd,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """While other sessions decode, the engine prepares a new turn's cache between two steps; the turn's job
    follows a few milliseconds later. The engine waits for it (JOB_WAIT_S) instead of starting the next
    step at once, so the prompt is in that very step: it does not wait a whole step more."""
    events: list[object] = []
    real_step, real_new_cache = tiny_core.runner.step, tiny_core.runner.new_cache

    def step(caches: list[SessionKV], runs: list[list[int]]) -> torch.Tensor:
        events.append([len(run) for run in runs])
        time.sleep(0.005)  # a step of some length, so the job can arrive while one runs
        return real_step(caches, runs)

    def new_cache() -> SessionKV:
        events.append("new cache")
        return real_new_cache()

    monkeypatch.setattr(tiny_core.runner, "step", step)
    monkeypatch.setattr(tiny_core.runner, "new_cache", new_cache)
    svc = tiny_core.sessions
    talker, newcomer = (await svc.create()).session_id, (await svc.create()).session_id
    long_turn = svc.send(talker, "Tell me a long story.", greedy(120))
    await _until(lambda: sum(isinstance(e, list) and e == [1] for e in events) >= 3)  # decoding alone
    mark = len(events)
    result = await svc.send(newcomer, "A question?", greedy(2)).wait()
    assert isinstance(result, TurnResult) and isinstance(await long_turn.wait(), TurnResult)
    made = events.index("new cache", mark)
    next_step = next(e for e in events[made + 1:] if isinstance(e, list))
    assert len(next_step) == 2 and max(next_step) > 1, events[made:made + 3]  # the decode row and the prompt


async def test_room_queued_for_new_caches_counts_before_the_engine_makes_them(
        make_settings: Callable[..., Settings], tiny_dir: Path, tiny_runner: ModelRunner,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A turn waiting for room is woken when the engine has given blocks back (a free, a trimmed reservation):
    # those land after the release or eviction that asked for them has returned. Without that wake-up it
    # slept until its periodic look; made a minute here, so a missed wake-up fails the test.
    monkeypatch.setattr(manager_module, "ROOM_RECHECK_S", 60.0)
    # 16 blocks of 16 tokens; each acquire needs 7 (40 prompt + 60 new tokens): two fit, a third does not.
    budget_mb = 16 * 16 * tiny_runner.info.bytes_per_token / (1024 * 1024)
    settings = make_settings(tiny_dir, cache={"device_budget_mb": budget_mb, "share_prefixes": False})
    async with Chatd.open(settings, runner=tiny_runner, background=False) as core:
        kv = core.kv
        gate = _hold_engine(core)
        prompts = [[(11 * i + j) % 200 + 10 for j in range(40)] for i in range(3)]
        acquires = [asyncio.ensure_future(kv.acquire(f"s{i}", prompt, 60)) for i, prompt in enumerate(prompts)]
        await _until(lambda: core.worker._inbox.qsize() >= 2)
        await asyncio.sleep(0.2)
        # The third waits for room (two queued reservations count as taken), instead of being queued too
        # and failing in the engine for lack of blocks.
        assert core.worker._inbox.qsize() == 2
        gate.set()
        first, second = await asyncio.wait_for(asyncio.gather(acquires[0], acquires[1]), 10)
        await asyncio.sleep(0.2)
        assert not acquires[2].done()
        kv.release(first)
        third = await asyncio.wait_for(acquires[2], 10)
        assert third.cache.capacity >= 100 and not kv.is_resident("s0")
        assert core.counters.num_evictions == 1
        kv.release(second)
        kv.release(third)
        await _verify(core)


async def test_a_cancelled_new_session_gives_back_the_cache_the_engine_made_anyway(tiny_core: Chatd) -> None:
    kv, pool = tiny_core.kv, tiny_core.runner.pool
    gate = _hold_engine(tiny_core)
    acquire = asyncio.ensure_future(kv.acquire("gone", list(range(10, 50)), 20))
    await _until(lambda: tiny_core.worker._inbox.qsize() == 1)
    acquire.cancel()
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await acquire
    await _until(lambda: pool.stats().num_used_blocks == 0)
    assert not kv.is_resident("gone")
    # Its room is counted free again: a turn that needs the whole budget still fits.
    lease = await kv.acquire("next", list(range(10, 50)), kv.max_tokens_for_budget() - 40)
    kv.release(lease)
    await _verify(tiny_core)


# ----------------------------------------------------------------------------- resuming from the pool


async def test_an_evicted_session_comes_back_from_its_blocks_still_in_the_pool(
        make_settings: Callable[..., Settings], tiny_dir: Path, tiny_runner: ModelRunner) -> None:
    """An idle eviction releases the session's blocks but leaves them findable by their tokens until their
    room is needed; the session's next turn is made from them (nothing read from its snapshot), and
    replies as a session that never left does."""
    settings = make_settings(tiny_dir, cache={"idle_evict_s": 0.3, "restore_min_tokens": 0})
    async with Chatd.open(settings, runner=tiny_runner, background=False) as core:
        svc = core.sessions
        left = (await svc.create(system=SYSTEM)).session_id
        assert isinstance(await svc.send(left, "Question?", greedy(5)).wait(), TurnResult)
        await asyncio.sleep(0.4)
        await core.kv.tick()
        assert not core.kv.is_resident(left) and core.tier(left) == "disk"
        assert core.counters.num_evictions_idle == 1
        stayed = (await svc.create(system=SYSTEM)).session_id  # the same history, computed while resident
        assert isinstance(await svc.send(stayed, "Question?", greedy(5)).wait(), TurnResult)
        back = await svc.send(left, "And then?", greedy(8)).wait()
        kept = await svc.send(stayed, "And then?", greedy(8)).wait()
        assert isinstance(back, TurnResult) and isinstance(kept, TurnResult)
        assert core.counters.num_resumes_from_pool == 1
        assert core.counters.num_restores == 0  # no snapshot read
        assert back.usage.cache_tier == "device" and back.usage.restore_ms is None
        # Every full block of the history came back; at most a partly filled last block was recomputed.
        assert back.usage.cached_tokens >= kept.usage.cached_tokens - 16
        assert back.assistant_message.content == kept.assistant_message.content
        await _verify(core)


async def test_when_the_blocks_are_gone_the_snapshot_is_read(make_settings: Callable[..., Settings], tiny_dir: Path,
                                                              tiny_runner: ModelRunner) -> None:
    # A pool of 16 blocks: another session's long turn evicts the session and reuses its released blocks.
    budget_mb = 16 * 16 * tiny_runner.info.bytes_per_token / (1024 * 1024)
    settings = make_settings(tiny_dir, cache={"device_budget_mb": budget_mb, "restore_min_tokens": 0})
    async with Chatd.open(settings, runner=tiny_runner, background=False) as core:
        svc = core.sessions
        left = (await svc.create(system=SYSTEM)).session_id
        assert isinstance(await svc.send(left, "Question?", greedy(5)).wait(), TurnResult)
        assert await svc.evict(left)
        # An operator's eviction moves the session to disk: the next turn reads the snapshot.
        back = await svc.send(left, "And then?", greedy(5)).wait()
        assert isinstance(back, TurnResult) and back.usage.cache_tier == "disk"
        assert core.counters.num_restores == 1 and core.counters.num_resumes_from_pool == 0
        # An eviction for room leaves them findable, but another session's long turn reuses them.
        other = (await svc.create()).session_id
        filler = "Different words entirely, counting sheep and stars. " * 20
        assert isinstance(await svc.send(other, filler, greedy(5)).wait(), TurnResult)
        assert core.counters.num_evictions_for_room >= 1 and not core.kv.is_resident(left)
        again = await svc.send(left, "And after that?", greedy(5)).wait()
        assert isinstance(again, TurnResult) and again.usage.cache_tier == "disk"
        assert core.counters.num_restores == 2 and core.counters.num_resumes_from_pool == 0
        await _verify(core)
