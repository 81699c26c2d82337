"""The stats read-model: the running totals, the tier rule, and a frozen picture of both.

* :class:`Counters` is the one home of every running total. The part that sees an event increments
  its field (the KV manager its evictions and restores, the snapshot service the bytes it wrote, the
  engine thread its steps, the core each finished turn); only :func:`build_stats` reads them.
* :class:`Tiers` holds the one rule that says which tier a session's cache is in.
* :func:`build_stats` builds a :class:`Stats`, which the admin API and /metrics only render.

At run time this module imports nothing of chatd but :mod:`chatd.domain`, so the engine and the KV
layer can hold a :class:`Counters` without depending on the parts they are read beside.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Literal

from chatd.domain import Tier

if TYPE_CHECKING:
    from chatd.engine.model.runner import ModelInfo
    from chatd.kv.manager import KVManager
    from chatd.kv.persistence import SnapshotService

# How many recent restore times and evictions are kept (for the mean restore time and for tests).
RECENT: Final = 1000

EvictionReason = Literal["room", "idle", "admin"]
"""Why a cache left memory: another turn needed the budget, it sat idle, or an operator asked."""


@dataclass
class Counters:
    """Running totals since the process started; they only grow.

    Each group of fields has one writer, named above it. The engine's fields are written on the
    engine thread, every other field on the event loop. Read them through :func:`build_stats`, which
    copies them at one moment, rather than field by field.
    """

    # Written by the turn runner (chatd/turns.py) as each reply is committed.
    num_turns: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens whose K/V came from a cache (device or snapshot)."""
    num_prefill_tokens: int = 0
    """Prompt tokens that had to be computed."""

    # Written by the KV manager.
    num_evictions: int = 0
    num_evictions_idle: int = 0
    num_evictions_for_room: int = 0
    num_restores: int = 0
    num_restore_failures: int = 0
    """Snapshots rejected or unreadable: those sessions recomputed instead."""
    num_snapshot_writes: int = 0
    num_snapshot_write_failures: int = 0
    num_prefix_shares: int = 0
    """Caches started from another resident session's prefix (a copy of its K/V)."""
    num_prefix_shared_tokens: int = 0
    num_resumes_from_pool: int = 0
    """Evicted sessions whose cache came back from blocks still in the KV pool, with no snapshot read."""
    restore_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    """The most recent restore times, oldest first."""
    eviction_log: deque[tuple[str, EvictionReason]] = field(default_factory=lambda: deque(maxlen=RECENT))
    """The most recent evictions, oldest first: ``(session_id, reason)``."""

    # Written by the snapshot service.
    num_snapshot_bytes_written: int = 0
    num_snapshots_deleted_for_budget: int = 0
    """Snapshots deleted, oldest first, to keep the disk tier within its budget."""

    # Written by the engine thread.
    num_engine_prefill_tokens: int = 0
    num_engine_decode_tokens: int = 0
    num_engine_decode_steps: int = 0
    """Batched decode steps; each decodes one token for every session in the batch."""

    def count_turn(self, *, cached_tokens: int, prefill_tokens: int) -> None:
        """One reply committed, whose prompt had ``cached_tokens + prefill_tokens`` tokens."""
        self.num_turns += 1
        self.num_cached_tokens += cached_tokens
        self.num_prefill_tokens += prefill_tokens

    def count_eviction(self, session_id: str, reason: EvictionReason) -> None:
        """One cache left memory (whether or not a snapshot was written first)."""
        self.num_evictions += 1
        self.eviction_log.append((session_id, reason))
        if reason == "idle":
            self.num_evictions_idle += 1
        elif reason == "room":
            self.num_evictions_for_room += 1

    def count_restore(self, seconds: float) -> None:
        """One cache restored from its snapshot in ``seconds``."""
        self.num_restores += 1
        self.restore_seconds.append(seconds)

    def copy(self) -> Counters:
        """An independent copy: later events change neither its totals nor its recent samples."""
        return dataclasses.replace(self, restore_seconds=deque(self.restore_seconds, maxlen=RECENT),
                                   eviction_log=deque(self.eviction_log, maxlen=RECENT))


class Tiers:
    """Where each session's cache is, read live from the KV manager and the snapshot service.

    This is the only place the tier rule is written; everything that reports a tier asks here.
    """

    def __init__(self, kv: KVManager, snapshots: SnapshotService | None) -> None:
        self._kv = kv
        self._snapshots = snapshots

    def tier(self, session_id: str) -> Tier:
        """``"device"`` while the cache is resident, else ``"disk"`` while a snapshot exists, else
        ``"none"`` (also for an unknown session). A resident cache wins over its snapshot, which may
        be older or shorter. Nothing chatd runs today is in ``"host"``."""
        if self._kv.is_resident(session_id):
            return "device"
        if self._snapshots is not None and self._snapshots.has(session_id):
            return "disk"
        return "none"

    def cached_session_ids(self) -> set[str]:
        """Sessions with a cache in some tier; every session not in this set is in ``"none"``."""
        ids = set(self._kv.resident_ids())
        if self._snapshots is not None:
            ids.update(self._snapshots.records())
        return ids

    def counts(self) -> Counter[Tier]:
        """How many sessions each tier holds, ``"none"`` left out (the store knows every session)."""
        return Counter(self.tier(session_id) for session_id in self.cached_session_ids())


