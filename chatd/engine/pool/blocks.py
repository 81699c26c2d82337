"""Block bookkeeping for a paged KV pool, in the manner of PagedAttention. Pure Python: no torch, no I/O.

The device's KV memory is a pool of ``num_blocks`` blocks of ``block_size`` token positions each (the
tensors live in :mod:`chatd.engine.pool.paged`; this module only decides which block holds what). A
:class:`BlockTable` is one sequence's list of block ids: its token position ``p`` lives in block
``block_ids[p // block_size]`` at offset ``p % block_size``, i.e. at slot
``block_ids[p // block_size] * block_size + p % block_size`` of the pool.

Prefix sharing. A full block whose K/V has been computed (see :meth:`BlockAllocator.commit`) is
registered under a chain hash ``H(parent hash, its token ids, salt)``, where the parent is the hash of
the previous block of the same sequence (a fixed root for the first block). Equal hashes therefore mean
the same token ids from position 0 up to the block's end under the same salt (the model fingerprint),
which is what makes two sequences' K/V for that block identical. An optional per-table namespace
joins the salt, for callers that must not share (or reveal) prefixes across clients.
:meth:`BlockAllocator.allocate` walks a new prompt's full blocks through the index and references the
longest chain it finds instead of allocating. A registered block whose last reference is dropped
stays registered and findable ("cached") until its room is needed; cached blocks are evicted least
recently released first, and a table is released tail first, so the end of a chain goes before its
beginning.

Spare blocks (reservations). Besides ``block_ids``, a table may hold *spare* blocks
(``spare_block_ids``): private, never registered, content meaningless, room for positions it does not
have yet. :meth:`BlockAllocator.reserve` makes a table hold room for a whole turn (prompt plus max new
tokens) up front, so a running generation never finds the pool exhausted midway;
:meth:`~BlockAllocator.append` takes the spares first, in order, and the pool only after they run out
(a copy-on-write of a shared last block takes its destination from the spares too);
:meth:`~BlockAllocator.trim` gives back what a turn did not use. :meth:`~BlockAllocator.truncate` keeps
a table's capacity: the private, unregistered blocks it cuts off become spares (shared ones are
released, registered ones go cached). :meth:`~BlockAllocator.free` releases spares too, and
:meth:`~BlockAllocator.fork` does not copy them.

Contiguity. Attention reads a table's K/V as a view of the pool when its block ids are consecutive
(``b, b+1, b+2, ...``) and has to gather them otherwise (:func:`block_runs` splits a table into such
runs). So when a table needs ``k`` new blocks (allocate, append, reserve, a copy-on-write destination)
they are taken as consecutive ids where possible: the ``k`` ids right after the table's last held block
(its last spare, else its last block; for a copy-on-write, the block before the one replaced) when they
are all free; else the first free run of ``k`` ids; else the longest free runs; and only when no free
block is left, cached blocks in LRU order. The free blocks are a bitmap, so looking for a run is a
C-speed ``bytearray.find``.

Block states (every block is in exactly one):

* free: ``ref_count == 0``, not registered, content meaningless;
* cached: ``ref_count == 0``, registered in the hash index, evictable (LRU order);
* used: ``ref_count >= 1``, referenced by that many live tables, in their ``block_ids`` (registered or
  not) or, with ``ref_count == 1`` and never registered, as one table's spare.

Invariants (checked by :meth:`BlockAllocator.verify`):

1. ``ref_count[b]`` equals the number of live tables holding ``b`` (in ``block_ids`` or as a spare); a
   table never holds a block twice, counting its spares. A spare is held by its table only
   (``ref_count == 1``) and is never registered.
2. The hash index maps each registered hash to exactly one block and back; a registered block's stored
   token ids are its content, and it is full in every table that holds it. Hence a table's partially
   filled last block is never registered, and a write never lands in a block someone may find by hash.
3. A block whose K/V is not yet committed is held by exactly one table (fork needs a committed
   table), so exactly one forward pass writes it.
4. ``len(table.block_ids) == ceil(table.num_tokens / block_size)`` (spares are extra) and
   ``table.num_computed_tokens <= table.num_tokens``.
5. ``num_free + num_cached + num_used == num_blocks`` (spares count as used); after every table is
   freed ``num_used == 0``.
6. Any operation that raises leaves every table and every count exactly as it was.

Writes and copy-on-write. Only a table's partially filled last block is ever written by appends.
When that block is shared (``ref_count > 1``, after :meth:`BlockAllocator.fork` or a prefix hit cut
short), the table first gets a private copy: the operation returns :class:`BlockCopy` instructions that
the tensor side must execute (``PagedKVPool.copy_blocks``) before any K/V is written to the table's new
slots. A registered block held by one table only is taken over in place instead (unregistered; no copy).
A :meth:`~BlockAllocator.reserve` counts that copy: after ``reserve(table, n)``, appending up to ``n``
positions in all takes nothing from the pool.

Threading: not thread-safe; one owner calls it (the engine thread, through the session caches of
chatd.engine.pool.kvcache). Other threads may read the cheap queries (counts, ``cached_prefix_len``,
``ref_count``) and :meth:`BlockAllocator.stats`, which tolerates concurrent changes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from chatd.engine.pool.free_blocks import FreeBlocks, num_blocks_for
from chatd.engine.pool.prefix_hash import chain_hash, root_hash
from chatd.errors import ContextLengthExceeded


class BlockPoolExhausted(ContextLengthExceeded):
    """The pool has fewer free or evictable blocks than an operation needs. Nothing was changed.

    The KV manager is expected to make room (free idle tables) and retry; when this escapes to a
    client it reads as ``context_length_exceeded``.
    """

    def __init__(self, num_needed: int, num_available: int) -> None:
        super().__init__(f"the KV block pool has {num_available} blocks available but {num_needed} are needed")
        self.num_needed = num_needed
        self.num_available = num_available


@dataclass(frozen=True)
class BlockCopy:
    """Copy the whole block ``src_block_id`` into ``dst_block_id`` (all layers, K and V)."""

    src_block_id: int
    dst_block_id: int


@dataclass(frozen=True)
class Allocation:
    """The result of :meth:`BlockAllocator.allocate`.

    The first ``num_cached_tokens`` positions of ``table`` already hold valid K/V; the caller computes
    the rest (``prompt[num_cached_tokens:]``) into the table's slots, after executing ``copies``.
    """

    table: BlockTable
    num_cached_tokens: int
    copies: tuple[BlockCopy, ...]


@dataclass(frozen=True)
class BlockStats:
    num_blocks: int
    block_size: int
    num_free_blocks: int
    """Blocks holding nothing."""
    num_cached_blocks: int
    """Unreferenced blocks kept findable by hash; evicted when room is needed."""
    num_used_blocks: int
    """Blocks held by live tables, spares included."""
    num_spare_blocks: int
    """Of those, spares: reserved by a table for positions it does not have yet."""
    num_shared_blocks: int
    """Used blocks held by more than one table."""
    num_tables: int
    num_logical_tokens: int
    """Sum of the live tables' token counts."""
    num_unique_tokens: int
    """Token positions the live tables actually occupy (a shared position counts once)."""
    num_queried_tokens: int
    """Prompt tokens passed to allocate, since the allocator was created."""
    num_hit_tokens: int
    """Of those, tokens found cached."""
    num_evicted_blocks: int
    num_copied_blocks: int

    @property
    def num_available_blocks(self) -> int:
        return self.num_free_blocks + self.num_cached_blocks

    @property
    def hit_ratio(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class BlockTable:
    """One sequence's blocks. Created and changed only by its :class:`BlockAllocator`.

    Callers read ``block_ids``, ``spare_block_ids``, ``token_ids``, ``num_tokens``, ``capacity`` and
    ``slot_ids``; they must not mutate the returned sequences.
    """

    __slots__ = ("_block_hashes", "_block_ids", "_live", "_num_computed", "_root", "_spare_ids", "_token_ids",
                 "block_size", "table_id")

    def __init__(self, table_id: int, block_size: int, root: bytes) -> None:
        self.table_id = table_id
        self.block_size = block_size
        self._root = root  # parent hash of the first block: salt and namespace
        self._block_ids: list[int] = []
        # Reserved blocks for the positions after the last block, in position order (see the module doc).
        self._spare_ids: list[int] = []
        self._token_ids: list[int] = []
        # Hashes of the leading full blocks whose K/V is computed: exactly num_computed // block_size.
        self._block_hashes: list[bytes] = []
        self._num_computed = 0
        self._live = True

    @property
    def block_ids(self) -> Sequence[int]:
        return self._block_ids

    @property
    def spare_block_ids(self) -> Sequence[int]:
        """Blocks reserved for the positions after ``block_ids``: private, unregistered, content
        meaningless; the next appends take them first, in this order."""
        return self._spare_ids

    @property
    def capacity(self) -> int:
        """Positions the table's blocks, spares included, can hold (appends up to it take no block
        from the pool, unless its partially filled last block is shared and needs a copy)."""
        return (len(self._block_ids) + len(self._spare_ids)) * self.block_size

    @property
    def token_ids(self) -> Sequence[int]:
        """The token ids whose slots the table holds (computed or about to be)."""
        return self._token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_computed_tokens(self) -> int:
        """Positions declared written by :meth:`BlockAllocator.commit` (or found cached)."""
        return self._num_computed

    @property
    def is_live(self) -> bool:
        return self._live

    def slot_ids(self, start: int = 0, stop: int | None = None) -> list[int]:
        """Pool slots of positions ``[start, stop)`` (default: to ``num_tokens``)."""
        stop = self.num_tokens if stop is None else stop
        if not 0 <= start <= stop <= self.num_tokens:
            raise ValueError(f"positions [{start}, {stop}) outside a table of {self.num_tokens} tokens")
        size = self.block_size
        blocks = self._block_ids
        return [blocks[p // size] * size + p % size for p in range(start, stop)]

    def __repr__(self) -> str:
        spares = f", spares={self._spare_ids}" if self._spare_ids else ""
        return f"BlockTable(id={self.table_id}, tokens={self.num_tokens}, blocks={self._block_ids}{spares})"


class BlockAllocator:
    """Blocks, refcounts, the hash index of full blocks, and the LRU of cached blocks. See the module
    docstring for the states and invariants a caller may rely on."""

    def __init__(self, num_blocks: int, block_size: int, *, salt: bytes | str = b"") -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.salt = salt.encode() if isinstance(salt, str) else bytes(salt)
        self._root = root_hash(self.salt)
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[bytes | None] = [None] * num_blocks
        self._block_token_ids: list[tuple[int, ...] | None] = [None] * num_blocks
        self._index: dict[bytes, int] = {}
        self._free = FreeBlocks(num_blocks)
        self._cached: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self._tables: dict[int, BlockTable] = {}
        self._next_table_id = 0
        self._num_queried = 0
        self._num_hits = 0
        self._num_evicted = 0
        self._num_copied = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation may take: free ones, then cached ones (evicting them)."""
        return len(self._free) + len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        """The hash a block is registered under, or None."""
        return self._block_hashes[block_id]

    def hashes_of(self, token_ids: Sequence[int], *, namespace: bytes = b"") -> list[bytes]:
        """Chain hashes of the full blocks of ``token_ids`` under this allocator's salt."""
        return self._hashes(token_ids, self._root_for(namespace))

    def _hashes(self, token_ids: Sequence[int], root: bytes) -> list[bytes]:
        hashes: list[bytes] = []
        parent = root
        size = self.block_size
        for i in range(len(token_ids) // size):
            parent = chain_hash(parent, token_ids[i * size : (i + 1) * size], self.salt)
            hashes.append(parent)
        return hashes

    def cached_prefix_len(self, token_ids: Sequence[int], *, namespace: bytes = b"") -> int:
        """How many leading tokens of ``token_ids`` are resident in registered blocks (block-aligned).
        Changes nothing, not even the LRU order."""
        root = self._root_for(namespace)
        return len(self._lookup(token_ids, len(token_ids) // self.block_size, root)[0]) * self.block_size

    def blocks_needed_to_append(self, table: BlockTable, num_tokens: int) -> int:
        """Blocks :meth:`append` of ``num_tokens`` would take from the pool (including a copy-on-write),
        beyond the table's spares."""
        self._check_live(table)
        need, _ = self._append_need(table, num_tokens)
        return max(0, need - len(table._spare_ids))

    def stats(self) -> BlockStats:
        """Counts of this moment. The one read another thread may make while the owner works (the server's
        stats and metrics): it iterates copies of the table registry and of each table's blocks, so a
        concurrent change cannot make it raise; the figures may then mix two adjacent moments."""
        fills: dict[int, int] = {}
        size = self.block_size
        tables = list(self._tables.values())
        for table in tables:
            for i, block_id in enumerate(list(table._block_ids)):
                fill = min(size, table.num_tokens - i * size)
                if fill > fills.get(block_id, 0):
                    fills[block_id] = fill
        num_used = self.num_blocks - len(self._free) - len(self._cached)
        return BlockStats(
            num_blocks=self.num_blocks,
            block_size=size,
            num_free_blocks=len(self._free),
            num_cached_blocks=len(self._cached),
            num_used_blocks=num_used,
            num_spare_blocks=sum(len(t._spare_ids) for t in tables),
            num_shared_blocks=sum(1 for r in list(self._ref_counts) if r > 1),
            num_tables=len(tables),
            num_logical_tokens=sum(t.num_tokens for t in tables),
            num_unique_tokens=sum(fills.values()),
            num_queried_tokens=self._num_queried,
            num_hit_tokens=self._num_hits,
            num_evicted_blocks=self._num_evicted,
            num_copied_blocks=self._num_copied,
        )

    # ------------------------------------------------------------------ operations

    def allocate(self, token_ids: Sequence[int], *, max_cached_tokens: int | None = None,
                 namespace: bytes = b"") -> Allocation:
        """A new table holding slots for all of ``token_ids``, reusing the longest chain of registered
        full blocks that starts the prompt, up to ``max_cached_tokens`` positions (e.g. ``len - 1`` so
        the last prompt token is computed and yields logits).

        When the limit ends inside a found block, that block is shared copy-on-write (a
        :class:`BlockCopy` in the result) or, when nobody holds it, taken over in place.
        ``namespace`` joins the salt for this table (and its forks): only tables of the same namespace
        share blocks. Use it where one client must not learn, from ``num_cached_tokens`` or timing,
        that another client sent the same prefix.

        Raises :class:`BlockPoolExhausted` (changing nothing) when the rest does not fit.
        """
        ids = list(token_ids)
        root = self._root_for(namespace)
        size = self.block_size
        limit = len(ids) if max_cached_tokens is None else max(0, min(max_cached_tokens, len(ids)))
        hit_ids, hit_hashes = self._lookup(ids, min(len(ids) // size, num_blocks_for(limit, size)), root)
        num_cached = min(len(hit_ids) * size, limit)
        cut = num_cached % size != 0
        cow = cut and self._ref_counts[hit_ids[-1]] > 0
        num_taken = len(hit_ids) - (1 if cow else 0)
        num_new = num_blocks_for(len(ids), size) - num_taken
        taken_cached = sum(1 for b in hit_ids[:num_taken] if self._ref_counts[b] == 0)
        self._require(num_new, self.num_available_blocks - taken_cached)

        table = self._new_table(root)
        for block_id in hit_ids[:num_taken]:
            self._acquire(block_id)
            table._block_ids.append(block_id)
        # Taken after the hits are acquired, so it never evicts one of them.
        new_ids = self._take_blocks(num_new, table._block_ids[-1] if table._block_ids else None)
        copies: list[BlockCopy] = []
        if cut:
            last = hit_ids[-1]
            if cow:
                dst = new_ids.pop(0)
                copies.append(BlockCopy(last, dst))
                self._num_copied += 1
                table._block_ids.append(dst)
            else:
                self._unregister(last)
        table._block_ids.extend(new_ids)
        table._token_ids = ids
        table._num_computed = num_cached
        table._block_hashes = hit_hashes[: num_cached // size]
        self._num_queried += len(ids)
        self._num_hits += num_cached
        return Allocation(table, num_cached, tuple(copies))

    def append(self, table: BlockTable, token_ids: Sequence[int]) -> list[BlockCopy]:
        """Hold slots for ``token_ids`` after the table's last position (``table.slot_ids(old_len)``).
        New blocks are the table's spares first, in order, then blocks from the pool.

        Returns the copies to execute first when the table's partially filled last block was shared.
        Raises :class:`BlockPoolExhausted` (changing nothing) when the pool cannot hold them.
        """
        self._check_live(table)
        ids = list(token_ids)
        if not ids:
            return []
        need, cow = self._append_need(table, len(ids))
        self._require(need - len(table._spare_ids), self.num_available_blocks)
        new_ids = self._take_for(table, need, replacing_last=cow)
        copies: list[BlockCopy] = []
        if cow:
            copies.append(self._copy_last(table, new_ids.pop(0)))
        table._block_ids.extend(new_ids)
        table._token_ids.extend(ids)
        return copies

    def reserve(self, table: BlockTable, num_tokens: int) -> None:
        """Make the table hold room for ``num_tokens`` positions in all (its tokens plus the ones to
        come), taking spare blocks from the pool as needed; a no-op when it already does. Afterwards,
        appends up to ``num_tokens`` positions take nothing from the pool: when the table's partially
        filled last block is shared, the spare its copy-on-write will need is reserved too.

        Raises :class:`BlockPoolExhausted` (changing nothing) when the pool cannot supply them.
        """
        self._check_live(table)
        need, _ = self._append_need(table, num_tokens - table.num_tokens)
        missing = need - len(table._spare_ids)
        if missing <= 0:
            return
        self._require(missing, self.num_available_blocks)
        table._spare_ids.extend(self._take_blocks(missing, self._last_held(table)))

    def trim(self, table: BlockTable, num_tokens: int) -> None:
        """Give back the spare blocks that room for ``max(num_tokens, table.num_tokens)`` positions
        does not need (the undone part of a :meth:`reserve`), last first. ``trim(table, 0)`` gives
        back every spare."""
        self._check_live(table)
        keep, _ = self._append_need(table, num_tokens - table.num_tokens)
        spares = table._spare_ids
        while len(spares) > keep:
            self._release(spares.pop())

    def commit(self, table: BlockTable, num_tokens: int | None = None) -> None:
        """Declare the K/V of the table's first ``num_tokens`` positions (default: all) written.

        Full blocks among them are registered in the hash index, where other prompts can find them.
        Call it only after the forward pass that wrote them succeeded. A block whose hash is already
        registered to another block (two sequences computed the same content) stays private.
        """
        self._check_live(table)
        n = table.num_tokens if num_tokens is None else num_tokens
        if not table._num_computed <= n <= table.num_tokens:
            raise ValueError(f"commit of {n} tokens: table has {table._num_computed} computed of {table.num_tokens}")
        table._num_computed = n
        size = self.block_size
        hashes = table._block_hashes
        parent = hashes[-1] if hashes else table._root
        for i in range(len(hashes), n // size):
            chunk = table._token_ids[i * size : (i + 1) * size]
            parent = chain_hash(parent, chunk, self.salt)
            hashes.append(parent)
            block_id = table._block_ids[i]
            if parent not in self._index and self._block_hashes[block_id] is None:
                self._index[parent] = block_id
                self._block_hashes[block_id] = parent
                self._block_token_ids[block_id] = tuple(chunk)

    def truncate(self, table: BlockTable, num_tokens: int) -> list[BlockCopy]:
        """Keep the first ``num_tokens`` positions (crop after an edit). Of the blocks past them, the
        ones only this table holds and nobody can find by hash become spares (ahead of the existing
        spares, in position order), so the table keeps its capacity; shared ones are released, and
        registered ones stay cached. When the new last block is partially filled and shared, the
        table gets a private copy (returned; its destination a spare if there is one) so later
        appends never write into another table's tokens; a registered block held only by this table
        is unregistered instead.

        Raises ValueError when ``num_tokens`` exceeds the table, :class:`BlockPoolExhausted`
        (changing nothing) when a needed copy has no room.
        """
        self._check_live(table)
        if not 0 <= num_tokens <= table.num_tokens:
            raise ValueError(f"cannot truncate a table of {table.num_tokens} tokens to {num_tokens}")
        size = self.block_size
        keep = num_blocks_for(num_tokens, size)
        released = table._block_ids[keep:]
        to_spare = [b for b in released if self._ref_counts[b] == 1 and self._block_hashes[b] is None]
        last = table._block_ids[keep - 1] if num_tokens % size else None
        cow = last is not None and self._ref_counts[last] > 1
        if cow and not to_spare and not table._spare_ids:
            # No spare for the copy: the private blocks released here are all registered and go cached.
            to_cache = sum(1 for b in released if self._ref_counts[b] == 1)
            self._require(1, self.num_available_blocks + to_cache)
        kept = set(to_spare)
        for block_id in reversed(released):
            if block_id not in kept:
                self._release(block_id)
        table._spare_ids[:0] = to_spare
        del table._block_ids[keep:]
        del table._token_ids[num_tokens:]
        table._num_computed = min(table._num_computed, num_tokens)
        del table._block_hashes[table._num_computed // size :]
        copies: list[BlockCopy] = []
        if cow:
            copies.append(self._copy_last(table, self._take_for(table, 1, replacing_last=True)[0]))
        elif last is not None and self._block_hashes[last] is not None:
            self._unregister(last)
        return copies

    def fork(self, table: BlockTable) -> BlockTable:
        """A new table sharing every block of ``table`` (same tokens; no spares). Never fails; the
        first append into a shared partially filled last block copies it.

        Raises ValueError when ``table`` has positions not yet committed: a block being computed is
        never shared, so only one table ever writes it.
        """
        self._check_live(table)
        if table._num_computed != table.num_tokens:
            raise ValueError(f"{table} has uncommitted positions and cannot be forked")
        child = self._new_table(table._root)
        for block_id in table._block_ids:
            self._acquire(block_id)
        child._block_ids = list(table._block_ids)
        child._token_ids = list(table._token_ids)
        child._block_hashes = list(table._block_hashes)
        child._num_computed = table._num_computed
        return child

    def free(self, table: BlockTable, *, keep_cached: bool = True) -> None:
        """Release all of a table's blocks, spares included, last first (registered ones stay
        cached, evicted before the blocks that precede them). With ``keep_cached=False`` (a deleted
        conversation) the blocks no other table holds are unregistered and freed at once. The table
        is dead afterwards; freeing it again raises."""
        self._check_live(table)
        for block_id in reversed(table._spare_ids):
            self._release(block_id)
        table._spare_ids = []
        for block_id in reversed(table._block_ids):
            if not keep_cached and self._ref_counts[block_id] == 1:
                self._unregister(block_id)
            self._release(block_id)
        table._block_ids = []
        table._token_ids = []
        table._block_hashes = []
        table._num_computed = 0
        table._live = False
        del self._tables[table.table_id]

    def evict_cached(self) -> int:
        """Forget every cached (unreferenced, registered) block; returns how many."""
        count = len(self._cached)
        while self._cached:
            block_id, _ = self._cached.popitem(last=False)
            self._unregister(block_id)
            self._free.add(block_id)
        self._num_evicted += count
        return count

    def verify(self) -> None:
        """Check every invariant of the module docstring; raises AssertionError naming the first
        broken one. O(total blocks); for tests and debugging."""
        refs = [0] * self.num_blocks
        size = self.block_size
        for table in self._tables.values():
            name = repr(table)  # once: the messages below are built whether or not a check fails
            _check(table._live, f"{name} is in the registry but dead")
            held = [*table._block_ids, *table._spare_ids]
            _check(len(set(held)) == len(held), f"{name} holds a block twice (spares included)")
            for block_id in table._spare_ids:
                refs[block_id] += 1
            shared = [b for b in table._spare_ids if self._ref_counts[b] != 1]
            _check(not shared, f"{name} spares {shared} are held by another table")
            registered_spares = [b for b in table._spare_ids if self._block_hashes[b] is not None]
            _check(not registered_spares, f"{name} spares {registered_spares} are registered")
            _check(len(table._block_ids) == num_blocks_for(table.num_tokens, size), f"{name} block count")
            _check(table._num_computed <= table.num_tokens, f"{name} computed past its end")
            _check(len(table._block_hashes) == table._num_computed // size, f"{name} hash count")
            _check(table._block_hashes == self._hashes(table._token_ids[: len(table._block_hashes) * size],
                                                       table._root),
                   f"{name} hashes do not match its tokens")
            for i, block_id in enumerate(table._block_ids):
                refs[block_id] += 1
                registered = self._block_hashes[block_id]
                if registered is not None:
                    _check((i + 1) * size <= table.num_tokens, f"{name} has registered block {block_id} partial")
                    _check(i < len(table._block_hashes) and table._block_hashes[i] == registered,
                           f"{name} holds registered block {block_id} without its hash")
        _check(refs == self._ref_counts, "reference counts differ from the live tables")
        free = {b for b in range(self.num_blocks) if b in self._free}
        cached = set(self._cached)
        _check(len(free) == len(self._free), "the free count differs from the free bitmap")
        _check(not free & cached, "a block is both free and cached")
        for block_id in range(self.num_blocks):
            used = refs[block_id] > 0
            is_registered = self._block_hashes[block_id] is not None
            _check(int(used) + int(block_id in free) + int(block_id in cached) == 1, f"block {block_id} state")
            if block_id in free:
                _check(not is_registered, f"free block {block_id} is registered")
            if block_id in cached:
                _check(is_registered, f"cached block {block_id} is not registered")
        _check(len(self._index) == sum(1 for h in self._block_hashes if h is not None), "index size")
        for block_hash, block_id in self._index.items():
            _check(self._block_hashes[block_id] == block_hash, f"index entry for block {block_id} is stale")
            _check(self._block_token_ids[block_id] is not None, f"registered block {block_id} has no tokens")

    # ------------------------------------------------------------------ internals

    def _root_for(self, namespace: bytes) -> bytes:
        return root_hash(self.salt, namespace) if namespace else self._root

    def _new_table(self, root: bytes) -> BlockTable:
        table = BlockTable(self._next_table_id, self.block_size, root)
        self._next_table_id += 1
        self._tables[table.table_id] = table
        return table

    def _check_live(self, table: BlockTable) -> None:
        if not table._live or self._tables.get(table.table_id) is not table:
            raise ValueError(f"{table} is not a live table of this allocator")

    @staticmethod
    def _require(num_needed: int, num_available: int) -> None:
        if num_needed > num_available:
            raise BlockPoolExhausted(num_needed, num_available)

    def _lookup(self, token_ids: Sequence[int], max_blocks: int, root: bytes) -> tuple[list[int], list[bytes]]:
        block_ids: list[int] = []
        hashes: list[bytes] = []
        parent = root
        size = self.block_size
        for i in range(max_blocks):
            chunk = tuple(token_ids[i * size : (i + 1) * size])
            parent = chain_hash(parent, chunk, self.salt)
            block_id = self._index.get(parent)
            # The stored ids guard against a hash collision handing out another prompt's K/V.
            if block_id is None or self._block_token_ids[block_id] != chunk:
                break
            block_ids.append(block_id)
            hashes.append(parent)
        return block_ids, hashes

    def _append_need(self, table: BlockTable, num_tokens: int) -> tuple[int, bool]:
        """``(blocks, copy)`` for appending ``num_tokens`` positions: the blocks the table must take,
        spares first (new ones, plus the destination of a copy-on-write), and whether its partially
        filled last block is shared and needs that copy first."""
        if num_tokens <= 0:
            return 0, False
        size = self.block_size
        offset = table.num_tokens % size
        room = size - offset if offset else 0
        cow = offset != 0 and self._ref_counts[table._block_ids[-1]] > 1
        return num_blocks_for(max(0, num_tokens - room), size) + int(cow), cow

    @staticmethod
    def _last_held(table: BlockTable) -> int | None:
        """The block a table's next new block should follow: its last spare, else its last block."""
        if table._spare_ids:
            return table._spare_ids[-1]
        return table._block_ids[-1] if table._block_ids else None

    def _take_for(self, table: BlockTable, count: int, *, replacing_last: bool = False) -> list[int]:
        """``count`` blocks for the table's next positions, in position order: its spares first, then
        blocks from the pool continuing its run. ``replacing_last``: the first one replaces the
        table's last block (a copy-on-write), so it follows the block before that one. The caller has
        checked that the pool can supply what the spares do not."""
        spares = table._spare_ids
        taken = spares[:count]
        del spares[:count]
        if len(taken) < count:
            blocks = table._block_ids
            if taken:
                after: int | None = taken[-1]
            elif replacing_last:
                after = blocks[-2] if len(blocks) >= 2 else None
            else:
                after = blocks[-1] if blocks else None
            taken += self._take_blocks(count - len(taken), after)
        return taken

    def _take_blocks(self, count: int, after: int | None) -> list[int]:
        """``count`` blocks from the pool for new content (ref_count 1, unregistered), preferring
        consecutive ids (see the module docstring): the ids right after ``after``, else the first
        free run of ``count``, else the longest free runs; cached blocks, least recently released
        first, only when no free block is left. The caller has checked that ``count`` are available."""
        block_ids = self._pick_free(count, after)
        for block_id in block_ids:
            self._free.remove(block_id)
        while len(block_ids) < count:
            block_id, _ = self._cached.popitem(last=False)
            self._unregister(block_id)
            self._num_evicted += 1
            block_ids.append(block_id)
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def _pick_free(self, count: int, after: int | None) -> list[int]:
        """Up to ``count`` free ids (all free ones when fewer), in the order a table should hold them."""
        free = self._free
        if count <= 0 or not free:
            return []
        start = -1 if after is None else after + 1
        if start >= 0 and free.is_run(start, count):
            return list(range(start, start + count))
        found = free.find_run(count)
        if found >= 0:
            return list(range(found, found + count))
        # No run is long enough (or fewer than count are free): the run that continues the table's
        # first, then the longest ones.
        runs = sorted(free.runs(), key=lambda run: (run[0] != start, -run[1], run[0]))
        picked: list[int] = []
        for first, length in runs:
            take = min(length, count - len(picked))
            picked.extend(range(first, first + take))
            if len(picked) == count:
                break
        return picked

    def _acquire(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._cached[block_id]
        self._ref_counts[block_id] += 1

    def _release(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            if self._block_hashes[block_id] is not None:
                self._cached[block_id] = None
            else:
                self._free.add(block_id)

    def _unregister(self, block_id: int) -> None:
        block_hash = self._block_hashes[block_id]
        if block_hash is not None:
            del self._index[block_hash]
            self._block_hashes[block_id] = None
            self._block_token_ids[block_id] = None

    def _copy_last(self, table: BlockTable, dst: int) -> BlockCopy:
        """Give the table a private copy of its (shared) last block in ``dst``, a block it has taken."""
        src = table._block_ids[-1]
        self._release(src)
        table._block_ids[-1] = dst
        self._num_copied += 1
        return BlockCopy(src, dst)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def flatten_copies(copies: Iterable[BlockCopy]) -> tuple[list[int], list[int]]:
    """``(src_block_ids, dst_block_ids)`` for one batched tensor copy."""
    pairs = list(copies)
    return [c.src_block_id for c in pairs], [c.dst_block_id for c in pairs]
