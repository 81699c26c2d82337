"""The transformers llama forward with its K/V in the paged pool equals a plain forward.

A blueprint for the runner: an attention function writes each layer's new (post-RoPE) K/V into the
pool at the block manager's slots and attends over block tables; sequences are packed into one row
with per-token position ids. Covers prefix sharing, packed prefill, batched decode and an edit that
copies a shared block, on the tiny random-init model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from chatd.engine.pool.blocks import BlockAllocator, BlockCopy, BlockTable, flatten_copies
from chatd.engine.pool.paged import PagedKVPool, block_table_tensor, paged_attention, paged_prefill_attention

ATTN = "chatd_paged_test"
BLOCK = 4


def _paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None,
                     chatd_paged: dict[str, Any] | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    assert chatd_paged is not None
    pool: PagedKVPool = chatd_paged["pool"]
    layer: int = module.layer_idx  # type: ignore[assignment]
    # query: [1, heads, tokens, head_dim]; key/value: [1, kv_heads, tokens, head_dim], new tokens only
    pool.write(layer, chatd_paged["slot_ids"], key[0].transpose(0, 1), value[0].transpose(0, 1))
    packed = query[0].transpose(0, 1)  # [tokens, heads, head_dim]
    if chatd_paged["decode"]:
        out = paged_attention(packed, pool, layer, chatd_paged["block_tables"], chatd_paged["context_lens"],
                              scale=scaling)
    else:
        out = paged_prefill_attention(packed, pool, layer, chatd_paged["block_tables"], chatd_paged["context_lens"],
                                      chatd_paged["query_lens"], scale=scaling)
    return out[None], None  # [1, tokens, heads, head_dim]


AttentionInterface.register(ATTN, _paged_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN, sdpa_mask)


class Engine:
    def __init__(self, model_dir: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=ATTN)
        self.reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = self.model.config
        self.pool = PagedKVPool(config.num_hidden_layers, 48, BLOCK, config.num_key_value_heads, config.head_dim)
        self.allocator = BlockAllocator(48, BLOCK, salt="tiny")

    def run_copies(self, copies: list[BlockCopy]) -> None:
        self.pool.copy_blocks(*flatten_copies(copies))

    @torch.inference_mode()
    def step(self, tables: list[BlockTable], new_ids: list[list[int]], *, decode: bool = False) -> torch.Tensor:
        """One forward over the new tokens of every table (slots already held); last logits per table."""
        ids: list[int] = []
        positions: list[int] = []
        slot_ids: list[int] = []
        for table, new in zip(tables, new_ids, strict=True):
            start = table.num_tokens - len(new)
            ids += new
            positions += range(start, table.num_tokens)
            slot_ids += table.slot_ids(start)
        query_lens = torch.tensor([len(new) for new in new_ids])
        paged = {"pool": self.pool, "slot_ids": torch.tensor(slot_ids), "decode": decode,
                 "block_tables": block_table_tensor([t.block_ids for t in tables]),
                 "context_lens": torch.tensor([t.num_tokens for t in tables]), "query_lens": query_lens}
        # A 4-D mask makes transformers skip building one; the attention function needs none.
        out = self.model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]),
                         attention_mask=torch.empty((1, 1, 1, 0)), use_cache=False,
                         logits_to_keep=torch.cumsum(query_lens, 0) - 1, chatd_paged=paged)
        for table in tables:
            self.allocator.commit(table)
        return out.logits[0]  # [batch, vocab]

    @torch.inference_mode()
    def expected(self, ids: list[int]) -> torch.Tensor:
        return self.reference(input_ids=torch.tensor([ids])).logits[0, -1]


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Engine:
    return Engine(tiny_dir)


def test_llama_forward_through_the_pool_matches_plain_forward(engine: Engine) -> None:
    def close(actual: torch.Tensor, ids: list[int]) -> None:
        torch.testing.assert_close(actual, engine.expected(ids), atol=2e-5, rtol=1e-4)

    allocator = engine.allocator
    g = torch.Generator().manual_seed(0)
    a_ids = torch.randint(3, 1000, (18,), generator=g).tolist()
    b_ids = [*a_ids[:16], *torch.randint(3, 1000, (5,), generator=g).tolist()]
    c_ids = torch.randint(3, 1000, (7,), generator=g).tolist()

    a = allocator.allocate(a_ids)
    close(engine.step([a.table], [a_ids])[0], a_ids)
    # b finds a's first four blocks; b and c prefill together in one packed forward.
    b = allocator.allocate(b_ids, max_cached_tokens=len(b_ids) - 1)
    c = allocator.allocate(c_ids)
    assert b.num_cached_tokens == 16
    engine.run_copies([*b.copies, *c.copies])
    logits = engine.step([b.table, c.table], [b_ids[16:], c_ids])
    close(logits[0], b_ids)
    close(logits[1], c_ids)

    tables, seqs = [a.table, b.table, c.table], [a_ids, b_ids, c_ids]
    for _ in range(3):
        new = [int(x) for x in torch.randint(3, 1000, (3,), generator=g)]
        copies = [copy for table, token in zip(tables, new, strict=True) for copy in allocator.append(table, [token])]
        engine.run_copies(copies)
        seqs = [[*ids, token] for ids, token in zip(seqs, new, strict=True)]
        logits = engine.step(tables, [[token] for token in new], decode=True)
        for row, ids in enumerate(seqs):
            close(logits[row], ids)

    # An edit of b inside the prefix it shares with a: b gets a copy, a is unchanged.
    copies = allocator.truncate(b.table, 10)
    assert len(copies) == 1
    copies += allocator.append(b.table, [5, 6, 7])
    engine.run_copies(copies)
    close(engine.step([b.table], [[5, 6, 7]])[0], [*seqs[1][:10], 5, 6, 7])
    allocator.append(a.table, [11])
    close(engine.step([a.table], [[11]], decode=True)[0], [*seqs[0], 11])

    allocator.verify()
    for table in tables:
        allocator.free(table)
    assert allocator.stats().num_used_blocks == 0
