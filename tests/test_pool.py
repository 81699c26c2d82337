"""PrefixPool: which ephemeral cache a stateless request runs in (pure: a stand-in for the KV manager)."""

from __future__ import annotations

from typing import Any, cast

from chatd.kv.manager import KVManager
from chatd.pool import PrefixPool


class FakeKV:
    def __init__(self) -> None:
        self.caches: dict[str, list[int]] = {}

    def is_resident(self, cache_id: str) -> bool:
        return cache_id in self.caches

    def cached_ids(self, cache_id: str) -> list[int] | None:
        return self.caches.get(cache_id)


def _pool() -> tuple[PrefixPool, FakeKV]:
    kv = FakeKV()
    return PrefixPool(cast(KVManager, kv)), kv


def _run(pool: PrefixPool, kv: FakeKV, prompt: list[int], reply: list[int], partition: str = "a",
         busy: Any = lambda _: False) -> str:
    """Choose a cache for ``prompt`` and leave it holding prompt + reply (minus the last token), as a turn does."""
    cache_id = pool.choose(prompt, partition, busy=busy)
    kv.caches[cache_id] = [*prompt, *reply][:-1]
    return cache_id


def test_a_resent_conversation_runs_in_the_cache_it_left() -> None:
    pool, kv = _pool()
    first = _run(pool, kv, [1, 2, 3], [10, 11, 12])
    assert _run(pool, kv, [1, 2, 3, 10, 11, 12, 4, 5], [13, 14]) == first
    assert len(pool) == 1


def test_a_reply_that_tokenises_differently_still_takes_the_cache_over() -> None:
    pool, kv = _pool()
    first = _run(pool, kv, [1, 2, 3], [10, 11, 12])
    # The client resent the reply's text, which tokenised to other ids: only the reply differs.
    assert _run(pool, kv, [1, 2, 3, 10, 99, 4, 5], [13]) == first


def test_another_conversation_sharing_only_a_prefix_gets_its_own_cache() -> None:
    pool, kv = _pool()
    first = _run(pool, kv, [1, 2, 3, 4], [10, 11])
    second = _run(pool, kv, [1, 2, 7, 8], [12, 13])
    assert second != first
    assert kv.caches[first] == [1, 2, 3, 4, 10]  # not cut by the other conversation
    assert _run(pool, kv, [1, 2, 3, 4, 10, 11, 5], [14]) == first


def test_other_callers_and_busy_caches_are_never_taken_over() -> None:
    pool, kv = _pool()
    first = _run(pool, kv, [1, 2, 3], [10, 11])
    assert _run(pool, kv, [1, 2, 3, 10, 11, 4], [12], partition="b") != first
    assert _run(pool, kv, [1, 2, 3, 10, 11, 4], [12], busy=lambda c: c == first) != first


def test_evicted_caches_are_forgotten() -> None:
    pool, kv = _pool()
    first = _run(pool, kv, [1, 2, 3], [10, 11])
    del kv.caches[first]
    assert _run(pool, kv, [1, 2, 3, 10, 11, 4], [12]) != first
    assert not pool.owns(first)
