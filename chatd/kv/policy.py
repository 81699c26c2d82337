"""Eviction and restore decisions: pure functions of (records, now, budget). No torch, no I/O."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheRecord:
    """What the policy knows about one resident cache."""

    session_id: str
    num_bytes: int
    last_used: float
    busy: bool
    """Generating, or in the middle of snapshot I/O: never a victim."""
    persisted: bool
    """A snapshot on disk holds exactly this cache, so evicting it costs no write."""


def choose_victims(records: Sequence[CacheRecord], *, need_bytes: int, used_bytes: int, budget_bytes: int,
                   protect: Collection[str] = ()) -> list[str] | None:
    """Least-recently-used idle caches to evict so that ``used + need <= budget``.

    Returns [] when it already fits, None when even evicting every idle cache would not make room
    (the caller must wait for busy sessions or refuse). Busy and protected sessions are never chosen.
    """
    if used_bytes + need_bytes <= budget_bytes:
        return []
    candidates = sorted(
        (r for r in records if not r.busy and r.session_id not in protect),
        key=lambda r: (r.last_used, r.session_id),
    )
    victims: list[str] = []
    freed = 0
    for record in candidates:
        victims.append(record.session_id)
        freed += record.num_bytes
        if used_bytes - freed + need_bytes <= budget_bytes:
            return victims
    return None


def idle_victims(records: Sequence[CacheRecord], *, now: float, idle_s: float) -> list[str]:
    """Idle caches unused for at least ``idle_s`` seconds, oldest first (0 disables)."""
    if idle_s <= 0:
        return []
    old = [r for r in records if not r.busy and now - r.last_used >= idle_s]
    return [r.session_id for r in sorted(old, key=lambda r: r.last_used)]


def persist_candidates(records: Sequence[CacheRecord], *, now: float, idle_s: float) -> list[str]:
    """Idle caches not yet on disk, unused for ``idle_s`` seconds: snapshot them and keep them resident,
    so a crash keeps them restorable and a later eviction is free (0 disables)."""
    if idle_s <= 0:
        return []
    due = [r for r in records if not r.busy and not r.persisted and now - r.last_used >= idle_s]
    return [r.session_id for r in sorted(due, key=lambda r: r.last_used)]


@dataclass(frozen=True)
class CostModel:
    """Throughputs observed on this machine, used to choose restore vs recompute."""

    prefill_tokens_per_s: float
    restore_bytes_per_s: float
    """Snapshot file bytes read and decoded per second."""

    def restore_s(self, file_bytes: int) -> float:
        return file_bytes / max(self.restore_bytes_per_s, 1.0)

    def recompute_s(self, num_tokens: int) -> float:
        return num_tokens / max(self.prefill_tokens_per_s, 1e-3)


def prefer_restore(*, num_tokens: int, file_bytes: int, cost: CostModel, min_tokens: int) -> bool:
    """Restore a snapshot of ``num_tokens`` unless the history is short or recomputing is cheaper."""
    if num_tokens < max(min_tokens, 1):
        return False
    return cost.restore_s(file_bytes) < cost.recompute_s(num_tokens)


def update_rate(previous: float, observed: float, weight: float = 0.3) -> float:
    """Exponential moving average of a throughput; ignores non-positive observations."""
    if observed <= 0:
        return previous
    return (1 - weight) * previous + weight * observed
