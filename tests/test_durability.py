"""Snapshots, eviction under a memory budget, restore, disk faults and restarts (tiny model, in process)."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from chatd.config import ModelSettings, Settings
from chatd.engine.kernels.loader import load_kernels
from chatd.engine.model.runner import ModelRunner
from chatd.engine.pool.kvcache import SessionKV
from chatd.errors import ContextLengthExceeded
from chatd.kv.snapshot import SnapshotInfo, read_info
from chatd.service.core import Chatd
from chatd.service.types import GenerationOptions, TurnResult, Usage

SettingsFactory = Callable[..., Settings]


def sampled(seed: int, n: int = 12) -> GenerationOptions:
    # Seeded sampling: replies differ from turn to turn, and equal logits give equal replies.
    return GenerationOptions(temperature=1.0, top_k=0, top_p=1.0, seed=seed, max_tokens=n)


async def turn(core: Chatd, session_id: str, text: str, seed: int, n: int = 12) -> TurnResult:
    result = await core.sessions.send(session_id, text, sampled(seed, n)).wait()
    assert isinstance(result, TurnResult)
    return result


def budget_mb(runner: ModelRunner, tokens: int) -> float:
    return tokens * runner.info.bytes_per_token / (1024 * 1024)


async def _cache_tensors(core: Chatd, session_id: str) -> list[torch.Tensor]:
    entry = core.kv._entries[session_id]
    return await core.worker.call(lambda: [t.clone() for k, v in entry.cache.filled_layers() for t in (k, v)])


async def test_only_a_budget_short_of_room_weighs_the_resident_sessions(make_settings: SettingsFactory, tiny_dir: Path,
                                                                       tiny_runner: ModelRunner,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn start counts each resident session's private blocks (work that grows with every session and
    block) only when the budget lacks room for it; a turn that fits goes ahead without, and so does the
    background round of persisting and idle eviction."""
    weighed: list[str] = []
    private_bytes = SessionKV.private_bytes

    def counting(cache: SessionKV) -> int:
        weighed.append("x")
        return private_bytes.fget(cache)  # type: ignore[attr-defined]

    monkeypatch.setattr(SessionKV, "private_bytes", property(counting))
    roomy = make_settings(tiny_dir)
    async with Chatd.open(roomy, runner=tiny_runner, background=False) as core:
        ids = [(await core.sessions.create()).session_id for _ in range(4)]
        for t in range(2):
            for i, sid in enumerate(ids):
                await turn(core, sid, f"message {t}", seed=10 * i + t)
        await core.kv.tick()
        assert weighed == [] and core.counters.num_evictions == 0
    small = make_settings(tiny_dir, cache={"device_budget_mb": budget_mb(tiny_runner, 260), "restore_min_tokens": 0})
    small = small.model_copy(update={"data_dir": str(Path(small.data_dir).parent / "small")})
    async with Chatd.open(small, runner=tiny_runner, background=False) as core:
        ids = [(await core.sessions.create()).session_id for _ in range(6)]
        for i, sid in enumerate(ids):
            await turn(core, sid, "a message long enough to fill the small budget " * 3, seed=i, n=24)
        assert core.counters.num_evictions > 0 and weighed  # short of room: the sessions were weighed


