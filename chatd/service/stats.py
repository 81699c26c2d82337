"""The stats read model: the tier rule and a frozen picture of chatd's state and totals.

* :class:`Tiers` holds the one rule that says which tier a session's cache is in.
* :func:`build_stats` builds a :class:`Stats` from the running totals (:class:`chatd.counters.Counters`), the KV
  manager and the snapshot service; the admin API and /metrics only render it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chatd.counters import Counters
from chatd.domain import Tier

if TYPE_CHECKING:
    from chatd.engine.model.runner import ModelInfo
    from chatd.kv.manager import KVManager
    from chatd.kv.persistence import SnapshotService

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
    architecture: str = ""
    parameters: int = 0
    weights_from: str = ""
    """Where the running weights came from (a GGUF's blocks as they are, quantised on load, the source's own)."""


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


def model_facts(info: ModelInfo) -> ModelFacts:
    """What the loaded model is and how it runs."""
    return ModelFacts(name=info.name, dtype=info.dtype_name, device=str(info.device),
                      max_context=info.max_context, kv_bytes_per_token=info.bytes_per_token, weights=info.weights,
                      cpu_features=info.cpu_features, kernels=info.kernels, architecture=info.architecture,
                      parameters=info.parameters, weights_from=info.weights_from)


def build_stats(*, counters: Counters, tiers: Tiers, kv: KVManager, snapshots: SnapshotService, info: ModelInfo,
             num_generating: int, num_sessions: int | None) -> Stats:
    """Build the :class:`Stats` of this moment. Call it on the event loop: it reads the KV manager's and
    the snapshot service's state without awaiting, so one :class:`Stats` never mixes two moments."""
    counts = tiers.counts()
    uses = (TierUse("device", kv.budget_bytes, kv.resident_bytes, counts["device"]),
            TierUse("disk", snapshots.disk_budget_bytes, snapshots.disk_bytes, counts["disk"]))
    model = model_facts(info)
    blocks = kv.pool.stats()
    pool = PoolFacts(block_size=blocks.block_size, num_blocks=blocks.num_blocks, used_blocks=blocks.num_used_blocks,
                     cached_blocks=blocks.num_cached_blocks, shared_blocks=blocks.num_shared_blocks,
                     unique_bytes=blocks.num_used_blocks * kv.pool.bytes_per_block,
                     logical_bytes=blocks.num_logical_tokens * kv.pool.bytes_per_token, hit_ratio=blocks.hit_ratio,
                     populated=kv.pool.populated)
    return Stats(model=model, tiers=uses, pool=pool, num_sessions=num_sessions, num_generating=num_generating,
                 counters=counters.copy())
