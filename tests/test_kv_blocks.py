"""The paged KV block manager: prefix sharing, copy-on-write, LRU of cached blocks, failure atomicity.

A simulated pool (slot -> the token prefix whose K/V the slot holds) stands in for the tensors, so the
tests check what the tensor side would read, not just the bookkeeping.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence

import pytest

from chatd.engine.pool.blocks import (
    BlockAllocator,
    BlockCopy,
    BlockPoolExhausted,
    BlockTable,
    flatten_copies,
)
from chatd.engine.pool.free_blocks import block_runs
from chatd.engine.pool.prefix_hash import chain_hash, root_hash

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


# ---------------------------------------------------------------- spares (reservations) and contiguity


def test_reserve_then_append_takes_the_spares_in_order_and_nothing_from_the_pool() -> None:
    allocator, pool = new(num_blocks=32)
    table = allocator.allocate(list(range(6))).table  # 2 blocks, the second half full
    pool.compute(table)
    allocator.reserve(table, 6 + 20)  # 7 blocks in all
    spares = list(table.spare_block_ids)
    assert len(spares) == 5 and table.capacity == 28
    stats = allocator.stats()
    assert (stats.num_spare_blocks, stats.num_used_blocks, stats.num_free_blocks) == (5, 7, 25)
    assert allocator.blocks_needed_to_append(table, 20) == 0
    assert allocator.blocks_needed_to_append(table, 23) == 1  # past the capacity
    free = allocator.num_free_blocks
    ids = list(range(6))
    for token in range(100, 120):  # a turn generating one token at a time
        assert allocator.append(table, [token]) == []
        ids.append(token)
        pool.compute(table)
        assert allocator.num_free_blocks == free
    assert list(table.block_ids[2:]) == spares and list(table.spare_block_ids) == []
    assert block_runs(table.block_ids) == [(0, 7)]  # a fresh pool: one run, one view
    assert list(table.token_ids) == ids
    pool.check(table)
    allocator.verify()
    allocator.append(table, [1, 2, 3])  # past the reservation: the pool again, continuing the run
    assert block_runs(table.block_ids) == [(0, 8)] and allocator.num_free_blocks == free - 1
    allocator.verify()


def test_reserve_counts_a_copy_on_write_and_the_copy_takes_a_spare() -> None:
    allocator, pool = new(num_blocks=32)
    parent = allocator.allocate(list(range(6))).table
    pool.compute(parent)
    child = allocator.fork(parent)  # shares the partially filled second block
    assert list(child.spare_block_ids) == []
    allocator.reserve(child, 12)  # 6 more positions: a copy of block 1 and one new block
    spares = list(child.spare_block_ids)
    assert len(spares) == 2 and allocator.blocks_needed_to_append(child, 6) == 0
    free = allocator.num_free_blocks
    copies = allocator.append(child, [50, 51, 52, 53, 54, 55])
    assert copies == [BlockCopy(parent.block_ids[1], spares[0])]
    assert list(child.block_ids) == [parent.block_ids[0], *spares]
    assert allocator.num_free_blocks == free
    pool.copy(copies)
    pool.compute(child)
    pool.check(parent)
    pool.check(child)
    allocator.verify()
    # The same for a truncate into a shared block: its copy takes a spare too.
    other = allocator.fork(parent)
    allocator.reserve(other, 8)  # room for 2 more in its last block, but that block is shared: 1 spare
    spare = other.spare_block_ids[0]
    free = allocator.num_free_blocks
    copies = allocator.truncate(other, 5)
    assert copies == [BlockCopy(parent.block_ids[1], spare)] and list(other.spare_block_ids) == []
    assert allocator.num_free_blocks == free
    pool.copy(copies)
    allocator.append(other, [70, 71])
    pool.compute(other)
    pool.check(parent)
    pool.check(other)
    allocator.verify()


def test_reserve_is_atomic_and_a_no_op_when_the_capacity_suffices() -> None:
    allocator, pool = new(num_blocks=8)
    old = allocator.allocate(list(range(50, 58)))  # 2 blocks, cached once freed
    pool.compute(old.table)
    allocator.free(old.table)
    table = allocator.allocate(list(range(6))).table  # 2 blocks; 4 free and 2 cached left
    pool.compute(table)
    before = _state(allocator, [table])
    with pytest.raises(BlockPoolExhausted) as exc:
        allocator.reserve(table, 6 + 4 * 6 + 3)  # 7 more blocks, 6 available
    assert (exc.value.num_needed, exc.value.num_available) == (7, 6)
    assert _state(allocator, [table]) == before
    for target in (0, 3, 6, 8):  # the last block has room for 2 more
        allocator.reserve(table, target)
        assert _state(allocator, [table]) == before
    allocator.reserve(table, 8 + 4 * 5)  # 5 spares: the 4 free blocks, then the older cached one
    assert len(table.spare_block_ids) == 5 and table.capacity == 28
    assert allocator.stats().num_evicted_blocks == 1
    assert allocator.cached_prefix_len(list(range(50, 58))) == 4  # the tail was evicted, the head kept
    after = _state(allocator, [table])
    allocator.reserve(table, 27)
    allocator.reserve(table, 28)
    assert _state(allocator, [table]) == after
    allocator.verify()


def test_trim_gives_spares_back_and_everything_freed_leaves_the_pool_whole() -> None:
    allocator, pool = new(num_blocks=40)
    shared = allocator.allocate(list(range(10))).table
    pool.compute(shared)
    mine = allocator.allocate([*range(8), 20, 21]).table  # shares two full blocks with `shared`
    pool.compute(mine)
    fork = allocator.fork(shared)
    gone = allocator.allocate(list(range(30, 42))).table
    pool.compute(gone)
    allocator.free(gone)  # 3 cached blocks
    allocator.reserve(mine, 10 + 4 * 6)
    allocator.reserve(fork, 20)  # a copy of the shared block 2, and 2 more
    spares = list(mine.spare_block_ids)
    assert len(spares) == 6 and len(fork.spare_block_ids) == 3
    allocator.trim(mine, 10 + 2 + 4 * 3 + 1)  # 2 more fit in its last block; 13 more need 4 spares
    assert list(mine.spare_block_ids) == spares[:4]
    allocator.trim(mine, 13)
    assert list(mine.spare_block_ids) == spares[:1]
    allocator.trim(fork, 13)  # the copy and one block
    assert len(fork.spare_block_ids) == 2
    allocator.verify()
    stats = allocator.stats()
    assert stats.num_spare_blocks == 3 and stats.num_cached_blocks == 3 and stats.num_shared_blocks == 3
    allocator.trim(mine, 0)
    assert list(mine.spare_block_ids) == []
    for table in (shared, mine, fork):  # fork frees its spares with its blocks
        allocator.free(table)
    allocator.verify()
    stats = allocator.stats()
    assert stats.num_used_blocks == 0 and stats.num_spare_blocks == 0
    assert stats.num_free_blocks + stats.num_cached_blocks == 40
    allocator.evict_cached()
    assert allocator.num_free_blocks == 40


def test_truncate_keeps_capacity_as_spares_caches_registered_blocks_and_leaves_shared_ones() -> None:
    allocator, pool = new(num_blocks=32)
    other = allocator.allocate(list(range(8))).table  # 2 registered blocks
    pool.compute(other)
    ids = [*range(8), *range(40, 50)]  # 18 tokens: 2 shared blocks, 2 own full blocks, 1 own partial
    table = allocator.allocate(ids).table
    pool.compute(table)
    allocator.reserve(table, 30)
    blocks, spares = list(table.block_ids), list(table.spare_block_ids)
    assert len(blocks) == 5 and len(spares) == 3
    assert [allocator.block_hash(b) is not None for b in blocks] == [True] * 4 + [False]
    copies = allocator.truncate(table, 4)  # keeps block 0; block 1 is other's too; 2 and 3 are registered
    assert copies == []
    assert list(table.block_ids) == blocks[:1]
    assert list(table.spare_block_ids) == [blocks[4], *spares]  # the private unregistered one, in order
    assert list(other.block_ids) == blocks[:2] and allocator.ref_count(blocks[1]) == 1
    assert allocator.num_cached_blocks == 2  # blocks 2 and 3 are findable
    assert allocator.cached_prefix_len(ids) == 16
    available = allocator.num_available_blocks
    new_ids = [*range(4), 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75]  # 20 positions
    allocator.append(table, new_ids[4:])
    assert allocator.num_available_blocks == available  # all from the spares
    assert list(table.block_ids) == [blocks[0], blocks[4], *spares]
    pool.compute(table)
    pool.check(table)
    pool.check(other)
    assert allocator.cached_prefix_len(ids) == 16  # the cached blocks were not touched
    allocator.verify()


def test_truncate_of_a_private_uncommitted_table_keeps_its_whole_capacity() -> None:
    allocator, _ = new(num_blocks=16)
    table = allocator.allocate(list(range(10))).table  # not committed: nothing registered
    allocator.reserve(table, 20)
    held = [*table.block_ids, *table.spare_block_ids]
    free = allocator.num_free_blocks
    assert allocator.truncate(table, 2) == []
    assert [*table.block_ids, *table.spare_block_ids] == held
    assert table.capacity == 20 and allocator.num_free_blocks == free
    allocator.verify()
    allocator.truncate(table, 0)
    assert list(table.block_ids) == [] and list(table.spare_block_ids) == held
    allocator.verify()


def test_tables_get_runs_of_consecutive_blocks() -> None:
    allocator, _ = new(num_blocks=64)
    a = allocator.allocate([]).table
    b = allocator.allocate([]).table
    allocator.reserve(a, 40)
    allocator.reserve(b, 40)
    assert block_runs(a.spare_block_ids) == [(0, 10)]
    assert block_runs(b.spare_block_ids) == [(10, 10)]
    allocator.reserve(a, 60)  # cannot continue (b follows): the next free run of 5
    assert block_runs(a.spare_block_ids) == [(0, 10), (20, 5)]
    assert not set(a.spare_block_ids) & set(b.spare_block_ids)
    allocator.free(b)
    c = allocator.allocate([]).table
    allocator.reserve(c, 40)
    assert block_runs(c.spare_block_ids) == [(10, 10)]  # b's old run
    allocator.append(a, list(range(60)))
    assert block_runs(a.block_ids) == [(0, 10), (20, 5)]
    # A new prompt continues the run of its cached prefix when the blocks after it are free.
    allocator.commit(a)
    d = allocator.allocate([*range(8), 99, 98, 97, 96, 95]).table
    assert block_runs(d.block_ids) == [(0, 2), (25, 2)]
    allocator.verify()


def test_fragmented_pool_continues_the_run_then_takes_the_longest_runs_then_evicts() -> None:
    allocator, pool = new(num_blocks=16)
    table = allocator.allocate(list(range(8))).table  # blocks 0-1
    holes = [allocator.allocate(list(range(n))).table for n in (4, 12, 4, 8, 4, 16)]
    assert [list(h.block_ids) for h in holes] == [[2], [3, 4, 5], [6], [7, 8], [9], [10, 11, 12, 13]]
    cached = holes[2]
    pool.compute(cached)  # block 6 is registered, and cached once freed
    for hole in holes[:5]:
        allocator.free(hole)
    assert allocator.num_free_blocks == 9 and allocator.num_cached_blocks == 1  # free: 2-5, 7-9, 14-15
    allocator.reserve(table, 8 + 4 * 6)  # no free run of 6: continue with 2-5, then 2 of the longest (7-9)
    assert list(table.spare_block_ids) == [2, 3, 4, 5, 7, 8]
    allocator.reserve(table, 8 + 4 * 10)  # 9 continues the run, then 14-15, then the cached block
    assert list(table.spare_block_ids)[6:] == [9, 14, 15, 6]
    assert allocator.stats().num_evicted_blocks == 1
    allocator.verify()


def test_block_runs() -> None:
    assert block_runs([4, 5, 6, 9, 10, 2]) == [(4, 3), (9, 2), (2, 1)]
    assert block_runs([]) == []
    assert block_runs([7]) == [(7, 1)]
    assert block_runs(range(3, 8)) == [(3, 5)]
    assert block_runs([5, 4, 3]) == [(5, 1), (4, 1), (3, 1)]


def test_verify_catches_a_spare_held_twice() -> None:
    allocator, _ = new()
    a = allocator.allocate([1, 2]).table
    b = allocator.allocate([3, 4]).table
    allocator.reserve(a, 8)
    b._spare_ids.append(a.spare_block_ids[0])  # corrupt on purpose
    with pytest.raises(AssertionError):
        allocator.verify()


def test_stats_can_be_read_while_another_thread_changes_the_tables() -> None:
    allocator = BlockAllocator(64, BS, salt="s")
    stop = threading.Event()
    failures: list[BaseException] = []

    def churn() -> None:
        rng = random.Random(5)
        live: list[BlockTable] = []
        try:
            while not stop.is_set():
                if live and (len(live) > 6 or rng.random() < 0.4):
                    allocator.free(live.pop(rng.randrange(len(live))))
                else:
                    table = allocator.allocate([rng.randrange(50) for _ in range(rng.randrange(1, 20))]).table
                    allocator.commit(table)
                    live.append(table)
        except BaseException as exc:
            failures.append(exc)

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        for _ in range(3000):
            stats = allocator.stats()
            assert stats.num_blocks == 64
    finally:
        stop.set()
        worker.join()
    assert not failures