async def test_many_sessions_under_a_small_budget(make_settings: SettingsFactory, tiny_dir: Path,
                                                  tiny_runner: ModelRunner, tmp_path: Path) -> None:
    """The budget holds a few sessions; 8 sessions take turns. Resident bytes never exceed the budget,
    victims are the least recently used idle sessions, and every reply equals a never-evicted twin's."""
    budget = budget_mb(tiny_runner, 260)
    small = make_settings(tiny_dir, cache={"device_budget_mb": budget, "restore_min_tokens": 0})
    twin_settings = make_settings(tiny_dir).model_copy(update={"data_dir": str(tmp_path / "twin")})
    script = [(s, t) for t in range(3) for s in (0, 1, 2, 3, 4, 5, 6, 7)]
    script += [(3, 3), (0, 3), (7, 3), (3, 4)]
    async with Chatd.open(small, runner=tiny_runner, background=False) as core, \
            Chatd.open(twin_settings, runner=tiny_runner, background=False) as twin:
        ids = [(await core.sessions.create()).session_id for _ in range(8)]
        twin_ids = [(await twin.sessions.create()).session_id for _ in range(8)]
        lru: list[int] = []  # resident sessions, least recently used first (the test's own model)
        tiers: list[str] = []
        for step, (s, t) in enumerate(script):
            text = f"message {t} of session {s}"
            before = len(core.counters.eviction_log)
            got = await turn(core, ids[s], text, seed=100 * s + t)
            want = await turn(twin, twin_ids[s], text, seed=100 * s + t)
            assert got.assistant_message.content == want.assistant_message.content, (step, s, t)
            assert core.kv.resident_bytes <= core.kv.budget_bytes, step
            evicted = [sid for sid, reason in list(core.counters.eviction_log)[before:]]
            expected = [ids[i] for i in lru if i != s][: len(evicted)]
            assert evicted == expected, f"step {step}: evicted out of LRU order"
            lru = [i for i in lru if ids[i] not in evicted and i != s] + [s]
            assert sorted(core.kv.resident_ids()) == sorted(ids[i] for i in lru)
            tiers.append(got.usage.cache_tier)
        assert core.counters.num_evictions >= 10
        assert "disk" in tiers  # evicted sessions came back from their snapshots
        # ... or, when their released blocks had not been reused yet, from those (tests/test_kv_pool.py)
        assert core.counters.num_restores >= 4 and core.counters.num_restore_failures == 0
        assert core.counters.num_restores + core.counters.num_resumes_from_pool >= 8


@pytest.mark.parametrize("native_planes", [False, True])
async def test_restore_is_bit_exact(make_settings: SettingsFactory, tiny_dir: Path, tiny_runner: ModelRunner,
                                    real_dir: Path, monkeypatch: pytest.MonkeyPatch, native_planes: bool) -> None:
    # With the engine's native kernels, the service splits and joins the snapshot's byte planes with them.
    calls: list[str] = []
    if native_planes:
        kernels = load_kernels(real_dir / "native")
        assert kernels is not None, "the test machine has a C compiler (scripts/setup.sh installs one)"

        class Counting:
            def split_planes(self, elements: Any, planes: Any) -> None:
                calls.append("split")
                kernels.split_planes(elements, planes)

            def join_planes(self, planes: Any, elements: Any) -> None:
                calls.append("join")
                kernels.join_planes(planes, elements)

        monkeypatch.setattr(tiny_runner, "kernels", Counting())
    async with Chatd.open(make_settings(tiny_dir, cache={"restore_min_tokens": 0}), runner=tiny_runner,
                          background=False) as core:
        sid = (await core.sessions.create(system="Keep this exact.")).session_id
        await turn(core, sid, "some history", 1, n=20)
        before = await _cache_tensors(core, sid)
        assert await core.sessions.evict(sid)
        assert not core.kv.is_resident(sid)
        assert await core.sessions.restore(sid) == "device"
        after = await _cache_tensors(core, sid)
        assert len(before) == len(after)
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(before, after, strict=True))
        result = await turn(core, sid, "next", 2)
        assert result.usage.cache_tier == "disk" and result.usage.restore_ms is not None
    if native_planes:  # one restore; the eviction's snapshot, and another when the server closed
        slabs = 2 * tiny_runner.info.num_layers * tiny_runner.info.num_kv_heads
        assert calls.count("join") == slabs and calls.count("split") == 2 * slabs
    else:
        assert not calls


