"""The paged KV block manager: prefix sharing, copy-on-write, LRU of cached blocks, failure atomicity.

A simulated pool (slot -> the token prefix whose K/V the slot holds) stands in for the tensors, so the
tests check what the tensor side would read, not just the bookkeeping.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from chatd.kv.blocks import (
    BlockAllocator,
    BlockCopy,
    BlockPoolExhausted,
    BlockTable,
    chain_hash,
    flatten_copies,
    root_hash,
)

BS = 4


class SimPool:
    """What each slot holds: the prefix (token ids up to and including its position), or None."""

    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self.slots: list[tuple[int, ...] | None] = [None] * (allocator.num_blocks * allocator.block_size)

    def copy(self, copies: Sequence[BlockCopy]) -> None:
        size = self.allocator.block_size
        for c in copies:
            for i in range(size):
                self.slots[c.dst_block_id * size + i] = self.slots[c.src_block_id * size + i]

    def compute(self, table: BlockTable, start: int | None = None) -> None:
        """Write the table's positions from ``start`` (default: its computed count) and commit."""
        start = table.num_computed_tokens if start is None else start
        ids = list(table.token_ids)
        for p, slot in enumerate(table.slot_ids(start), start=start):
            self.slots[slot] = tuple(ids[: p + 1])
        self.allocator.commit(table)

    def check(self, table: BlockTable) -> None:
        ids = list(table.token_ids)
        for p, slot in enumerate(table.slot_ids(0, table.num_computed_tokens)):
            assert self.slots[slot] == tuple(ids[: p + 1]), f"{table} position {p} holds the wrong K/V"


def new(num_blocks: int = 16, salt: bytes | str = b"model-a") -> tuple[BlockAllocator, SimPool]:
    allocator = BlockAllocator(num_blocks, BS, salt=salt)
    return allocator, SimPool(allocator)


def test_prefix_shared_across_two_tables_and_hits_counted() -> None:
    allocator, pool = new()
    system = list(range(100, 110))  # 2 full blocks + 2 tokens
    first = allocator.allocate([*system, 1, 2, 3])
    assert first.num_cached_tokens == 0
    pool.compute(first.table)
    second = allocator.allocate([*system, 7, 8])
    assert second.num_cached_tokens == 8  # the two full blocks; the partial third is not shared
    assert second.table.block_ids[:2] == first.table.block_ids[:2]
    assert second.table.block_ids[2] != first.table.block_ids[2]
    assert [allocator.ref_count(b) for b in first.table.block_ids[:2]] == [2, 2]
    pool.compute(second.table)
    pool.check(first.table)
    pool.check(second.table)
    stats = allocator.stats()
    assert stats.num_hit_tokens == 8
    assert stats.num_queried_tokens == 13 + 12
    assert stats.hit_ratio == pytest.approx(8 / 25)
    assert stats.num_shared_blocks == 2
    assert stats.num_logical_tokens == 25
    assert stats.num_unique_tokens == 25 - 8
    allocator.verify()


def test_uncommitted_blocks_are_not_found() -> None:
    allocator, _ = new()
    ids = list(range(12))
    allocator.allocate(ids)  # slots held, K/V not written yet
    assert allocator.allocate(ids).num_cached_tokens == 0
    assert allocator.cached_prefix_len(ids) == 0


def test_max_cached_tokens_cut_inside_a_shared_block_copies_it() -> None:
    allocator, pool = new()
    ids = list(range(8))
    a = allocator.allocate(ids)
    pool.compute(a.table)
    b = allocator.allocate(ids, max_cached_tokens=7)  # the last token must be computed for its logits
    assert b.num_cached_tokens == 7
    assert b.table.block_ids[0] == a.table.block_ids[0]
    assert b.copies == (BlockCopy(a.table.block_ids[1], b.table.block_ids[1]),)
    pool.copy(b.copies)
    pool.compute(b.table)
    pool.check(a.table)
    pool.check(b.table)
    allocator.verify()