@dataclass(frozen=True)
class ModelFacts:
    name: str
    dtype: str
    device: str
    max_context: int
    kv_bytes_per_token: int
    """KV bytes of one position over all layers (K and V), in the model's dtype."""
    weights: str
    """How the weights run (``q4``, ``float32``, ``transformers``, ...)."""
    cpu_features: tuple[str, ...]
    """The CPU features the engine chose its paths by; empty on a GPU."""
    kernels: str | None
    """The native kernels' tile matmul in use, ``none``, or None without native kernels."""


@dataclass(frozen=True)
class TierUse:
    tier: Tier
    budget_bytes: int
    used_bytes: int
    """Device: allocated KV bytes of resident caches. Disk: compressed snapshot files."""
    num_sessions: int


@dataclass(frozen=True)
class PoolFacts:
    """The device's paged KV pool: blocks by state, what sharing saves, how often prompts hit it."""

    block_size: int
    num_blocks: int
    used_blocks: int
    """Blocks held by sessions (reserved room included)."""
    cached_blocks: int
    """Blocks nobody holds that stay findable by their tokens until the room is needed."""
    shared_blocks: int
    """Used blocks held by more than one session."""
    unique_bytes: int
    """Bytes of the used blocks, each counted once."""
    logical_bytes: int
    """Bytes the sessions' tokens would take without sharing."""
    hit_ratio: float
    """Of the prompt tokens looked up in the pool when a cache starts, the share found there."""
    populated: bool
    """False while a thread still faults the pool's pages in ahead of use (huge pages); steps meanwhile may
    wait for page faults and share the cores with it."""


@dataclass(frozen=True)
class Stats:
    """chatd's state and totals at one moment. Nothing in it changes after it is built."""

    model: ModelFacts
    tiers: tuple[TierUse, ...]
    """The tiers that have a budget, device first, then disk."""
    pool: PoolFacts
    num_sessions: int | None
    """Stored sessions; None when these stats were built without reading the store."""
    num_generating: int
    counters: Counters
    """A private copy, taken when these stats were built."""

    def tier_use(self, tier: Tier) -> TierUse:
        """The use of ``tier``; KeyError for a tier without a budget."""
        for use in self.tiers:
            if use.tier == tier:
                return use
        raise KeyError(tier)

    @property
    def cached_token_ratio(self) -> float:
        """Share of prompt tokens served from a cache, 0.0 before the first turn."""
        prompt_tokens = self.counters.num_cached_tokens + self.counters.num_prefill_tokens
        return self.counters.num_cached_tokens / prompt_tokens if prompt_tokens else 0.0

    @property
    def restore_ms_mean(self) -> float | None:
        """Mean of the recent restore times in milliseconds; None before the first restore."""
        recent = self.counters.restore_seconds
        return 1000 * sum(recent) / len(recent) if recent else None


def build_stats(*, counters: Counters, tiers: Tiers, kv: KVManager, snapshots: SnapshotService, info: ModelInfo,
             num_generating: int, num_sessions: int | None) -> Stats:
    """Build the :class:`Stats` of this moment. Call it on the event loop: it reads the KV manager's and
    the snapshot service's state without awaiting, so one :class:`Stats` never mixes two moments."""
    counts = tiers.counts()
    uses = (TierUse("device", kv.budget_bytes, kv.resident_bytes, counts["device"]),
            TierUse("disk", snapshots.disk_budget_bytes, snapshots.disk_bytes, counts["disk"]))
    model = ModelFacts(name=info.name, dtype=info.dtype_name, device=str(info.device),
                       max_context=info.max_context, kv_bytes_per_token=info.bytes_per_token, weights=info.weights,
                       cpu_features=info.cpu_features, kernels=info.kernels)
    blocks = kv.pool.stats()
    pool = PoolFacts(block_size=blocks.block_size, num_blocks=blocks.num_blocks, used_blocks=blocks.num_used_blocks,
                     cached_blocks=blocks.num_cached_blocks, shared_blocks=blocks.num_shared_blocks,
                     unique_bytes=blocks.num_used_blocks * kv.pool.bytes_per_block,
                     logical_bytes=blocks.num_logical_tokens * kv.pool.bytes_per_token, hit_ratio=blocks.hit_ratio,
                     populated=kv.pool.populated)
    return Stats(model=model, tiers=uses, pool=pool, num_sessions=num_sessions, num_generating=num_generating,
                 counters=counters.copy())
