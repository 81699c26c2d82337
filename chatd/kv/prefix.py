"""Which cached prefix a prompt can reuse: pure functions over token ids (no I/O, no tensors)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def reusable_prefix(cached_ids: Sequence[int], prompt_ids: Sequence[int]) -> int:
    """How many cached positions a prompt can reuse: the longest common prefix, but always leaving at
    least one prompt token to prefill (its logits start the reply)."""
    return min(common_prefix_len(cached_ids, prompt_ids), max(len(prompt_ids) - 1, 0))


def agrees_at(cached_ids: Sequence[int], prompt_ids: Sequence[int], need: int) -> bool:
    """Whether both hold ``need`` ids and agree at the last of them (true for ``need`` <= 0): what a cache
    must do to share ``need`` or more positions with the prompt. One lookup, so a search over many caches
    compares whole prefixes only where it holds (:func:`longest_reusable`, chatd.service.pool.PrefixPool.choose)."""
    if need <= 0:
        return True
    return min(len(cached_ids), len(prompt_ids)) >= need and cached_ids[need - 1] == prompt_ids[need - 1]


def longest_reusable(candidates: Iterable[tuple[T, Sequence[int]]], prompt_ids: Sequence[int],
                     min_tokens: int) -> tuple[T | None, int]:
    """Of ``candidates`` (key, cached ids), the first whose ``reusable_prefix`` with the prompt is the
    longest, if that is at least ``min_tokens``: (key, its length), else (None, 0).

    Only a candidate that agrees with the prompt at the position just past the best length so far can
    beat it, so that one id is looked at first and the whole prefix compared only where it agrees. Where
    many sessions share a long system prompt and then diverge, a search costs one full comparison and a
    lookup per other session, where comparing each whole prefix cost its length each (the turn start of
    a new session, on the event loop, grew with the resident sessions times the prompt)."""
    limit = max(len(prompt_ids) - 1, 0)  # reusable_prefix never exceeds it
    best: T | None = None
    best_len = min_tokens - 1
    for key, ids in candidates:
        if best_len >= limit:
            break  # nothing can beat it
        if not agrees_at(ids, prompt_ids, best_len + 1):
            continue
        shared = reusable_prefix(ids, prompt_ids)
        if shared > best_len:
            best, best_len = key, shared
    return (best, best_len) if best is not None else (None, 0)
