"""The running totals: one :class:`Counters` per process, the one home of every total.

The part that sees an event increments its field (the KV manager its evictions and restores, the snapshot service
the bytes it wrote, the engine thread its steps, the turn runner each finished turn); the service's stats read model
(:mod:`chatd.service.stats`) copies them at one moment. A leaf module: it imports nothing of chatd, so the engine
and the KV layer can hold the counters without depending on what reads them.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Final, Literal

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

    # Written by the turn runner (chatd/service/turns.py) as each reply is committed.
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
