"""PrefixPool: which ephemeral cache a stateless request runs in (pure: a stand-in for the KV manager)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, cast

import pytest

from chatd.kv.manager import KVManager
from chatd.kv.prefix import common_prefix_len
from chatd.service import pool as pool_module
from chatd.service.pool import PrefixPool


class FakeKV:
    def __init__(self) -> None:
        self.caches: dict[str, list[int]] = {}

    def is_resident(self, cache_id: str) -> bool:
        return cache_id in self.caches

    def cached_ids(self, cache_id: str) -> list[int] | None:
        return self.caches.get(cache_id)

    def cached_ids_view(self, cache_id: str) -> list[int] | None:
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


def test_the_choice_is_the_cache_continued_furthest_of_all_the_callers_caches() -> None:
    """Against the rule applied to every cache whole: the idle cache of the caller sharing the longest
    prefix with the prompt, at least the whole prompt that last ran in it."""
    rng = random.Random(3)
    for case in range(300):
        pool, kv = _pool()
        base = [rng.randrange(3) for _ in range(rng.randrange(1, 30))]
        for _ in range(rng.randrange(0, 10)):
            prompt = base[:rng.randrange(1, len(base) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 5))]
            _run(pool, kv, prompt, [rng.randrange(3) for _ in range(rng.randrange(1, 5))],
                 partition=rng.choice("ab"))
        prompt = base[:rng.randrange(0, len(base) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
        best, best_len = None, 0
        for cache_id, (owner, last_len) in pool._owners.items():
            shared = common_prefix_len(kv.caches[cache_id], prompt)
            if owner == "a" and shared >= last_len and shared > best_len:
                best, best_len = cache_id, shared
        chosen = pool.choose(prompt, "a", busy=lambda _: False)
        assert chosen == best if best is not None else chosen not in kv.caches, case


def test_a_request_compares_whole_only_the_caches_that_could_be_continued(monkeypatch: pytest.MonkeyPatch) -> None:
    """One caller with 500 conversations behind one 1,000-token system prompt: a request continuing one
    of them compares that one whole, not all 500 (each request used to copy and compare every cache of
    its caller, on the event loop)."""
    rng = random.Random(9)
    pool, kv = _pool()
    system = [rng.randrange(49152) for _ in range(1000)]
    conversations = []
    for i in range(500):
        prompt = [*system, i, *(rng.randrange(49152) for _ in range(20))]
        conversations.append((_run(pool, kv, prompt, [7, 8, 9]), prompt))
    compared: list[int] = []

    def counting(a: Sequence[int], b: Sequence[int]) -> int:
        compared.append(1)
        return common_prefix_len(a, b)

    monkeypatch.setattr(pool_module, "common_prefix_len", counting)
    cache_id, prompt = conversations[321]
    assert _run(pool, kv, [*prompt, 7, 8, 9, 1, 2], [5]) == cache_id
    assert len(compared) == 1
