"""Session KV caches in one paged pool per device.

The device's KV memory is a :class:`KVPool`: one preallocated tensor of fixed-size blocks
(:class:`~chatd.engine.pool.paged.PagedKVPool`) and the block bookkeeping that hands them out
(:class:`~chatd.engine.pool.blocks.BlockAllocator`: block tables, refcounts, prefix sharing by chain hash,
copy-on-write, an LRU of released blocks that stay findable). The pool's size is the KV budget.

A :class:`SessionKV` is one session's cache: a block table in the pool. Its positions are written by a
forward pass in three steps, all on the engine thread: :meth:`SessionKV.begin` appends the step's token
ids to the table and returns their pool slots, the forward pass writes K/V at those slots (one indexed
copy per layer for every session of the step), and :meth:`SessionKV.commit` declares them computed,
which registers full blocks where other sessions' prompts find them. A failed pass calls
:meth:`SessionKV.abort` instead.

Attention reads a session's K/V straight from the pool: the table's blocks are split into runs of
consecutive block ids (the allocator keeps them long by reserving a turn's room up front), each run is
a strided view of the pool, so a table that is one run costs no copy at all. Several runs (a shared
prefix followed by the session's own blocks) are attended one by one and merged by their log-sum-exp
(:func:`attend`).

Only the engine worker thread may touch these objects (see worker.py).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from chatd.engine.pool.blocks import BlockAllocator, BlockCopy, BlockStats, BlockTable, flatten_copies
from chatd.engine.pool.free_blocks import block_runs
from chatd.engine.pool.hugepages import Populating, release_pages
from chatd.engine.pool.paged import PagedKVPool, dequantize_rows

# Token positions per block: small enough that a shared prefix ends close to where sessions diverge, large
# enough that a table of a few thousand tokens is a handful of runs and hashing a block is cheap.
BLOCK_SIZE = 16

Layers = list[tuple[torch.Tensor, torch.Tensor]]


class KVPool:
    """Every session's K/V: ``num_blocks`` blocks of ``block_size`` positions, all layers."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, num_blocks: int, *, block_size: int = BLOCK_SIZE,
                 salt: bytes | str = b"") -> None:
        # Not zeroed: attention reads only positions a forward pass or a restore wrote.
        self.tensors = PagedKVPool(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                                   device=device, zeroed=False)
        self.allocator = BlockAllocator(num_blocks, block_size, salt=salt)
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        # int8: every position of a head is stored as a row of head_dim values and its scale (chatd.engine.pool.paged)
        self.quantized = self.tensors.quantized
        self.row_width = self.tensors.row_width
        self.device = torch.device(device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        # The thread faulting the pool's pages in ahead of use, where the runner started one (huge pages).
        self.populating: Populating | None = None

    @property
    def populated(self) -> bool:
        """Whether no thread is still faulting the pool's pages in (pages not populated ahead fault in on use)."""
        return self.populating is None or not self.populating.is_alive()

    def wait_populated(self, timeout: float | None = None) -> bool:
        """Wait for the pages to be populated (benchmarks: not to time steps beside it); whether they are."""
        if self.populating is not None:
            self.populating.join(timeout)
        return self.populated

    def release(self) -> None:
        """Give the pool's memory back now, when its engine has stopped (a server closing; tests open many in
        one process): its contents are gone. Not left to the garbage collector alone: the engine's objects
        refer to each other, so the tensor lives on until a full collection, and a populated pool is all
        resident. The mapping itself stays until then (touching it again reads zeros; nothing crashes)."""
        if self.populating is not None:
            self.populating.stop()
        release_pages(self.tensors.kv)

    @classmethod
    def for_budget(cls, budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   device: torch.device | str, *, block_size: int = BLOCK_SIZE, salt: bytes | str = b"") -> KVPool:
        """The largest pool that fits ``budget_bytes`` (at least one block)."""
        per_block = PagedKVPool.bytes_per_block_for(num_layers, block_size, num_kv_heads, head_dim, dtype)
        return cls(num_layers, num_kv_heads, head_dim, dtype, device, max(1, budget_bytes // per_block),
                   block_size=block_size, salt=salt)

    @property
    def bytes_per_block(self) -> int:
        return self.tensors.bytes_per_block

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def used_bytes(self) -> int:
        """Bytes of blocks held by sessions (cached blocks nobody holds are reclaimable, so not counted)."""
        return (self.num_blocks - self.allocator.num_available_blocks) * self.bytes_per_block

    def stats(self) -> BlockStats:
        return self.allocator.stats()

    def session(self) -> SessionKV:
        return SessionKV(self)

    def copy(self, copies: Sequence[BlockCopy]) -> None:
        """Execute copy-on-write instructions from the allocator."""
        if copies:
            self.tensors.copy_blocks(*flatten_copies(copies))

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """K/V ``[n, kv_heads, head_dim]`` of ``n`` positions (any mix of sessions) at ``slots`` ``[n]``, in
        one indexed copy each; activations wider than the pool's dtype are narrowed (quantised for an int8
        pool, which also takes its own rows ``[n, kv_heads, row_width]`` as they are)."""
        if not self.quantized:
            keys, values = keys.to(self.dtype), values.to(self.dtype)
        self.tensors.write(layer, slots, keys, values)

    def run_views(self, block_ids: Sequence[int], num_tokens: int
                  ) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """The first ``num_tokens`` positions of a table with ``block_ids``, as one (keys, values) pair of
        per-layer ``[1, kv_heads, run_length, row_width]`` views per run of consecutive blocks (as stored: an
        int8 pool's rows carry their scales)."""
        runs = []
        size = self.block_size
        done = 0
        for first, count in block_runs(block_ids):
            length = min(count * size, num_tokens - done)
            if length <= 0:
                break
            # [layers, 2, kv_heads, count, block_size, row] -> [layers, 2, kv_heads, length, row]
            view = self.tensors.kv[:, :, :, first:first + count].flatten(3, 4)[:, :, :, :length]
            runs.append((list(view[:, 0, None].unbind(0)), list(view[:, 1, None].unbind(0))))
            done += length
        return runs


class _PagedLayer(DynamicLayer):
    """One layer of a session as transformers' forward sees it (the fallback for models without the compact
    forward): ``update`` writes the step's new K/V at the session's pending slots and returns all of it."""

    def __init__(self, session: SessionKV, layer: int) -> None:
        super().__init__()
        self.session = session
        self.layer = layer
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
               ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states: [1, kv_heads, new, head_dim], new == the tokens passed to begin()
        session = self.session
        session.pool.write(self.layer, session.pending_slots(), key_states[0].transpose(0, 1),
                           value_states[0].transpose(0, 1))
        return self.current()

    def current(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[1, kv_heads, positions, head_dim]`` of every position written so far (a copy when the
        table is more than one run)."""
        runs = self.session.run_views(written=True)
        keys = [r[0][self.layer] for r in runs]
        values = [r[1][self.layer] for r in runs]
        if len(runs) == 1:
            return keys[0], values[0]
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

    def get_seq_length(self) -> int:
        return self.session.length


class SessionKV(DynamicCache):
    """The KV cache of one session: a block table in a :class:`KVPool`. Engine thread only.

    ``length`` positions are computed; ``capacity`` positions fit the blocks held (reserved room
    included) without taking more from the pool."""

    def __init__(self, pool: KVPool) -> None:
        Cache.__init__(self, layers=[_PagedLayer(self, i) for i in range(pool.num_layers)])
        self.pool = pool
        self.num_kv_heads = pool.num_kv_heads
        self.head_dim = pool.head_dim
        self.dtype = pool.dtype
        self.device = pool.device
        self._table: BlockTable | None = None
        self._pending_ids: list[int] | None = None
        self._pending_slots: torch.Tensor | None = None
        self._restore_views: Layers | None = None

    # ------------------------------------------------------------------ queries

    @property
    def paged_layers(self) -> Sequence[_PagedLayer]:
        return self.layers  # type: ignore[return-value]

    @property
    def table(self) -> BlockTable:
        if self._table is None:
            self._table = self.pool.allocator.allocate([]).table
        return self._table

    # The queries below may be read by the event loop while the engine thread works: each reads the table
    # once (free() may drop it in between) and tolerates a count from a neighbouring moment.

    @property
    def length(self) -> int:
        table = self._table
        return 0 if table is None else table.num_computed_tokens

    @property
    def capacity(self) -> int:
        table = self._table
        return 0 if table is None else table.capacity

    @property
    def token_ids(self) -> Sequence[int]:
        table = self._table
        return () if table is None else table.token_ids[: table.num_computed_tokens]

    @property
    def block_ids(self) -> Sequence[int]:
        table = self._table
        return () if table is None else table.block_ids

    def bytes_per_token(self) -> int:
        return self.pool.bytes_per_token

    @property
    def num_bytes(self) -> int:
        """Bytes of every block held (shared ones included, reserved room included)."""
        return self.capacity * self.pool.bytes_per_token

    @property
    def private_bytes(self) -> int:
        """Bytes of the blocks only this session holds: what freeing it gives back to the pool."""
        table = self._table
        if table is None:
            return 0
        allocator = self.pool.allocator
        private = sum(1 for b in list(table.block_ids) if allocator.ref_count(b) == 1)
        return (private + len(table.spare_block_ids)) * self.pool.bytes_per_block

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    # ------------------------------------------------------------------ room

    def reserve(self, capacity: int) -> None:
        """Hold room for ``capacity`` positions in total, or give back room beyond it (never below the
        positions held). Raises BlockPoolExhausted (changing nothing) when the pool lacks the blocks."""
        if capacity > self.capacity:
            self.pool.allocator.reserve(self.table, capacity)
        elif self._table is not None:
            self.pool.allocator.trim(self._table, capacity)

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` positions (an edit, or a prefix to reuse). A block still shared
        with another session is copied first, so nothing this session writes later reaches the other."""
        if self._table is not None and length < self._table.num_tokens:
            self.pool.copy(self.pool.allocator.truncate(self._table, length))

    def free(self, *, forget: bool = False) -> None:
        """Give every block back (the cache is empty afterwards, and may be used again). Blocks registered
        by hash stay findable until their room is needed, unless ``forget`` (a deleted conversation): then
        the ones nobody else holds are freed outright."""
        if self._table is not None:
            self.pool.allocator.free(self._table, keep_cached=not forget)
            self._table = None
            self._pending_slots = None
            self._restore_views = None

    def share_prefix(self, other: SessionKV, length: int) -> None:
        """Make this (empty) cache start with ``other``'s first ``length`` positions by referencing its blocks
        (a partly filled last block is copied). The two stay independent: a write to either never reaches
        the other."""
        if length > other.length:
            raise ValueError(f"the source holds {other.length} positions, not {length}")
        self.free()
        if length == 0:
            return
        self._table = self.pool.allocator.fork(other.table)
        self.truncate(length)

    def adopt_cached_prefix(self, token_ids: Sequence[int], max_tokens: int) -> int:
        """Start this (empty) cache with the longest run of registered blocks that begins ``token_ids`` (at
        most ``max_tokens`` positions): blocks computed by any session, live or released, in this pool.
        Returns how many positions it holds."""
        self.free()
        allocation = self.pool.allocator.allocate(list(token_ids[:max_tokens]), max_cached_tokens=max_tokens)
        self._table = allocation.table
        self.pool.copy(allocation.copies)
        self.truncate(allocation.num_cached_tokens)  # the rest stays held as room for the turn
        return allocation.num_cached_tokens

    # ------------------------------------------------------------------ a forward pass

    def begin(self, token_ids: Sequence[int]) -> list[int]:
        """Hold slots for ``token_ids`` after the computed positions; returns them (pool slot ids). Call
        :meth:`commit` once the forward pass wrote them, :meth:`abort` if it failed."""
        table = self.table
        if table.num_tokens != table.num_computed_tokens:
            raise RuntimeError("a forward pass on this cache was begun and not finished")
        start = table.num_tokens
        self.pool.copy(self.pool.allocator.append(table, token_ids))
        self._pending_ids = list(table.slot_ids(start))
        self._pending_slots = None
        return self._pending_ids

    def pending_slots(self) -> torch.Tensor:
        """The begun slots, ``[n]`` int64 on the pool's device (made on first use)."""
        if self._pending_ids is None:
            raise RuntimeError("no forward pass begun on this cache")
        if self._pending_slots is None:
            self._pending_slots = torch.tensor(self._pending_ids, dtype=torch.long, device=self.pool.device)
        return self._pending_slots

    def commit(self) -> None:
        """The begun positions are written: they become part of ``length``."""
        self.pool.allocator.commit(self.table)
        self._pending_ids = self._pending_slots = None

    def abort(self) -> None:
        """The begun positions were not (all) written: drop them."""
        if self._table is not None:
            self.truncate(self._table.num_computed_tokens)
        self._pending_ids = self._pending_slots = None

    def run_views(self, *, written: bool = True) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Per run of consecutive blocks, per-layer K and V views ``[1, kv_heads, n, head_dim]`` of the
        positions held (``written``: including the begun ones; else only the computed ones)."""
        table = self.table
        return self.pool.run_views(table.block_ids, table.num_tokens if written else table.num_computed_tokens)

    # ------------------------------------------------------------------ snapshots

    def filled_layers(self) -> Layers:
        """Per-layer ``[kv_heads, length, row_width]`` K/V of the computed positions as stored: views of the
        pool when the table is one run (each head's slab contiguous), copies otherwise."""
        if self.length == 0:
            empty = torch.empty((self.num_kv_heads, 0, self.pool.row_width), dtype=self.dtype, device=self.device)
            return [(empty, empty) for _ in range(self.pool.num_layers)]
        runs = self.run_views(written=False)
        if len(runs) == 1:
            keys, values = runs[0]
            return [(k[0], v[0]) for k, v in zip(keys, values, strict=True)]
        return [(torch.cat([r[0][layer][0] for r in runs], dim=1), torch.cat([r[1][layer][0] for r in runs], dim=1))
                for layer in range(self.pool.num_layers)]

    def restore_begin(self, token_ids: Sequence[int]) -> Layers | None:
        """Hold slots for a snapshot's ``token_ids`` in this empty cache (room reserved beforehand keeps
        them one run). Returns per-layer ``[kv_heads, n, row_width]`` views of the pool to decode the file
        into when they are one run on the CPU, else None: decode into other tensors and pass those to
        :meth:`restore_finish`."""
        if self.length or (self._table is not None and self._table.num_tokens):
            raise RuntimeError("a restore needs an empty cache")
        self.begin(token_ids)
        runs = self.run_views(written=True)
        if len(runs) == 1 and self.device.type == "cpu":
            keys, values = runs[0]
            self._restore_views = [(k[0], v[0]) for k, v in zip(keys, values, strict=True)]
            return self._restore_views
        return None

    def restore_finish(self, layers: Layers) -> None:
        """The snapshot's positions are decoded into ``layers`` (per-layer ``[kv_heads, n, row_width]``): the
        views :meth:`restore_begin` returned, or other tensors, which are written to the slots now."""
        if layers is not self._restore_views:
            slots = self.pending_slots()
            for layer, (keys, values) in enumerate(layers):
                self.pool.write(layer, slots, keys.to(self.device).transpose(0, 1),
                                values.to(self.device).transpose(0, 1))
        self._restore_views = None
        self.commit()


@dataclass
class StepSlots:
    """What a forward pass needs to know about where its rows go."""

    starts: list[int]
    """Per run, the position of its first token (the cache's length before the step)."""
    slot_ids: list[int]
    """Every row's pool slot, runs back to back."""
    device: torch.device

    @functools.cached_property
    def slots(self) -> torch.Tensor:
        """``slot_ids`` as ``[rows]`` int64 on the pool's device: one copy for the whole step, made when a
        forward pass first asks (the captured decode step reads ``slot_ids`` and never does)."""
        return torch.tensor(self.slot_ids, dtype=torch.long, device=self.device)


@contextlib.contextmanager
def appending(caches: Sequence[SessionKV], runs: Sequence[Sequence[int]]) -> Iterator[StepSlots]:
    """Begin ``runs[i]`` on ``caches[i]`` for every ``i`` around a forward pass: commit all when the block
    exits normally, abort all when it raises. Caches must be distinct and share one pool."""
    starts: list[int] = []
    slots: list[int] = []
    begun: list[SessionKV] = []
    try:
        for cache, run in zip(caches, runs, strict=True):
            starts.append(cache.length)
            slots.extend(cache.begin(run))
            begun.append(cache)
        yield StepSlots(starts, slots, caches[0].pool.device)
    except BaseException:
        for cache in begun:
            cache.abort()
        raise
    for cache in begun:
        cache.commit()


def attend(query: torch.Tensor, runs: Sequence[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None,
           scale: float) -> torch.Tensor:
    """Attention of ``query`` ``[1, kv_heads, m, head_dim]`` (each KV head's query group folded into ``m``)
    over K/V given as runs of ``[1, kv_heads, n_i, head_dim]`` that make up the sequence in order.
    ``mask``: None (all visible) or bool ``[m, sum(n_i)]``. Returns ``[1, kv_heads, m, head_dim]``.

    One run is one SDPA call on the views. Several are attended separately on the CPU and merged by
    their log-sum-exp, which reads each run in place; elsewhere they are concatenated first."""
    if len(runs) == 1:
        keys, values = runs[0]
        if keys.dtype != query.dtype:  # a cache stored in a narrower dtype than the activations
            keys, values = keys.to(query.dtype), values.to(query.dtype)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
    if query.device.type != "cpu":
        keys = torch.cat([k for k, _ in runs], dim=2).to(query.dtype)
        values = torch.cat([v for _, v in runs], dim=2).to(query.dtype)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
    outs: list[torch.Tensor] = []
    lses: list[torch.Tensor] = []
    bounds = list(itertools.accumulate((k.shape[2] for k, _ in runs), initial=0))
    for i, (keys, values) in enumerate(runs):
        part = None if mask is None else mask[:, bounds[i]:bounds[i + 1]]
        visible = None if part is None else part.any(dim=-1)  # [m]: rows that see some of this run
        if visible is not None and not bool(visible.any()):
            continue  # the causal part of a chunk: no row sees this run
        additive = None if part is None else torch.zeros(part.shape, dtype=query.dtype).masked_fill_(~part, -math.inf)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, keys.to(query.dtype), values.to(query.dtype), attn_mask=additive, scale=scale)
        if visible is not None and not bool(visible.all()):
            # A row that sees nothing here gets weight 0 in the merge, and no NaN into the sum.
            out = torch.where(visible[:, None], out, 0.0)
            lse = lse.masked_fill(~visible, -math.inf)
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0]
    top = torch.stack(lses).amax(dim=0)  # [1, kv_heads, m]
    weights = [(lse - top).exp().unsqueeze(-1) for lse in lses]
    total = torch.stack(weights).sum(dim=0)
    merged = sum((o * w for o, w in zip(outs, weights, strict=True)), torch.zeros_like(outs[0]))
    return merged / total


def any_layer_kv(cache: SessionKV, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[kv_heads, positions, head_dim]`` of one layer of a :class:`SessionKV` (a copy for a table
    of several runs, or an int8 pool's rows widened to fp32); for tests and the fallback attention."""
    keys, values = cache.paged_layers[layer].current()
    if cache.pool.quantized:
        return dequantize_rows(keys[0]), dequantize_rows(values[0])
    return keys[0], values[0]
