"""The KV manager's snapshot work: write a session's cache to its snapshot, and bring a cache back from the
snapshot's file or from the session's blocks still in the pool.

:class:`CacheRestorer` carries these out and keeps nothing of the sessions: the manager (chatd.kv.manager) decides
when to write, whether to restore and when the room is there, and keeps the books (its entries, their leases).
Tensor work runs on the engine thread (``worker.call``), file work in the snapshot service's I/O thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from chatd.counters import Counters
from chatd.engine.pool.kvcache import SessionKV
from chatd.errors import SnapshotError
from chatd.kv import policy
from chatd.kv.persistence import SnapshotService, finish_restore, restore_targets
from chatd.kv.prefix import common_prefix_len

if TYPE_CHECKING:
    from chatd.engine.worker import EngineWorker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restorable:
    """A snapshot worth restoring for a prompt: its token ids and how many of them the prompt reuses."""

    snapshot_ids: tuple[int, ...]
    reuse: int


class CacheRestorer:
    """Snapshot writes and restores for the KV manager. Event loop only (it hands tensor work to the worker)."""

    def __init__(self, worker: EngineWorker, snapshots: SnapshotService, counters: Counters) -> None:
        self.worker = worker
        self.snapshots = snapshots
        self.counters = counters

    async def write(self, session_id: str, cache: SessionKV, ids: Sequence[int]) -> bool:
        """Snapshot the first ``len(ids)`` positions of ``cache`` (which hold ``ids``); whether it was written. The
        caller guarantees nothing changes those positions until this returns. A failed write is counted and
        logged; the session stays resident."""
        layers = await self.worker.call(lambda: export_layers(cache))
        try:
            await self.snapshots.save(session_id, ids, layers)
        except (OSError, SnapshotError) as exc:
            self.counters.num_snapshot_write_failures += 1
            log.warning("snapshot of session %s failed, it stays in memory: %s", session_id[:8], exc)
            return False
        self.counters.num_snapshot_writes += 1
        return True

    async def find(self, session_id: str, prompt: Sequence[int], *, min_tokens: int,
                   reuse_limit: int) -> Restorable | None:
        """The session's snapshot when it is worth restoring for ``prompt``: it exists, restoring is estimated
        cheaper than recomputing (:func:`chatd.kv.policy.prefer_restore`), and it shares at least ``min_tokens``
        (and 1) leading ids with ``prompt``, at most ``reuse_limit`` of them reused. An unreadable snapshot is
        deleted (and counted as a failed restore); None then too."""
        record = await self.snapshots.record(session_id)
        if record is None:
            return None
        if not policy.prefer_restore(num_tokens=record.num_tokens, file_bytes=record.file_bytes,
                                     cost=self.snapshots.cost, min_tokens=min_tokens):
            return None
        try:
            snapshot_ids = await self.snapshots.read_ids(session_id)
        except (OSError, SnapshotError) as exc:
            log.warning("snapshot of session %s unusable, recomputing: %s", session_id[:8], exc)
            self.counters.num_restore_failures += 1
            await self.snapshots.delete(session_id)
            return None
        reuse = min(common_prefix_len(snapshot_ids, prompt), reuse_limit)
        if reuse < max(min_tokens, 1):
            return None
        return Restorable(tuple(snapshot_ids), reuse)

    async def from_pool(self, found: Restorable, capacity: int) -> tuple[SessionKV, int] | None:
        """A new cache reserved to ``capacity`` made of the pool's blocks that still hold the reused prefix (an idle
        eviction leaves them findable by their tokens until their room is needed), with how many positions it
        holds; None when the pool no longer holds every full block of it (nothing is read then)."""
        ids = found.snapshot_ids[:found.reuse]
        pooled = await self.worker.call(lambda: _adopt_if_pooled(self.worker, ids, capacity))
        if pooled is not None:
            self.counters.num_resumes_from_pool += 1
            self.counters.num_prefix_shared_tokens += pooled[1]
        return pooled

    async def new_cache(self, capacity: int) -> SessionKV:
        """An empty cache reserved to ``capacity`` positions."""
        return await self.worker.call(lambda: _new_reserved(self.worker, capacity))

    async def from_file(self, session_id: str, found: Restorable, cache: SessionKV) -> bool:
        """Read the snapshot into ``cache`` (empty, reserved) and cut it to the reused prefix; whether it worked. On
        failure the snapshot is deleted, the failure counted and ``cache`` left empty (the turn recomputes)."""
        snapshots = self.snapshots
        snapshot_ids = found.snapshot_ids
        try:
            read_started = time.monotonic()
            targets = await self.worker.call(lambda: restore_targets(cache, snapshot_ids, snapshots.fingerprint))
            file_bytes = await snapshots.read_into(session_id, snapshot_ids, targets)
            await self.worker.call(lambda: finish_restore(cache, targets))
            snapshots.observe_restore(file_bytes, time.monotonic() - read_started)
        except (OSError, SnapshotError) as exc:
            log.warning("restore of session %s failed, recomputing: %s", session_id[:8], exc)
            self.counters.num_restore_failures += 1
            await snapshots.delete(session_id)

            def empty() -> None:
                cache.abort()
                cache.truncate(0)

            await self.worker.call(empty)
            return False
        await self.worker.call(lambda: cache.truncate(found.reuse))
        return True


def _adopt_if_pooled(worker: EngineWorker, token_ids: Sequence[int], capacity: int) -> tuple[SessionKV, int] | None:
    """Engine thread. A new cache made of the pool's registered blocks for ``token_ids`` and reserved to
    ``capacity``, with how many positions it holds, when the pool holds every full block of them; else
    None, and nothing changes."""
    allocator = worker.runner.pool.allocator
    full = len(token_ids) // allocator.block_size * allocator.block_size
    if full == 0 or allocator.cached_prefix_len(token_ids) < full:
        return None
    cache = worker.runner.new_cache()
    try:
        length = cache.adopt_cached_prefix(token_ids, len(token_ids))
        cache.reserve(capacity)
    except BaseException:
        cache.free()
        raise
    return cache, length


def _new_reserved(worker: EngineWorker, capacity: int) -> SessionKV:
    cache = worker.runner.new_cache()
    cache.reserve(capacity)
    return cache


def export_layers(cache: SessionKV) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``[kv_heads, length, head_dim]`` K/V for a snapshot, on the CPU. Worker thread only.

    On the CPU these are views of the live buffers (no copy): the manager guarantees nothing writes
    below ``length`` while the snapshot I/O runs. On an accelerator they are host copies."""
    layers = cache.filled_layers()
    if cache.device.type == "cpu":
        return list(layers)
    return [(k.to("cpu"), v.to("cpu")) for k, v in layers]
