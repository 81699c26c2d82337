"""Paged KV pool and batched attention over block tables, against per-sequence contiguous SDPA.

Random tensors, tiny shapes; fp32 so the batched path must match the reference to 1e-5.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F

from chatd.engine.pool.blocks import BlockAllocator, flatten_copies
from chatd.engine.pool.paged import (
    PagedKVPool,
    block_table_tensor,
    paged_attention,
    paged_prefill_attention,
    slot_ids_for,
    slot_mapping,
)

LAYERS, BLOCK, KV_HEADS, HEADS, DIM = 2, 4, 3, 9, 8
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def kv_of(prefix: Sequence[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V ``[kv_heads, head_dim]`` each for the last token of ``prefix``: a function of the whole prefix,
    as a model's are, so equal prefixes give equal K/V and sharing them is exact."""
    seed = int.from_bytes(hashlib.blake2b(repr((layer, tuple(prefix))).encode(), digest_size=8).digest()[:6])
    g = torch.Generator().manual_seed(seed)
    return torch.randn(KV_HEADS, DIM, generator=g), torch.randn(KV_HEADS, DIM, generator=g)


def logical_kv(ids: Sequence[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous ``[kv_heads, len, head_dim]`` K and V of a whole sequence."""
    pairs = [kv_of(ids[: p + 1], layer) for p in range(len(ids))]
    return torch.stack([k for k, _ in pairs], 1), torch.stack([v for _, v in pairs], 1)


def fill(pool: PagedKVPool, block_ids: Sequence[int], ids: Sequence[int], start: int) -> None:
    """Write positions ``[start, len(ids))`` of a sequence into its blocks, as a forward pass would."""
    slots = slot_ids_for(block_ids, start, len(ids), BLOCK, pool.device)
    for layer in range(LAYERS):
        k, v = logical_kv(ids, layer)
        pool.write(layer, slots, k[:, start:].transpose(0, 1).to(pool.device),
                   v[:, start:].transpose(0, 1).to(pool.device))


def reference(query: torch.Tensor, ids: Sequence[int], layer: int, num_new: int) -> torch.Tensor:
    """Per-sequence SDPA over contiguous K/V: ``query`` [num_new, heads, dim] are the last ``num_new``
    positions of ``ids``, causal. Returns [num_new, heads, dim]."""
    k, v = logical_kv(ids, layer)
    n = len(ids)
    mask = torch.arange(n)[None, :] <= torch.arange(n - num_new, n)[:, None]  # [num_new, n]
    out = F.scaled_dot_product_attention(query.cpu().transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def sequences() -> list[list[int]]:
    shared = [7, 3, 9, 1, 4, 4, 2, 8, 5]  # two full blocks + one token
    return [[*shared, 1, 2, 3], [*shared, 6], [5, 5], [*shared, 1, 2, 3, 4, 5, 6, 7, 8, 9], [9]]


def build(device: str, seqs: list[list[int]], num_blocks: int = 32
          ) -> tuple[PagedKVPool, BlockAllocator, list[list[int]]]:
    """Allocate and fill the sequences through the block manager, so common prefixes share blocks."""
    pool = PagedKVPool(LAYERS, num_blocks, BLOCK, KV_HEADS, DIM, device=device)
    allocator = BlockAllocator(num_blocks, BLOCK, salt="test")
    tables = []
    for ids in seqs:
        alloc = allocator.allocate(ids)
        pool.copy_blocks(*flatten_copies(alloc.copies))
        fill(pool, alloc.table.block_ids, ids, alloc.num_cached_tokens)
        allocator.commit(alloc.table)
        tables.append(list(alloc.table.block_ids))
    return pool, allocator, tables


@pytest.mark.parametrize("device", DEVICES)
def test_decode_attention_matches_per_sequence_sdpa_with_shared_blocks(device: str) -> None:
    seqs = sequences()
    pool, allocator, tables = build(device, seqs)
    assert allocator.stats().num_shared_blocks >= 2  # the test exercises sharing
    assert tables[0][:2] == tables[1][:2] == tables[3][:2]
    block_tables = block_table_tensor(tables, device)
    context_lens = torch.tensor([len(s) for s in seqs], device=device)
    query = torch.randn(len(seqs), HEADS, DIM, generator=torch.Generator().manual_seed(0)).to(device)
    for layer in range(LAYERS):
        out = paged_attention(query, pool, layer, block_tables, context_lens)
        assert out.shape == (len(seqs), HEADS, DIM)
        for row, ids in enumerate(seqs):
            expected = reference(query[row : row + 1], ids, layer, 1)[0]
            torch.testing.assert_close(out[row].cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_ignores_padding_blocks_and_wider_tables(device: str) -> None:
    seqs = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 1]]
    pool, _, tables = build(device, seqs)
    unused = 31
    assert all(unused not in t for t in tables)
    pool.kv[:, :, :, unused] = 1e4  # garbage in the padding block must not leak in
    wide = block_table_tensor([[*t, unused, unused] for t in tables], device)
    context_lens = torch.tensor([3, 7], device=device)
    query = torch.randn(2, HEADS, DIM).to(device)
    out = paged_attention(query, pool, 1, wide, context_lens, scale=0.5)
    for row, ids in enumerate(seqs):
        k, v = logical_kv(ids, 1)
        expected = F.scaled_dot_product_attention(query[row, :, None].cpu()[None], k[None], v[None], scale=0.5,
                                                  enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(out[row].cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_packed_prefill_matches_separate_causal_attention(device: str) -> None:
    # Each sequence: a cached prefix (some shared) plus new tokens of different counts.
    seqs = sequences()
    num_new = [3, 1, 2, 11, 1]
    pool, _, tables = build(device, seqs)
    block_tables = block_table_tensor(tables, device)
    context_lens = torch.tensor([len(s) for s in seqs], device=device)
    query_lens = torch.tensor(num_new, device=device)
    query = torch.randn(sum(num_new), HEADS, DIM, generator=torch.Generator().manual_seed(1)).to(device)
    for layer in range(LAYERS):
        out = paged_prefill_attention(query, pool, layer, block_tables, context_lens, query_lens)
        assert out.shape == query.shape
        start = 0
        for ids, n in zip(seqs, num_new, strict=True):
            expected = reference(query[start : start + n], ids, layer, n)
            torch.testing.assert_close(out[start : start + n].cpu(), expected, atol=1e-5, rtol=1e-5)
            start += n
    # Decode is the one-new-token case of prefill.
    ones = torch.ones(len(seqs), dtype=torch.long, device=device)
    decode_query = query[: len(seqs)]
    torch.testing.assert_close(
        paged_prefill_attention(decode_query, pool, 0, block_tables, context_lens, ones, max_query_len=1),
        paged_attention(decode_query, pool, 0, block_tables, context_lens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_copies_every_layer_and_leaves_sources(device: str) -> None:
    pool = PagedKVPool(LAYERS, 6, BLOCK, KV_HEADS, DIM, device=device)
    pool.kv.copy_(torch.randn(pool.kv.shape))
    before = pool.kv.clone()
    pool.copy_blocks([1, 4], [4, 5])  # sources are read before destinations are written
    block = pool.kv.transpose(2, 3)  # [layers, 2, blocks, kv_heads, block_size, head_dim]
    was = before.transpose(2, 3)
    torch.testing.assert_close(block[:, :, 4], was[:, :, 1], atol=0, rtol=0)
    torch.testing.assert_close(block[:, :, 5], was[:, :, 4], atol=0, rtol=0)
    torch.testing.assert_close(block[:, :, [0, 1, 2, 3]], was[:, :, [0, 1, 2, 3]], atol=0, rtol=0)
    pool.copy_blocks([], [])
    torch.testing.assert_close(pool.kv, before.index_copy(3, torch.tensor([4, 5], device=device),
                                                          before[:, :, :, [1, 4]]), atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_copy_on_write_after_truncate_keeps_the_other_sequence(device: str) -> None:
    pool = PagedKVPool(LAYERS, 16, BLOCK, KV_HEADS, DIM, device=device)
    allocator = BlockAllocator(16, BLOCK)
    first_ids = [1, 2, 3, 4, 5, 6, 7]
    first = allocator.allocate(first_ids).table
    fill(pool, first.block_ids, first_ids, 0)
    allocator.commit(first)
    second = allocator.fork(first)
    edited = [1, 2, 3, 4, 5, 9, 9, 9]  # an edit from position 5, inside the shared block
    pool.copy_blocks(*flatten_copies(allocator.truncate(second, 5)))
    allocator.append(second, edited[5:])
    fill(pool, second.block_ids, edited, 5)
    allocator.commit(second)
    tables = block_table_tensor([first.block_ids, second.block_ids], device)
    lens = torch.tensor([7, 8], device=device)
    query = torch.randn(2, HEADS, DIM).to(device)
    out = paged_attention(query, pool, 0, tables, lens)
    torch.testing.assert_close(out[0].cpu(), reference(query[:1], first_ids, 0, 1)[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1].cpu(), reference(query[1:], edited, 0, 1)[0], atol=1e-5, rtol=1e-5)


def test_slot_mapping_read_and_write_sequence_round_trip() -> None:
    pool = PagedKVPool(LAYERS, 8, BLOCK, KV_HEADS, DIM)
    block_ids = [5, 2, 7]
    layers = [(torch.randn(KV_HEADS, 10, DIM), torch.randn(KV_HEADS, 10, DIM)) for _ in range(LAYERS)]
    pool.write_sequence(block_ids, layers)
    back = pool.read_sequence(block_ids, 10)
    for (k, v), (k2, v2) in zip(layers, back, strict=True):
        assert k2.is_contiguous() and k2.shape == (KV_HEADS, 10, DIM)
        torch.testing.assert_close(k2, k, atol=0, rtol=0)
        torch.testing.assert_close(v2, v, atol=0, rtol=0)
    tail = [(torch.randn(KV_HEADS, 3, DIM), torch.randn(KV_HEADS, 3, DIM)) for _ in range(LAYERS)]
    pool.write_sequence(block_ids, tail, start=6)  # positions 6..8 only
    back = pool.read_sequence(block_ids, 10)
    for (k, _), (k_tail, _), (k2, _) in zip(layers, tail, back, strict=True):
        torch.testing.assert_close(k2[:, :6], k[:, :6], atol=0, rtol=0)
        torch.testing.assert_close(k2[:, 6:9], k_tail, atol=0, rtol=0)
        torch.testing.assert_close(k2[:, 9:], k[:, 9:], atol=0, rtol=0)
    tables = block_table_tensor([[5, 2, 7], [1]])
    seq_index = torch.tensor([0, 0, 1])
    positions = torch.tensor([3, 9, 2])
    assert slot_mapping(tables, seq_index, positions, BLOCK).tolist() == [5 * 4 + 3, 7 * 4 + 1, 1 * 4 + 2]
    assert slot_ids_for(block_ids, 3, 6, BLOCK).tolist() == [23, 8, 9]
    assert pool.bytes_per_block * 8 == pool.num_bytes
    assert PagedKVPool.num_blocks_for_budget(pool.num_bytes + 1, LAYERS, BLOCK, KV_HEADS, DIM, torch.float32) == 8
