"""Resident KV caches per session under a byte budget, and the reconcile step.

The manager lives on the event loop. It decides (which prefix to reuse, which sessions to evict,
restore or recompute) and has the engine worker carry out every tensor operation through
``worker.call``; snapshot encoding and file I/O run in the persistence layer's I/O thread on
tensors that no forward pass can touch at that moment (guarded by ``_Entry.io``).

Invariants:
* ``cached_ids`` of an entry are exactly the ids whose K/V its cache holds (len == cache.length);
* the allocated bytes of all resident caches never exceed ``device_budget_mb``;
* a busy entry (leased to a generation, or in snapshot I/O) is never evicted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from chatd.config import CacheSettings
from chatd.counters import Counters, EvictionReason
from chatd.domain import ContextSource, Tier, context_source
from chatd.engine.model.runner import ModelInfo
from chatd.engine.pool.kvcache import SessionKV
from chatd.errors import ContextLengthExceeded
from chatd.kv import policy
from chatd.kv.persistence import SnapshotService
from chatd.kv.prefix import longest_reusable, reusable_prefix
from chatd.kv.restore import CacheRestorer
from chatd.tasks import TaskSet

if TYPE_CHECKING:
    from chatd.engine.worker import EngineWorker

log = logging.getLogger(__name__)

T = TypeVar("T")

# After a turn, spare capacity beyond this many tokens is given back to the budget.
SPARE_TOKENS = 64
ROOM_WAIT_S = 120.0
# A turn waiting for room looks again at least this often, should a wake-up go missing.
ROOM_RECHECK_S = 5.0


@dataclass
class _Entry:
    session_id: str
    cache: SessionKV
    cached_ids: list[int]
    last_used: float
    busy: bool = False
    persisted: bool = False
    io: asyncio.Task[bool] | None = None
    # Set when the cache was restored ahead of its turn (resume, admin): that turn reports tier disk.
    restored_ms: float | None = None
    # A cache with no stored session behind it (the OpenAI API's stateless requests): never snapshotted,
    # just freed when evicted.
    ephemeral: bool = False


@dataclass(frozen=True)
class Lease:
    """A session's cache, lent to one generation. Prefill ``prefill_ids`` then generate."""

    session_id: str
    cache: SessionKV
    prompt_ids: tuple[int, ...]
    num_cached: int
    source: ContextSource
    """Where the ``num_cached`` reused positions came from."""
    restore_ms: float | None

    @classmethod
    def of(cls, session_id: str, cache: SessionKV, prompt_ids: tuple[int, ...], num_cached: int, *,
           restore_ms: float | None = None) -> Lease:
        """A lease of ``num_cached`` reused positions; ``restore_ms``: they were read back from a snapshot (in
        that many ms), for this turn or ahead of it (resume)."""
        source = context_source(num_cached, restored=restore_ms is not None)
        return cls(session_id, cache, prompt_ids, num_cached, source, restore_ms)

    @property
    def prefill_ids(self) -> tuple[int, ...]:
        return self.prompt_ids[self.num_cached:]