def test_max_cached_tokens_cut_inside_an_unreferenced_cached_block_takes_it_over() -> None:
    allocator, pool = new()
    ids = list(range(8))
    a = allocator.allocate(ids)
    pool.compute(a.table)
    blocks = list(a.table.block_ids)
    allocator.free(a.table)
    b = allocator.allocate(ids, max_cached_tokens=7)
    assert b.num_cached_tokens == 7 and b.copies == ()
    assert list(b.table.block_ids) == blocks
    assert allocator.block_hash(blocks[1]) is None  # about to be written: no longer findable
    pool.compute(b.table)
    pool.check(b.table)
    allocator.verify()


def test_truncate_into_shared_block_copies_on_write_and_leaves_other_table_untouched() -> None:
    allocator, pool = new()
    ids = list(range(10))
    a = allocator.allocate(ids)
    pool.compute(a.table)
    b = allocator.allocate([*ids[:8], 50, 51])
    pool.compute(b.table)
    a_blocks = list(a.table.block_ids)
    a_slots_before = [pool.slots[s] for s in a.table.slot_ids()]
    copies = allocator.truncate(b.table, 6)  # the edit cuts inside block 1, shared with a
    assert copies == [BlockCopy(a_blocks[1], b.table.block_ids[1])]
    pool.copy(copies)
    allocator.append(b.table, [60, 61, 62])
    pool.compute(b.table)
    assert list(b.table.token_ids) == [*ids[:6], 60, 61, 62]
    assert list(a.table.block_ids) == a_blocks
    assert [pool.slots[s] for s in a.table.slot_ids()] == a_slots_before
    pool.check(a.table)
    pool.check(b.table)
    allocator.verify()


def test_truncate_own_registered_block_unregisters_it_without_copy() -> None:
    allocator, pool = new()
    a = allocator.allocate(list(range(12)))
    pool.compute(a.table)
    block = a.table.block_ids[1]
    assert allocator.block_hash(block) is not None
    assert allocator.truncate(a.table, 6) == []
    assert a.table.block_ids[1] == block and allocator.block_hash(block) is None
    assert a.table.num_computed_tokens == 6
    assert allocator.stats().num_cached_blocks == 1  # block 2 was released and stays findable
    allocator.verify()


def test_fork_then_append_copies_the_partial_block() -> None:
    allocator, pool = new()
    a = allocator.allocate(list(range(6)))
    pool.compute(a.table)
    b = allocator.fork(a.table)
    assert list(b.block_ids) == list(a.table.block_ids)
    copies = allocator.append(b, [9, 9])
    assert copies == [BlockCopy(a.table.block_ids[1], b.block_ids[1])]
    pool.copy(copies)
    pool.compute(b)
    assert allocator.append(a.table, [7]) == []  # a now owns its block alone
    pool.compute(a.table)
    pool.check(a.table)
    pool.check(b)
    allocator.verify()


def test_fork_of_uncommitted_table_is_refused() -> None:
    allocator, _ = new()
    a = allocator.allocate(list(range(6)))
    with pytest.raises(ValueError):
        allocator.fork(a.table)


def test_freed_cached_blocks_are_reused_lru_then_evicted_for_room() -> None:
    allocator, pool = new(num_blocks=6)
    old = allocator.allocate(list(range(8)))  # 2 blocks
    pool.compute(old.table)
    newer = allocator.allocate(list(range(50, 58)))  # 2 blocks
    pool.compute(newer.table)
    old_blocks = list(old.table.block_ids)
    allocator.free(old.table)
    allocator.free(newer.table)
    stats = allocator.stats()
    assert (stats.num_free_blocks, stats.num_cached_blocks, stats.num_used_blocks) == (2, 4, 0)
    # Reuse after free: found again.
    again = allocator.allocate(list(range(8)))
    assert again.num_cached_tokens == 8 and list(again.table.block_ids) == old_blocks
    allocator.free(again.table)
    # Room needed: the 2 free blocks first, then the least recently released cached ones,
    # which are now the other prompt's (tail block first).
    filler = allocator.allocate(list(range(200, 212)))  # 3 blocks
    pool.compute(filler.table)
    assert allocator.stats().num_evicted_blocks == 1
    assert allocator.cached_prefix_len(list(range(50, 58))) == 4  # its head block survives
    assert allocator.cached_prefix_len(list(range(8))) == 8
    allocator.verify()