async def test_a_snapshot_folder_deleted_at_runtime_is_recreated(make_settings: SettingsFactory, tiny_dir: Path,
                                                                 tiny_runner: ModelRunner) -> None:
    async with Chatd.open(make_settings(tiny_dir, cache={"restore_min_tokens": 0}), runner=tiny_runner,
                          background=False) as core:
        sid = (await core.sessions.create()).session_id
        await turn(core, sid, "some history", 1, n=20)
        shutil.rmtree(core.snapshots.store.folder)
        # The eviction still writes its snapshot (into a recreated folder) and frees the memory.
        assert await core.sessions.evict(sid)
        assert not core.kv.is_resident(sid) and core.tier(sid) == "disk"
        assert core.counters.num_snapshot_write_failures == 0
        assert await core.sessions.restore(sid) == "device"
        result = await turn(core, sid, "next", 2)
        assert result.usage.cache_tier == "disk" and result.usage.restore_ms is not None


async def test_disk_full_keeps_serving_and_loses_nothing(make_settings: SettingsFactory, tiny_dir: Path,
                                                         tiny_runner: ModelRunner, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # No prefix sharing: the evicted session's released blocks must not be found again by their tokens.
    settings = make_settings(tiny_dir, cache={"device_budget_mb": budget_mb(tiny_runner, 120),
                                              "restore_min_tokens": 0, "share_prefixes": False})
    twin_settings = make_settings(tiny_dir).model_copy(update={"data_dir": str(tmp_path / "twin")})
    async with Chatd.open(settings, runner=tiny_runner, background=False) as core, \
            Chatd.open(twin_settings, runner=tiny_runner, background=False) as twin:
        store = core.snapshots.store

        def full(session_id: str, write_body: Callable[..., object]) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(store, "write", full)
        a = (await core.sessions.create()).session_id
        ta = (await twin.sessions.create()).session_id
        first = await turn(core, a, "hello", 1)
        await turn(twin, ta, "hello", 1)
        # An operator eviction that cannot write keeps the session resident.
        assert not await core.sessions.evict(a)
        assert core.kv.is_resident(a)
        assert core.counters.num_snapshot_write_failures == 1
        # Room is still made when needed: the victim falls back to recompute later.
        b = (await core.sessions.create()).session_id
        await turn(core, b, "a different session that needs the room " * 5, 2)
        assert core.counters.eviction_log[-1] == (a, "room")
        assert not core.kv.is_resident(a)
        again = await turn(core, a, "are you there?", 3)
        twin_again = await turn(twin, ta, "are you there?", 3)
        assert again.usage.cache_tier == "none"
        assert again.assistant_message.content == twin_again.assistant_message.content
        messages = await core.repo.get_messages(a)
        assert [m.content for m in messages] == ["hello", first.assistant_message.content, "are you there?",
                                                 again.assistant_message.content]
        assert not list(store.folder.iterdir())


async def test_crash_between_write_and_rename_keeps_the_previous_snapshot(
        make_settings: SettingsFactory, tiny_dir: Path, tiny_runner: ModelRunner,
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with Chatd.open(make_settings(tiny_dir, cache={"restore_min_tokens": 0}), runner=tiny_runner,
                          background=False) as core:
        sid = (await core.sessions.create()).session_id
        first = await turn(core, sid, "first turn", 1)
        assert await core.sessions.evict(sid)
        old_record = await core.snapshots.record(sid)
        assert old_record is not None
        second = await turn(core, sid, "second turn", 2)
        assert second.usage.cache_tier == "disk"

        real_replace = os.replace

        def crash(src: Any, dst: Any) -> None:
            raise OSError(errno.EIO, "simulated crash before rename")

        monkeypatch.setattr(os, "replace", crash)
        assert not await core.sessions.evict(sid)  # the new snapshot never landed
        monkeypatch.setattr(os, "replace", real_replace)
        assert [p.name for p in core.snapshots.store.folder.iterdir()] == [old_record.file_name]
        # Drop the resident cache without writing, as a crash would (the pool's contents go too): the old
        # snapshot still restores the prefix it shares with the conversation.
        entry = core.kv._entries[sid]
        core.kv._forget(entry, forget_blocks=True)
        await core.worker.call(core.runner.pool.allocator.evict_cached)
        third = await turn(core, sid, "third turn", 3)
        assert third.usage.cache_tier == "disk"
        assert third.usage.cached_tokens == first.usage.input_tokens + first.usage.output_tokens - 1


async def test_corrupt_or_foreign_snapshots_are_recomputed(make_settings: SettingsFactory, tiny_dir: Path,
                                                           tiny_runner: ModelRunner, tmp_path: Path) -> None:
    settings = make_settings(tiny_dir, cache={"restore_min_tokens": 0})
    twin_settings = make_settings(tiny_dir).model_copy(update={"data_dir": str(tmp_path / "twin")})
    async with Chatd.open(settings, runner=tiny_runner, background=False) as core, \
            Chatd.open(twin_settings, runner=tiny_runner, background=False) as twin:
        sid = (await core.sessions.create()).session_id
        tid = (await twin.sessions.create()).session_id
        await turn(core, sid, "hello", 1)
        await turn(twin, tid, "hello", 1)
        assert await core.sessions.evict(sid)
        path = core.snapshots.store.path_for(sid)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
        got = await turn(core, sid, "still right?", 2)
        want = await turn(twin, tid, "still right?", 2)
        assert got.usage.cache_tier == "none" and got.usage.cached_tokens == 0
        assert got.assistant_message.content == want.assistant_message.content
        assert core.counters.num_restore_failures == 1
        assert await core.snapshots.record(sid) is None and not path.exists()
        assert await core.sessions.evict(sid)
    # Another model's weights: its snapshots are dropped at start, the session recomputes.
    other = ModelRunner(tiny_runner.model, tiny_runner.tokenizer,
                        dataclasses.replace(tiny_runner.info, weights_hash="0" * 64), tiny_runner.forward)
    async with Chatd.open(settings, runner=other, background=False) as core:
        assert await core.snapshots.record(sid) is None
        assert not core.snapshots.store.path_for(sid).exists()
        result = await turn(core, sid, "after a model change", 3)
        assert result.usage.cache_tier == "none"


async def test_short_histories_are_recomputed_not_restored(make_settings: SettingsFactory, tiny_dir: Path,
                                                           tiny_runner: ModelRunner) -> None:
    # No prefix sharing: the evicted session's released blocks must not be found again by their tokens.
    async with Chatd.open(make_settings(tiny_dir, cache={"restore_min_tokens": 10_000, "share_prefixes": False}),
                          runner=tiny_runner, background=False) as core:
        sid = (await core.sessions.create()).session_id
        await turn(core, sid, "short", 1)
        assert await core.sessions.evict(sid)
        result = await turn(core, sid, "again", 2)
        assert result.usage.cache_tier == "none" and core.counters.num_restores == 0


async def test_idle_sessions_are_persisted_then_evicted(make_settings: SettingsFactory, tiny_dir: Path,
                                                        tiny_runner: ModelRunner) -> None:
    settings = make_settings(tiny_dir, cache={"persist_idle_s": 20, "idle_evict_s": 60, "restore_min_tokens": 0})
    async with Chatd.open(settings, runner=tiny_runner, background=False) as core:
        # The cache manager's clock is set by hand, so a slow host cannot move the moments the test looks at.
        now = [1000.0]
        core.kv.clock = lambda: now[0]
        sid = (await core.sessions.create()).session_id
        await turn(core, sid, "hello", 1)
        now[0] += 19
        await core.kv.tick()
        assert core.kv.is_resident(sid) and await core.snapshots.record(sid) is None
        now[0] += 2
        await core.kv.tick()
        assert core.kv.is_resident(sid) and await core.snapshots.record(sid) is not None  # persisted, resident
        writes = core.counters.num_snapshot_writes
        now[0] += 40
        await core.kv.tick()
        assert not core.kv.is_resident(sid)
        assert core.counters.num_snapshot_writes == writes  # already on disk: eviction wrote nothing
        assert core.counters.num_evictions_idle == 1
        # Nothing needed the released blocks meanwhile: the turn is made from them, not the snapshot
        # (tests/test_kv_pool.py has more on this).
        result = await turn(core, sid, "back", 2)
        assert result.usage.cache_tier == "device" and result.usage.cached_tokens > 0
        assert core.counters.num_resumes_from_pool == 1 and core.counters.num_restores == 0


async def test_disk_budget_deletes_the_oldest_snapshots(make_settings: SettingsFactory, tiny_dir: Path,
                                                        tiny_runner: ModelRunner) -> None:
    # No prefix sharing: the evicted session's released blocks must not be found again by their tokens.
    async with Chatd.open(make_settings(tiny_dir, cache={"restore_min_tokens": 0, "share_prefixes": False}),
                          runner=tiny_runner, background=False) as core:
        ids = [(await core.sessions.create()).session_id for _ in range(4)]
        for i, sid in enumerate(ids):
            await turn(core, sid, f"session {i} " * 5, i)
        assert await core.sessions.evict(ids[0])
        one = (await core.snapshots.record(ids[0]))
        assert one is not None
        core.snapshots.disk_budget_bytes = int(one.file_bytes * 2.5)
        for sid in ids[1:]:
            assert await core.sessions.evict(sid)
        kept = set(core.snapshots.records())
        assert kept == set(ids[2:])  # the two oldest went
        assert core.snapshots.disk_bytes <= core.snapshots.disk_budget_bytes
        assert {p.stem for p in core.snapshots.store.folder.iterdir()} == kept

        def on_disk() -> int:
            return sum(p.stat().st_size for p in core.snapshots.store.folder.iterdir())

        # The total the budget is checked against is kept with the records: the files' sizes, through
        # deletions for the budget, a snapshot replaced by a longer one, and a session deleted.
        assert core.snapshots.disk_bytes == on_disk()
        result = await turn(core, ids[0], "resume without a snapshot", 9)
        assert result.usage.cache_tier == "none"
        await turn(core, ids[3], "a longer conversation " * 6, 10)
        core.snapshots.disk_budget_bytes = 1 << 30
        before = (await core.snapshots.record(ids[3]))
        assert await core.sessions.evict(ids[3])
        after = await core.snapshots.record(ids[3])
        assert before is not None and after is not None and after.file_bytes > before.file_bytes
        assert core.snapshots.disk_bytes == on_disk()
        assert await core.sessions.delete(ids[2])
        assert set(core.snapshots.records()) == {ids[3]}
        assert core.snapshots.disk_bytes == on_disk() == after.file_bytes


async def test_orphans_are_removed_at_start(make_settings: SettingsFactory, tiny_dir: Path,
                                            tiny_runner: ModelRunner) -> None:
    settings = make_settings(tiny_dir, cache={"restore_min_tokens": 0})
    async with Chatd.open(settings, runner=tiny_runner, background=False) as core:
        sid = (await core.sessions.create()).session_id
        await turn(core, sid, "hello", 1)
        assert await core.sessions.evict(sid)
        gone = (await core.sessions.create()).session_id
        await turn(core, gone, "bye", 2)
        assert await core.sessions.evict(gone)
        folder = core.snapshots.store.folder
    (folder / f"{'Z' * 24}.kvsnap").write_bytes(b"left over from a deleted session")
    os.remove(folder / f"{gone}.kvsnap")  # record without a file
    async with Chatd.open(settings, runner=tiny_runner, background=False) as core:
        assert sorted(core.snapshots.records()) == [sid]
        assert sorted(p.name for p in folder.iterdir()) == [f"{sid}.kvsnap"]
        assert await core.repo.get_snapshot(gone) is None
        result = await turn(core, sid, "still restorable", 3)
        assert result.usage.cache_tier == "disk"


async def test_snapshot_writes_do_not_stall_other_sessions(make_settings: SettingsFactory, tiny_dir: Path,
                                                           tiny_runner: ModelRunner,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    async with Chatd.open(make_settings(tiny_dir), runner=tiny_runner, background=False) as core:
        a = (await core.sessions.create()).session_id
        b = (await core.sessions.create()).session_id
        await turn(core, a, "history", 1)
        store = core.snapshots.store
        release = threading.Event()
        real_write = store.write

        def slow_write(session_id: str, write_body: Callable[..., object]) -> int:
            assert release.wait(30)
            return real_write(session_id, write_body)

        monkeypatch.setattr(store, "write", slow_write)
        eviction = asyncio.ensure_future(core.sessions.evict(a))
        await asyncio.sleep(0.1)
        assert not eviction.done()
        result = await turn(core, b, "while a snapshot is being written", 2, n=20)
        assert result.usage.output_tokens == 20
        assert not eviction.done()  # b's whole turn ran while a's snapshot was still being written
        release.set()
        assert await eviction


async def test_a_turn_larger_than_the_budget_is_refused_up_front(make_settings: SettingsFactory, tiny_dir: Path,
                                                                 tiny_runner: ModelRunner) -> None:
    settings = make_settings(tiny_dir, cache={"device_budget_mb": budget_mb(tiny_runner, 100)})
    async with Chatd.open(settings, runner=tiny_runner, background=False) as core:
        sid = (await core.sessions.create()).session_id
        with pytest.raises(ContextLengthExceeded):
            await core.sessions.send(sid, "hi", GenerationOptions(max_tokens=200)).wait()
        assert await core.repo.get_messages(sid) == []
        ok = await turn(core, sid, "hi", 1, n=20)
        assert isinstance(ok.usage, Usage)


@pytest.mark.parametrize("snapshot_dtype", ["native", "bfloat16"])
async def test_an_int8_cache_restores_bit_exactly_after_eviction_and_after_a_restart(
        make_settings: SettingsFactory, tiny_dir: Path, snapshot_dtype: str) -> None:
    # An int8 cache's rows carry their scales: the snapshot (written at zstd's fast level) brings back every
    # byte, after an eviction and in a new server on the same files. snapshot_dtype = "bfloat16" narrows only
    # fp32 caches: an int8 one is still stored as it is.
    runner = ModelRunner.load(ModelSettings(source=str(tiny_dir), threads=1, dtype="int8"), tiny_dir)
    settings = make_settings(tiny_dir, cache={"restore_min_tokens": 0, "snapshot_dtype": snapshot_dtype})
    async with Chatd.open(settings, runner=runner, background=False) as core:
        sid = (await core.sessions.create(system="Keep this exact.")).session_id
        await turn(core, sid, "some history", 1, n=20)
        before = await _cache_tensors(core, sid)
        assert before[0].dtype == torch.int8 and before[0].shape[-1] == runner.info.head_dim + 4
        assert await core.sessions.evict(sid)
        record = await core.snapshots.record(sid)
        assert record is not None
        info = read_info_at(core.snapshots.store.path_for(sid))
        assert info.zstd_level == -3 and info.lossless and info.stored_dtype == "int8"
        assert await core.sessions.restore(sid) == "device"
        assert all(torch.equal(a, b) for a, b in zip(before, await _cache_tensors(core, sid), strict=True))
    async with Chatd.open(settings, runner=runner, background=False) as core:
        assert not core.kv.is_resident(sid)
        assert await core.sessions.restore(sid) == "device"
        assert all(torch.equal(a, b) for a, b in zip(before, await _cache_tensors(core, sid), strict=True))
        result = await turn(core, sid, "next", 2)
        assert result.usage.cache_tier == "disk" and result.usage.cached_tokens == before[0].shape[1]


def read_info_at(path: Path) -> SnapshotInfo:
    with path.open("rb") as f:
        return read_info(f)
