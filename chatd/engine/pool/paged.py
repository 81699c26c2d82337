"""A paged KV pool and batched attention over block tables, in the manner of PagedAttention.

The pool is one preallocated tensor holding every layer's K and V for ``num_blocks`` blocks of
``block_size`` token positions. Which block holds which sequence's tokens is decided elsewhere
(:mod:`chatd.engine.pool.blocks`); here a sequence is just a row of a block table (block ids, padded) and a
context length, and a token position is a slot ``block_id * block_size + offset``.

Layout, heads outermost within a layer::

    kv: [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]   (2 = K, V)

so a head's slots form one flat ``[num_blocks * block_size, head_dim]`` matrix: a write of many tokens
is one ``index_copy_`` over flat slots, and a gather of a batch's blocks is one ``index_select`` whose
result viewed as ``[batch, kv_heads, tokens, head_dim]`` (a free transpose) has every (row, head)
``[tokens, head_dim]`` slab contiguous, which is what SDPA's CPU kernel reads fastest. The alternatives are
slower: per-block ``[num_blocks, kv_heads, block_size, head_dim]`` needs a permuting copy after the gather;
token-major ``[num_blocks, block_size, kv_heads, head_dim]`` gathers as fast but SDPA reads its interleaved
heads more slowly.

Attention functions make one gather and one ``scaled_dot_product_attention`` call per layer for the
whole batch: no Python loop over sequences. Grouped-query attention folds each KV head's query heads
into the query-length axis (``[batch, kv_heads, group * queries, head_dim]``) instead of passing
``enable_gqa``: same result, and SDPA with ``enable_gqa`` runs slower on the CPU. The same
torch code runs on CUDA (SDPA picks its kernel); a fused paged kernel can replace it there later
behind the same signatures.

An int8 pool (``dtype=torch.int8``) stores each position of a head as a row of ``head_dim`` int8 values
followed by their fp32 scale's 4 bytes, so the last axis is ``head_dim + 4`` (:func:`quantize_rows`): the
scale travels with its values through every copy, gather, snapshot and restore, and a block is still one
contiguous piece of the pool. Writes quantise; the attention functions here widen what they gather
(:func:`dequantize_rows`); the native kernel reads the rows as they are.

Only the engine worker thread may touch these tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

# An int8 row's trailing scale: one fp32, stored as 4 int8 elements after the row's values.
INT8_SCALE_BYTES = 4


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """Elements the pool stores per position and head: ``head_dim``, plus the scale's 4 bytes for int8."""
    return head_dim + INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def kv_bytes_per_token(dtype: torch.dtype, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """KV bytes of one position over all layers (K and V) in the pool at ``dtype``."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * row_width(dtype, head_dim) * element


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` (fp32) as int8 rows ``[..., head_dim + 4]``: ``q = round(x / scale)`` (to nearest
    even) with ``scale = max|x| / 127`` per row (0 and all-zero values for a row of zeros), the scale's fp32
    bytes appended. The native K/V write (chatd/engine/kernels/elementwise.c) computes the same bits."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    values = torch.where(scale > 0, torch.round(x / scale), 0.0).to(torch.int8)
    return torch.cat([values, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 rows ``[..., head_dim + 4]`` back to values ``[..., head_dim]`` (``q * scale``) in ``dtype``."""
    scale = rows[..., -INT8_SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-INT8_SCALE_BYTES].float() * scale).to(dtype)