def test_everything_freed_returns_refcounts_to_zero_and_the_pool_whole() -> None:
    allocator, pool = new(num_blocks=32)
    tables = []
    for i in range(4):
        alloc = allocator.allocate([*range(10), i, i])
        pool.compute(alloc.table)
        tables.append(alloc.table)
    tables.append(allocator.fork(tables[0]))
    for table in tables:
        allocator.free(table)
    assert all(allocator.ref_count(b) == 0 for b in range(32))
    stats = allocator.stats()
    assert stats.num_used_blocks == 0 and stats.num_free_blocks + stats.num_cached_blocks == 32
    assert allocator.evict_cached() == stats.num_cached_blocks
    assert allocator.num_free_blocks == 32
    allocator.verify()
    with pytest.raises(ValueError):
        allocator.free(tables[0])


def test_hash_chain_depends_on_prefix_and_salt() -> None:
    block = [5, 6, 7, 8]
    assert chain_hash(root_hash(b"a"), block, b"a") != chain_hash(root_hash(b"b"), block, b"b")
    a, _ = new(salt="model-a")
    b, _ = new(salt="model-b")
    assert a.hashes_of([1, 2, 3, 4, *block]) != b.hashes_of([1, 2, 3, 4, *block])
    # Same second block under another first block: different hash, not shared.
    allocator, pool = new()
    first = allocator.allocate([1, 2, 3, 4, *block])
    pool.compute(first.table)
    other = allocator.allocate([1, 2, 3, 9, *block])
    assert other.num_cached_tokens == 0
    assert allocator.hashes_of([1, 2, 3, 4, *block])[1] != allocator.hashes_of([1, 2, 3, 9, *block])[1]