class KVManager:
    def __init__(self, worker: EngineWorker, info: ModelInfo, settings: CacheSettings,
                 snapshots: SnapshotService | None = None, *, counters: Counters | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.worker = worker
        self.info = info
        self.settings = settings
        self.snapshots = snapshots
        self.clock = clock
        # The engine's KV pool is the budget: its blocks are all the device memory sessions may hold.
        self.pool = worker.runner.pool
        self.budget_bytes = self.pool.num_bytes
        self.bytes_per_token = self.pool.bytes_per_token
        self.counters = counters if counters is not None else Counters()
        self.restorer = CacheRestorer(worker, snapshots, self.counters) if snapshots is not None else None
        self._entries: dict[str, _Entry] = {}
        # Sessions whose new cache the engine is making (no entry yet).
        self._arriving: set[str] = set()
        # Sessions an operator evicted: their next cache comes from the snapshot, not blocks left in the pool.
        self._to_disk: set[str] = set()
        self._room = asyncio.Condition()
        # Room taken for engine work queued and not run yet: queued minus placed (see _take_room).
        self._queued_bytes = 0
        self._placed_bytes = 0
        self._background: asyncio.Task[None] | None = None
        # Frees, spare-capacity trims and room notifications that nobody waits for.
        self._tasks = TaskSet()

    # ------------------------------------------------------------------ queries

    @property
    def resident_bytes(self) -> int:
        """Bytes of the pool's blocks that sessions hold (a block shared by several counts once)."""
        return self.pool.used_bytes

    def resident_ids(self) -> list[str]:
        return list(self._entries)

    def is_resident(self, session_id: str) -> bool:
        return session_id in self._entries

    def kv_bytes(self, session_id: str) -> int:
        entry = self._entries.get(session_id)
        return entry.cache.num_bytes if entry else 0

    def cached_ids(self, session_id: str) -> list[int] | None:
        entry = self._entries.get(session_id)
        return list(entry.cached_ids) if entry else None

    def cached_ids_view(self, session_id: str) -> Sequence[int] | None:
        """The session's cached ids without a copy, for a look that ends before the caller's next await:
        read them, never change them (the manager changes them in place)."""
        entry = self._entries.get(session_id)
        return entry.cached_ids if entry else None

    def max_tokens_for_budget(self) -> int:
        return self.budget_bytes // self.bytes_per_token

    def check_fits(self, num_tokens: int) -> None:
        """Raise ContextLengthExceeded when one turn of ``num_tokens`` could never fit the budget."""
        if num_tokens * self.bytes_per_token > self.budget_bytes:
            raise ContextLengthExceeded(
                f"this turn needs room for {num_tokens} tokens of KV cache but the server's cache budget "
                f"holds {self.max_tokens_for_budget()}")

    def _records(self, *, with_bytes: bool = True) -> list[policy.CacheRecord]:
        """Every resident session as the policies see it. A session's bytes are the blocks only it holds,
        counted block by block; ``with_bytes=False`` leaves them 0 for the policies that do not weigh them
        (persisting, idle eviction)."""
        return [policy.CacheRecord(e.session_id, e.cache.private_bytes if with_bytes else 0, e.last_used,
                                   busy=e.busy or e.io is not None, persisted=e.persisted or e.ephemeral)
                for e in self._entries.values()]

    # ------------------------------------------------------------------ lease / release

    async def acquire(self, session_id: str, prompt_ids: Sequence[int], max_new_tokens: int, *,
                      ephemeral: bool = False) -> Lease:
        """Lend the session's cache to a generation of ``prompt_ids`` + up to ``max_new_tokens``.

        Reuses the longest valid prefix of the resident cache; when the session is not resident,
        restores its snapshot (when worth it) or starts empty. Makes room by evicting idle sessions,
        least recently used first, waiting for running generations when only they hold the budget.
        The caller must call :meth:`release` (also on error or cancellation). A cache first made
        ``ephemeral`` (no stored session behind it) is never written to disk.

        The room lock is held only while deciding: the engine work an acquire needs (a truncation, a
        reservation, a new cache) runs after the engine's current step, so many sessions starting at
        once queue their work together instead of waiting a step each, one after the other.
        """
        prompt = tuple(prompt_ids)
        capacity = len(prompt) + max_new_tokens
        self.check_fits(capacity)
        started: asyncio.Future[tuple[SessionKV, int]] | None = None
        async with self._room:
            # Snapshot I/O reads the buffers below `length`; never change them under it.
            await self._wait_io(session_id)
            entry = self._entries.get(session_id)
            if entry is None:
                cold = await self._start_cold(session_id, prompt, capacity, ephemeral=ephemeral)
                if isinstance(cold, Lease):
                    return cold
                started = cold
                # Until the cache exists the session has no entry: an operator's restore of it must not
                # start a second cache meanwhile (its turns are one at a time anyway).
                self._arriving.add(session_id)
            else:
                # Busy from here: no eviction, snapshot or other acquire touches the cache until release.
                entry.busy = True
        if started is not None:
            return await self._finish_cold(session_id, prompt, started, ephemeral=ephemeral)
        assert entry is not None
        try:
            reuse = reusable_prefix(entry.cached_ids, prompt)
            cache = entry.cache
            # Cut first: blocks past the reused prefix that another session also holds leave this cache
            # without coming free, so the room still needed is known only afterwards.
            await self.worker.call(lambda: cache.truncate(reuse))
            del entry.cached_ids[reuse:]
            async with self._room:
                need = max(capacity * self.bytes_per_token - cache.num_bytes, 0)
                await self._make_room(need, protect={session_id})
                reserved = self._take_room(need, lambda: cache.reserve(capacity))
            await asyncio.shield(reserved)
        except BaseException:
            entry.busy = False
            raise
        restored_ms, entry.restored_ms = entry.restored_ms, None
        if restored_ms is not None and reuse:
            return Lease.of(session_id, cache, prompt, reuse, restore_ms=restored_ms)
        return Lease.of(session_id, cache, prompt, reuse)

    async def _start_cold(self, session_id: str, prompt: tuple[int, ...], capacity: int, *,
                          ephemeral: bool = False) -> Lease | asyncio.Future[tuple[SessionKV, int]]:
        """With the room lock held: restore the session's snapshot (a lease), or make room and queue the
        making of a new cache (its future: the cache and how many positions it starts with)."""
        if not ephemeral:
            restored = await self._try_restore(session_id, prompt, capacity,
                                               reuse_limit=max(len(prompt) - 1, 0))
            if restored is not None:
                return restored
        # Room first, by plain LRU (a would-be donor is not protected: sharing never changes who is
        # evicted). Then the cache starts from the longest prefix already in the pool: full blocks found
        # by hash (computed by any session, still held or released and not yet reused), or the blocks of
        # the resident session sharing the longest prefix (exact to the token; its partly filled last
        # block is copied). Decide and hand the work to the engine thread with no await in between: the
        # engine runs calls in order, so no eviction, truncation or forward pass queued later can touch the
        # donor's prefix first.
        need = capacity * self.bytes_per_token
        await self._make_room(need, protect=())
        donor = self._best_donor(session_id, prompt)
        source = self._entries[donor].cache if donor is not None else None
        wanted = reusable_prefix(self._entries[donor].cached_ids, prompt) if donor is not None else 0
        share = self.settings.share_prefixes

        def start() -> tuple[SessionKV, int]:
            cache = self.worker.runner.new_cache()
            try:
                length = cache.adopt_cached_prefix(prompt, max(len(prompt) - 1, 0)) if share else 0
                # A turn of the donor that started just before may have queued a truncation ahead of this
                # call (its cached_ids shrink only when that returns): share what the donor still holds.
                if source is not None and min(wanted, source.length) > length:
                    length = min(wanted, source.length)
                    cache.share_prefix(source, length)
                if 0 < length < self.settings.share_min_tokens:
                    cache.truncate(0)
                    length = 0
                cache.reserve(capacity)
            except BaseException:
                cache.free()
                raise
            return cache, length

        return self._take_room(need, start)

    async def _finish_cold(self, session_id: str, prompt: tuple[int, ...],
                           started: asyncio.Future[tuple[SessionKV, int]], *, ephemeral: bool) -> Lease:
        try:
            cache, shared = await asyncio.shield(started)
        except asyncio.CancelledError:
            # The engine makes the cache anyway; give its blocks back once it has.
            started.add_done_callback(self._free_unclaimed)
            raise
        finally:
            self._arriving.discard(session_id)
        if shared:
            self.counters.num_prefix_shares += 1
            self.counters.num_prefix_shared_tokens += shared
        self._entries[session_id] = _Entry(session_id, cache, list(prompt[:shared]), self.clock(), busy=True,
                                           ephemeral=ephemeral)
        return Lease.of(session_id, cache, prompt, shared)

    def _free_unclaimed(self, started: asyncio.Future[tuple[SessionKV, int]]) -> None:
        if not started.cancelled() and started.exception() is None:
            cache = started.result()[0]
            self._tasks.spawn(self.worker.call(cache.free))
            self._tasks.spawn(self._notify_room())

    def _best_donor(self, session_id: str, prompt: Sequence[int]) -> str | None:
        """The resident session whose cache shares the longest usable prefix with ``prompt`` (at least
        ``share_min_tokens``), or None. Positions below a session's ``cached_ids`` length are stable even
        while it generates (its generation writes only past them)."""
        if not self.settings.share_prefixes:
            return None
        others = ((other_id, entry.cached_ids) for other_id, entry in self._entries.items() if other_id != session_id)
        return longest_reusable(others, prompt, self.settings.share_min_tokens)[0]

    def release(self, lease: Lease, *, generated_ids: Sequence[int] = (), ok: bool = True) -> None:
        """Return a lease. With ``ok`` the cache holds ``prompt + generated_ids`` up to its length;
        otherwise (a failed forward pass) its contents are unknown and it is dropped."""
        entry = self._entries.get(lease.session_id)
        if entry is None or entry.cache is not lease.cache:
            return
        if not ok:
            self._forget(entry)
        else:
            ids = [*lease.prompt_ids, *generated_ids][: lease.cache.length]
            entry.cached_ids = ids
            entry.busy = False
            entry.persisted = False
            entry.last_used = self.clock()
            cache = lease.cache
            if cache.capacity - cache.length > SPARE_TOKENS:
                self._tasks.spawn(self._give_back(lambda: cache.reserve(cache.length + SPARE_TOKENS)))
        self._tasks.spawn(self._notify_room())

    async def _notify_room(self) -> None:
        async with self._room:
            self._room.notify_all()

    async def _give_back(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` (engine work that returns blocks to the pool: a free, a trimmed reservation), then wake
        the turns waiting for room. The pool's count drops only when the engine has run it, after the release
        or eviction that asked for it has returned: a turn that looked for room in between and found none is
        waiting (up to ROOM_WAIT_S), and no other wake-up may come."""
        try:
            await self.worker.call(fn)
        finally:
            await self._notify_room()

    # ------------------------------------------------------------------ room

    def _take_room(self, need_bytes: int, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Queue ``fn`` (engine work that takes up to ``need_bytes`` of the pool) right after
        :meth:`_make_room` made that room, counting the bytes as used until ``fn`` has run, so the room
        lock can be released before the work is done without a later decision counting them free."""
        self._queued_bytes += need_bytes

        def run() -> T:
            try:
                return fn()
            finally:
                self._placed_bytes += need_bytes  # the worker thread is this counter's only writer

        # Every caller is an acquire: the turn's generation job follows, and should join the next step.
        return self.worker.submit(run, then_job=True)

    def _committed_bytes(self) -> int:
        """The pool's used bytes plus the room taken for engine work not run yet (an overestimate for a
        moment while the work finishes, never an underestimate: the placed count is read first)."""
        placed = self._placed_bytes
        return self.pool.used_bytes + self._queued_bytes - placed

    async def _make_room(self, need_bytes: int, *, protect: set[str] | tuple[()]) -> None:
        """Evict until ``need_bytes`` more fit. Called with ``self._room`` held."""
        deadline = self.clock() + ROOM_WAIT_S
        while True:
            used = self._committed_bytes()
            if used + need_bytes <= self.budget_bytes:
                return  # it fits: no need to weigh every resident session's blocks
            victims = policy.choose_victims(self._records(), need_bytes=need_bytes, used_bytes=used,
                                            budget_bytes=self.budget_bytes, protect=protect)
            if victims == []:
                return
            if victims is None:
                remaining = deadline - self.clock()
                if remaining <= 0:
                    raise ContextLengthExceeded("the KV cache budget is held by running generations; try again")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), timeout=min(remaining, ROOM_RECHECK_S))
                continue
            # Victims are marked busy (their I/O is in flight) before the lock is released, so nobody
            # else picks them, and their bytes stay counted until they are freed. Other sessions'
            # turns that fit the budget can start meanwhile.
            evictions = [self._evict(session_id, reason="room") for session_id in victims]
            self._room.release()
            try:
                await asyncio.gather(*evictions)
            finally:
                await self._room.acquire()

    def _evict(self, session_id: str, *, reason: EvictionReason) -> Awaitable[bool]:
        """Snapshot (unless already on disk) and free one idle cache; resolves to whether it did.

        The entry is marked busy synchronously, before this returns, so a caller may release the
        room lock right after. When the snapshot cannot be written, an eviction for room frees the
        cache anyway (the session recomputes later); any other eviction keeps it resident."""
        entry = self._entries.get(session_id)
        if entry is None or entry.busy or entry.io is not None:
            return _resolved(False)
        if entry.persisted or entry.ephemeral or self.snapshots is None or not entry.cached_ids:
            self._evicted(entry, reason)
            return _resolved(True)
        return self._evict_after_write(entry, self._start_io(entry, self._persist(entry)), reason)

    async def _evict_after_write(self, entry: _Entry, write: asyncio.Task[bool], reason: EvictionReason) -> bool:
        ok = await self._wait_task(write)
        if entry.busy or self._entries.get(entry.session_id) is not entry:
            return False  # a turn claimed it meanwhile; the snapshot stays valid as a prefix
        if not ok and reason != "room":
            return False
        self._evicted(entry, reason)
        return True

    def _evicted(self, entry: _Entry, reason: EvictionReason) -> None:
        # The released blocks stay findable by their tokens (for any session) until their room is needed.
        # A session evicted for room or idleness that comes back before then is made from them
        # (_try_restore); one an operator evicted comes back from its snapshot, as asked.
        self._forget(entry)
        if reason == "admin":
            self._to_disk.add(entry.session_id)
        self.counters.count_eviction(entry.session_id, reason)

    def _forget(self, entry: _Entry, *, forget_blocks: bool = False) -> None:
        """Drop the entry and free its cache; ``forget_blocks`` (a deleted session) also unregisters the
        blocks nobody else holds, instead of keeping them findable by hash."""
        if self._entries.get(entry.session_id) is entry:
            del self._entries[entry.session_id]
        cache = entry.cache
        self._tasks.spawn(self._give_back(lambda: cache.free(forget=forget_blocks)))

    # ------------------------------------------------------------------ snapshots

    async def _wait_io(self, session_id: str) -> None:
        while (entry := self._entries.get(session_id)) is not None and entry.io is not None:
            await self._wait_task(entry.io)

    @staticmethod
    async def _wait_task(task: asyncio.Task[bool]) -> bool:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("snapshot I/O failed")
            return False

    def _start_io(self, entry: _Entry, work: Awaitable[bool]) -> asyncio.Task[bool]:
        """Run snapshot I/O for ``entry``; while it runs the entry is busy (never evicted, and a turn
        waits before touching its cache). ``entry.io`` is cleared before waiters wake."""
        async def run() -> bool:
            try:
                return await work
            finally:
                entry.io = None

        entry.io = asyncio.ensure_future(run())
        return entry.io

    async def _persist(self, entry: _Entry) -> bool:
        assert self.restorer is not None
        ids = list(entry.cached_ids)
        if not await self.restorer.write(entry.session_id, entry.cache, ids):
            return False
        entry.persisted = entry.cached_ids == ids
        return True

    async def _try_restore(self, session_id: str, prompt: tuple[int, ...], capacity: int, *,
                           reuse_limit: int) -> Lease | None:
        """Restore the snapshot's longest prefix shared with ``prompt`` (at most ``reuse_limit``
        positions). None when there is no usable snapshot or recomputing is estimated cheaper."""
        from_disk = session_id in self._to_disk  # an operator evicted it: the snapshot, not the pool
        self._to_disk.discard(session_id)
        restorer = self.restorer
        if restorer is None:
            return None
        started = self.clock()
        found = await restorer.find(session_id, prompt, min_tokens=self.settings.restore_min_tokens,
                                    reuse_limit=reuse_limit)
        if found is None:
            return None
        need = max(capacity, len(found.snapshot_ids))
        await self._make_room(need * self.bytes_per_token, protect=())
        if self.settings.share_prefixes and not from_disk:
            pooled = await restorer.from_pool(found, capacity)
            if pooled is not None:
                cache, length = pooled
                self._entries[session_id] = _Entry(session_id, cache, list(found.snapshot_ids[:length]), self.clock(),
                                                   busy=True)
                return Lease.of(session_id, cache, prompt, length)
        cache = await restorer.new_cache(need)
        entry = _Entry(session_id, cache, [], self.clock(), busy=True)
        self._entries[session_id] = entry
        if not await restorer.from_file(session_id, found, cache):
            return Lease.of(session_id, cache, prompt, 0)
        entry.cached_ids = list(found.snapshot_ids[:found.reuse])
        elapsed = self.clock() - started
        self.counters.count_restore(elapsed)
        return Lease.of(session_id, cache, prompt, found.reuse, restore_ms=round(elapsed * 1000, 2))

    # ------------------------------------------------------------------ operator actions

    async def evict(self, session_id: str) -> bool:
        """Snapshot (when not on disk yet) and free the session's cache. False when it is not resident
        or is generating."""
        await self._wait_io(session_id)
        evicted = await self._evict(session_id, reason="admin")
        await self._notify_room()
        return evicted

    async def restore(self, session_id: str, conversation_ids: Sequence[int]) -> Tier:
        """Bring a session's cache back ahead of its next turn (resume, admin restore)."""
        if session_id in self._entries or session_id in self._arriving:
            return "device"
        prompt = tuple(conversation_ids)
        if not prompt:
            return "none"
        async with self._room:
            if session_id in self._entries or session_id in self._arriving:
                return "device"
            lease = await self._try_restore(session_id, prompt, len(prompt) + SPARE_TOKENS,
                                            reuse_limit=len(prompt))
            if lease is None:
                return "none"
        self.release(lease)
        entry = self._entries.get(session_id)
        if entry is not None:
            # The snapshot starts with exactly these ids: evicting again needs no write.
            entry.persisted = lease.num_cached > 0
            entry.restored_ms = lease.restore_ms
        return "device"

    async def drop(self, session_id: str) -> None:
        """Forget a session entirely (delete): cache freed and snapshot deleted."""
        await self._wait_io(session_id)
        entry = self._entries.get(session_id)
        if entry is not None:
            self._forget(entry, forget_blocks=True)
        self._to_disk.discard(session_id)
        if self.snapshots is not None:
            await self.snapshots.delete(session_id)
        await self._notify_room()

    # ------------------------------------------------------------------ background

    def start(self, interval_s: float = 2.0) -> None:
        if self._background is None:
            self._background = asyncio.ensure_future(self._background_loop(interval_s))

    async def stop(self) -> None:
        """Stop background maintenance and wait for snapshot I/O and the frees and trims already
        handed to the worker, so the worker can be stopped right after :meth:`persist_all`."""
        if self._background is not None:
            self._background.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._background
            self._background = None
        for entry in list(self._entries.values()):
            if entry.io is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(entry.io)
        await self._tasks.join()

    async def persist_all(self) -> int:
        """Snapshot every idle resident session not on disk yet (graceful shutdown). Returns how many."""
        count = 0
        for session_id in policy.persist_candidates(self._records(with_bytes=False), now=float("inf"), idle_s=1.0):
            entry = self._entries.get(session_id)
            if entry is not None and not entry.busy and entry.io is None and entry.cached_ids:
                count += await self._wait_task(self._start_io(entry, self._persist(entry)))
        return count

    async def tick(self) -> None:
        """One round of background work: persist idle sessions, evict long-idle ones."""
        if self.snapshots is None:
            return
        now = self.clock()
        for session_id in policy.persist_candidates(self._records(with_bytes=False), now=now,
                                                      idle_s=self.settings.persist_idle_s):
            entry = self._entries.get(session_id)
            if entry is not None and not entry.busy and entry.io is None and entry.cached_ids:
                await self._wait_task(self._start_io(entry, self._persist(entry)))
        for session_id in policy.idle_victims(self._records(with_bytes=False), now=now,
                                              idle_s=self.settings.idle_evict_s):
            await self._wait_io(session_id)
            if await self._evict(session_id, reason="idle"):
                await self._notify_room()

    async def _background_loop(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.tick()
            except Exception:
                log.exception("background cache maintenance failed")


async def _resolved(value: bool) -> bool:
    return value