class PagedKVPool:
    """Every layer's K and V in fixed-size blocks; the device's KV budget is this tensor's size.

    Contents are meaningless until written; slots are whatever the block manager hands out.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", zeroed: bool = True) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # Zeroed by default: padded block-table entries gather block 0 (paged_attention below), and masked-out
        # garbage that happened to be NaN/inf would still poison SDPA's weighted sum on some kernels. A pool
        # whose readers never read an unwritten slot may skip it (``zeroed=False``): on the CPU its pages are
        # then touched only as blocks are first written.
        self.row_width = row_width(dtype, head_dim)
        self.quantized = dtype == torch.int8
        shape = (num_layers, 2, num_kv_heads, num_blocks, block_size, self.row_width)
        # [num_layers, 2, kv_heads, num_blocks, block_size, row_width] (row_width = head_dim unless int8)
        self.kv = (torch.zeros if zeroed else torch.empty)(shape, dtype=dtype, device=self.device)

    @staticmethod
    def bytes_per_block_for(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                            dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * row_width(dtype, head_dim) * element

    @classmethod
    def num_blocks_for_budget(cls, budget_bytes: int, num_layers: int, block_size: int, num_kv_heads: int,
                              head_dim: int, dtype: torch.dtype) -> int:
        """How many blocks a byte budget holds (the pool is the budget)."""
        return budget_bytes // cls.bytes_per_block_for(num_layers, block_size, num_kv_heads, head_dim, dtype)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_block_for(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim,
                                        self.dtype)

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def keys(self, layer: int) -> torch.Tensor:
        """View ``[kv_heads, num_blocks, block_size, row_width]`` of one layer's K."""
        return self.kv[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        """View ``[kv_heads, num_blocks, block_size, row_width]`` of one layer's V."""
        return self.kv[layer, 1]

    def write(self, layer: int, slot_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store K/V of many tokens (any mix of sequences) at their slots, in one op each.

        ``slot_ids``: [num_tokens] int64 on the pool's device, distinct;
        ``keys``/``values``: [num_tokens, kv_heads, head_dim] in the pool's dtype (after RoPE); for an int8
        pool, values of any float dtype (quantised here) or int8 rows ``[..., row_width]`` as they are.
        """
        if self.quantized and keys.dtype != torch.int8:
            keys, values = quantize_rows(keys), quantize_rows(values)
        flat_shape = (self.num_kv_heads, self.num_blocks * self.block_size, self.row_width)
        self.kv[layer, 0].view(flat_shape).index_copy_(1, slot_ids, keys.transpose(0, 1))
        self.kv[layer, 1].view(flat_shape).index_copy_(1, slot_ids, values.transpose(0, 1))

    def copy_blocks(self, src_block_ids: Sequence[int] | torch.Tensor, dst_block_ids: Sequence[int] | torch.Tensor
                    ) -> None:
        """Copy whole blocks (all layers, K and V) for copy-on-write, in one gather and one scatter.

        All sources are read before any destination is written; a destination must not repeat.
        """
        src = torch.as_tensor(src_block_ids, dtype=torch.long, device=self.device)
        dst = torch.as_tensor(dst_block_ids, dtype=torch.long, device=self.device)
        if src.numel():
            self.kv.index_copy_(3, dst, self.kv.index_select(3, src))

    def read_sequence(self, block_ids: Sequence[int], num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Contiguous per-layer copies ``[kv_heads, num_tokens, row_width]`` of one sequence's K and V
        (the snapshot format's per-layer shape), as stored."""
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        # [layers, 2, kv_heads, blocks, block_size, row] -> [layers, 2, kv_heads, tokens, row]
        tokens = self.kv.index_select(3, ids).flatten(3, 4)[:, :, :, :num_tokens].contiguous()
        return [(tokens[layer, 0], tokens[layer, 1]) for layer in range(self.num_layers)]

    def write_sequence(self, block_ids: Sequence[int], layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
                       start: int = 0) -> None:
        """Fill positions ``[start, start + num_tokens)`` of one sequence from per-layer
        ``[kv_heads, num_tokens, row_width]`` K and V as stored (a restore). ``block_ids`` must cover them. Pass
        ``start`` = the positions found cached, so a restore never writes into shared blocks."""
        num_tokens = layers[0][0].shape[1]
        slot_ids = slot_ids_for(block_ids, start, start + num_tokens, self.block_size, self.device)
        for layer, (keys, values) in enumerate(layers):
            self.write(layer, slot_ids, keys.transpose(0, 1).to(self.device, self.dtype),
                       values.transpose(0, 1).to(self.device, self.dtype))


def slot_ids_for(block_ids: Sequence[int], start: int, stop: int, block_size: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Slots ``[stop - start]`` int64 of positions ``[start, stop)`` of a sequence with these blocks."""
    positions = torch.arange(start, stop, device=device)
    blocks = torch.as_tensor(list(block_ids), dtype=torch.long, device=device)
    return blocks[positions // block_size] * block_size + positions % block_size


def slot_mapping(block_tables: torch.Tensor, seq_index: torch.Tensor, positions: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """Slots of packed tokens: token ``t`` is position ``positions[t]`` of sequence ``seq_index[t]``.

    ``block_tables``: [batch, max_blocks] int64; ``seq_index``, ``positions``: [num_tokens] int64.
    Returns [num_tokens] int64.
    """
    return block_tables[seq_index, positions // block_size] * block_size + positions % block_size


def block_table_tensor(block_id_lists: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """Pad per-sequence block ids into ``[batch, max_blocks]`` int64 (padding: block 0, masked out by
    the context lengths)."""
    width = max((len(ids) for ids in block_id_lists), default=0)
    rows = [list(ids) + [0] * (width - len(ids)) for ids in block_id_lists]
    return torch.tensor(rows, dtype=torch.long, device=device).view(len(rows), width)


def gather_blocks(pool: PagedKVPool, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every row's blocks: two ``[batch, kv_heads, max_blocks * block_size, head_dim]``
    strided views of one gathered copy each (an int8 pool's rows widened to fp32)."""
    batch, max_blocks = block_tables.shape
    flat = block_tables.reshape(-1)
    shape = (pool.num_kv_heads, batch, max_blocks * pool.block_size, pool.row_width)
    keys = pool.keys(layer).index_select(1, flat).view(shape).transpose(0, 1)
    values = pool.values(layer).index_select(1, flat).view(shape).transpose(0, 1)
    if pool.quantized:
        keys, values = dequantize_rows(keys), dequantize_rows(values)
    return keys, values


def paged_attention(query: torch.Tensor, pool: PagedKVPool, layer: int, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Decode attention: one new query per sequence over its whole context, for a batch of sequences
    of different lengths, in one gather and one SDPA call.

    ``query``: [batch, num_heads, head_dim] (num_heads a multiple of the pool's kv_heads; GQA);
    ``block_tables``: [batch, max_blocks] int64, each row covering ``context_lens[row]`` positions;
    ``context_lens``: [batch] int64, >= 1, counting the new token, whose K/V must already be written.
    K/V stored narrower than the query are widened to its dtype after the gather.
    Returns [batch, num_heads, head_dim], equal (up to float rounding) to per-sequence SDPA.
    """
    batch, num_heads, head_dim = query.shape
    keys, values = gather_blocks(pool, layer, block_tables)  # [batch, kv_heads, tokens, head_dim]
    if keys.dtype != query.dtype:  # a pool narrower than the activations
        keys, values = keys.to(query.dtype), values.to(query.dtype)
    positions = torch.arange(keys.shape[2], device=query.device)
    mask = (positions[None, :] < context_lens[:, None])[:, None, None, :]  # [batch, 1, 1, tokens] bool
    # Query head h reads KV head h // group (transformers' repeat_kv order).
    grouped = query.view(batch, pool.num_kv_heads, num_heads // pool.num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)  # CUDA kernels may return it non-contiguous


def paged_prefill_attention(query: torch.Tensor, pool: PagedKVPool, layer: int, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, query_lens: torch.Tensor, *,
                            max_query_len: int | None = None, scale: float | None = None) -> torch.Tensor:
    """Packed prefill attention: several sequences' new tokens in one call, each causal within its
    sequence and attending to that sequence's cached prefix.

    ``query``: [num_tokens, num_heads, head_dim], sequences back to back (``query_lens[0]`` tokens of
    row 0, then row 1's, ...); ``query_lens``: [batch] int64 >= 1; ``context_lens``: [batch] int64,
    cached prefix plus new tokens, whose K/V must already be written; ``block_tables`` as for
    :func:`paged_attention`; ``max_query_len``: ``max(query_lens)`` when known (saves a sync).
    Returns [num_tokens, num_heads, head_dim] in the same packed order.

    Rows are padded to the longest query: mixing one long prompt with many single tokens costs
    ``batch * max_query_len`` query rows.
    """
    batch = query_lens.shape[0]
    num_tokens, num_heads, head_dim = query.shape
    device = query.device
    max_q = int(query_lens.max()) if max_query_len is None else max_query_len
    seq_index = torch.repeat_interleave(torch.arange(batch, device=device), query_lens)  # [num_tokens]
    starts = torch.cumsum(query_lens, 0) - query_lens  # [batch]
    local = torch.arange(num_tokens, device=device) - starts[seq_index]  # [num_tokens] index within its row
    padded = query.new_zeros((batch, max_q, num_heads, head_dim))
    padded[seq_index, local] = query

    keys, values = gather_blocks(pool, layer, block_tables)  # [batch, kv_heads, tokens, head_dim]
    num_kv_heads = pool.num_kv_heads
    group = num_heads // num_kv_heads
    key_positions = torch.arange(keys.shape[2], device=device)  # [tokens]
    # Absolute position of each (padded) query row; padding rows sit past the context and are dropped.
    query_positions = (context_lens - query_lens)[:, None] + torch.arange(max_q, device=device)[None, :]
    mask = ((key_positions[None, None, :] <= query_positions[:, :, None])
            & (key_positions[None, None, :] < context_lens[:, None, None]))  # [batch, max_q, tokens] bool
    mask = mask[:, None].expand(batch, group, max_q, keys.shape[2]).reshape(batch, 1, group * max_q, -1)
    # [batch, max_q, heads, head_dim] -> [batch, kv_heads, group * max_q, head_dim]
    grouped = (padded.view(batch, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
               .reshape(batch, num_kv_heads, group * max_q, head_dim))
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    out = (out.view(batch, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
           .reshape(batch, max_q, num_heads, head_dim))
    return out[seq_index, local]