def blocks_to_append(allocator: BlockAllocator, table: BlockTable, num_tokens: int) -> int:
    """Blocks appending ``num_tokens`` positions takes, spares or not: new ones, plus a copy of a shared
    partially filled last block."""
    if num_tokens <= 0:
        return 0
    offset = table.num_tokens % BS
    room = BS - offset if offset else 0
    cow = offset != 0 and allocator.ref_count(table.block_ids[-1]) > 1
    return -(-max(0, num_tokens - room) // BS) + int(cow)


def _state(allocator: BlockAllocator, tables: Sequence[BlockTable]) -> object:
    return (allocator.stats(), allocator._free.bitmap(), list(allocator._cached), dict(allocator._index),
            list(allocator._ref_counts),
            [(list(t.block_ids), list(t.spare_block_ids), list(t.token_ids), t.num_computed_tokens)
             for t in tables])


def test_failures_change_nothing() -> None:
    allocator, pool = new(num_blocks=4)
    a = allocator.allocate(list(range(8)))
    pool.compute(a.table)
    c = allocator.fork(a.table)
    b = allocator.allocate(list(range(50, 58)))
    pool.compute(b.table)  # every block used: a and c share two, b holds two
    tables = [a.table, b.table, c]
    before = _state(allocator, tables)
    with pytest.raises(BlockPoolExhausted) as exc:
        allocator.allocate(list(range(100, 105)))
    assert exc.value.num_needed == 2 and exc.value.num_available == 0
    with pytest.raises(BlockPoolExhausted):
        allocator.append(a.table, [1])
    with pytest.raises(BlockPoolExhausted):
        allocator.truncate(c, 6)  # needs a copy of the shared block; nothing is free
    assert _state(allocator, tables) == before
    allocator.verify()
    assert allocator.truncate(c, 4) == []  # block aligned: no copy needed
    assert allocator.num_available_blocks == 0  # the released block is still a's
    allocator.verify()


@pytest.mark.parametrize("seed", [1234, 99])
def test_randomized_operations_keep_invariants_and_contents(seed: int) -> None:
    rng = random.Random(seed)
    allocator, pool = new(num_blocks=24)
    prefixes = [[rng.randrange(1, 6) for _ in range(rng.randrange(0, 14))] for _ in range(4)]
    tables: list[BlockTable] = []
    model: dict[int, list[int]] = {}  # table id -> expected token ids
    num_failures = 0
    num_reserved_appends = 0

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, 4) for _ in range(n)]

    for _ in range(1500):
        op = rng.choice(["allocate", "allocate", "append", "truncate", "fork", "free", "truncate_append",
                         "reserve", "reserve", "trim"])
        before = _state(allocator, tables)
        try:
            if op == "allocate" or not tables:
                ids = rng.choice(prefixes) + tokens(rng.randrange(0, 7))
                limit = rng.choice([None, max(len(ids) - 1, 0), rng.randrange(0, len(ids) + 1)])
                namespace = rng.choice([b"", b"", b"other"])
                expected_hit = min(allocator.cached_prefix_len(ids, namespace=namespace),
                                   len(ids) if limit is None else limit)
                alloc = allocator.allocate(ids, max_cached_tokens=limit, namespace=namespace)
                assert alloc.num_cached_tokens == expected_hit
                pool.copy(alloc.copies)
                pool.check(alloc.table)  # the cached part already holds the right K/V
                pool.compute(alloc.table)
                tables.append(alloc.table)
                model[alloc.table.table_id] = ids
                continue
            table = rng.choice(tables)
            if op == "append":
                ids = tokens(rng.randrange(1, 7))
                need = allocator.blocks_needed_to_append(table, len(ids))  # spares first, then the pool
                available = allocator.num_available_blocks
                pool.copy(allocator.append(table, ids))
                assert available - allocator.num_available_blocks == need
                pool.compute(table)
                model[table.table_id] += ids
            elif op in ("truncate", "truncate_append"):
                n = rng.randrange(0, table.num_tokens + 1)
                pool.copy(allocator.truncate(table, n))
                del model[table.table_id][n:]
                if op == "truncate_append":
                    ids = tokens(rng.randrange(1, 5))
                    pool.copy(allocator.append(table, ids))
                    pool.compute(table)
                    model[table.table_id] += ids
            elif op == "reserve":
                target = table.num_tokens + rng.randrange(0, 14)
                allocator.reserve(table, target)
                assert table.capacity >= target
                assert allocator.blocks_needed_to_append(table, target - table.num_tokens) == 0
                if rng.random() < 0.6:  # a turn that generates into its reservation: the pool is not touched
                    available = allocator.num_available_blocks
                    while table.num_tokens < target:
                        ids = tokens(min(rng.randrange(1, 4), target - table.num_tokens))
                        pool.copy(allocator.append(table, ids))
                        pool.compute(table)
                        model[table.table_id] += ids
                        num_reserved_appends += 1
                    assert allocator.num_available_blocks == available
            elif op == "trim":
                target = table.num_tokens + rng.randrange(0, 8)
                spares = list(table.spare_block_ids)
                allocator.trim(table, target)
                kept = min(len(spares), blocks_to_append(allocator, table, target - table.num_tokens))
                assert list(table.spare_block_ids) == spares[:kept]  # given back last first
            elif op == "fork":
                child = allocator.fork(table)
                assert list(child.spare_block_ids) == []
                tables.append(child)
                model[child.table_id] = list(model[table.table_id])
            elif op == "free":
                allocator.free(table, keep_cached=rng.random() < 0.8)
                tables.remove(table)
                del model[table.table_id]
        except BlockPoolExhausted:
            num_failures += 1
            if op != "truncate_append":  # its truncate may have succeeded before the append failed
                assert _state(allocator, tables) == before
        allocator.verify()
        for table in tables:
            assert list(table.token_ids) == model[table.table_id]
            assert table.num_computed_tokens == table.num_tokens
            pool.check(table)
    stats = allocator.stats()
    assert num_failures > 0 and stats.num_hit_tokens > 0 and stats.num_copied_blocks > 0
    assert stats.num_evicted_blocks > 0 and num_reserved_appends > 0
    assert stats.num_spare_blocks == sum(len(t.spare_block_ids) for t in tables)
    for table in tables:
        allocator.free(table)
    allocator.verify()
    assert allocator.stats().num_used_blocks == 0
    assert allocator.num_available_blocks == allocator.num_blocks


def test_slot_ids_and_flatten_copies() -> None:
    allocator, _ = new()
    table = allocator.allocate(list(range(6))).table
    b0, b1 = table.block_ids
    assert table.slot_ids(2, 6) == [b0 * BS + 2, b0 * BS + 3, b1 * BS, b1 * BS + 1]
    with pytest.raises(ValueError):
        table.slot_ids(0, 7)
    assert flatten_copies([BlockCopy(1, 2), BlockCopy(3, 4)]) == ([1, 3], [2, 4])


def test_same_content_computed_twice_registers_once() -> None:
    allocator, pool = new()
    ids = list(range(8))
    a = allocator.allocate(ids)
    b = allocator.allocate(ids)  # before a committed: nothing to share yet
    pool.compute(a.table)
    pool.compute(b.table)
    assert [allocator.block_hash(x) is not None for x in b.table.block_ids] == [False, False]
    allocator.free(a.table)
    allocator.free(b.table)
    assert (allocator.num_cached_blocks, allocator.num_free_blocks) == (2, 14)
    assert allocator.allocate(ids).num_cached_tokens == 8
    allocator.verify()


def test_peeking_changes_nothing_and_needs_are_predicted() -> None:
    allocator, pool = new(num_blocks=8)
    first = allocator.allocate(list(range(8)))
    pool.compute(first.table)
    allocator.free(first.table)
    before = _state(allocator, [])
    assert allocator.cached_prefix_len([*range(8), 99]) == 8
    assert allocator.cached_prefix_len([0, 1, 2]) == 0
    assert _state(allocator, []) == before
    table = allocator.allocate(list(range(6))).table  # takes the first cached block, 1 new
    pool.compute(table)
    assert allocator.blocks_needed_to_append(table, 2) == 0
    assert allocator.blocks_needed_to_append(table, 3) == 1
    assert allocator.blocks_needed_to_append(table, 11) == 3
    fork = allocator.fork(table)
    assert allocator.blocks_needed_to_append(fork, 1) == 1  # the shared partial block is copied
    free_before = allocator.num_available_blocks
    allocator.append(fork, list(range(11)))
    assert free_before - allocator.num_available_blocks == 4


def test_namespaces_do_not_share() -> None:
    allocator, pool = new()
    ids = list(range(8))
    a = allocator.allocate(ids, namespace=b"tenant-a")
    pool.compute(a.table)
    assert allocator.allocate(ids, namespace=b"tenant-b").num_cached_tokens == 0
    assert allocator.allocate(ids).num_cached_tokens == 0
    again = allocator.allocate(ids, namespace=b"tenant-a")
    assert again.num_cached_tokens == 8
    child = allocator.fork(again.table)
    allocator.append(child, [1, 2, 3, 4])
    pool.compute(child)
    assert allocator.cached_prefix_len([*ids, 1, 2, 3, 4], namespace=b"tenant-a") == 12
    assert allocator.cached_prefix_len([*ids, 1, 2, 3, 4]) == 0
    allocator.verify()


def test_free_without_keeping_cached_forgets_unshared_blocks() -> None:
    allocator, pool = new()
    shared = allocator.allocate(list(range(8)))
    pool.compute(shared.table)
    mine = allocator.allocate([*range(8), 20, 21, 22, 23, 24])
    pool.compute(mine.table)
    allocator.free(mine.table, keep_cached=False)
    assert allocator.num_cached_blocks == 0  # its own block 2 is gone, not cached
    assert allocator.cached_prefix_len([*range(8), 20, 21, 22, 23]) == 8  # the shared prefix stays
    allocator.verify()

