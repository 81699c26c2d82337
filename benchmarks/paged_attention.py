"""Decode attention cost on this machine: paged gather + one SDPA vs a per-row Python loop.

    python -m benchmarks.paged_attention [--threads 1] [--repeat 20] [--device cpu]

SmolLM2-135M shapes (9 query heads, 3 KV heads, head_dim 64), fp32, block size 16, one layer;
"x30" multiplies by the model's 30 layers to show the share of a decode step. Prints a Markdown table:

* paged: :func:`chatd.engine.pool.paged.paged_attention` (one gather + one SDPA for the batch);
* rows, pool: a Python loop, per row a gather of its blocks + SDPA;
* rows, own buffers: a Python loop, per row SDPA over its own contiguous K/V (the engine's
  attention before the paged pool: no gather, but one call per row).

Random tensors and block ids; timings are the best of ``--repeat`` runs (the least disturbed by other
load on a shared machine), so they show each method's own cost; still rough.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from chatd.engine.pool.paged import PagedKVPool, paged_attention

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 9, 3, 64, 30, 16


def _best_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times) * 1000


def measure(batch: int, context: int, repeat: int, device: torch.device) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    blocks_per_row = context // BLOCK
    num_blocks = batch * blocks_per_row + 8
    pool = PagedKVPool(1, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen))
    # Rows own scattered blocks, as after many allocations and frees.
    order = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_row]
    block_tables = order.view(batch, blocks_per_row).to(device)  # [batch, max_blocks] int64
    # Mixed lengths: every row ends within its last block.
    context_lens = torch.tensor([context - (i % BLOCK) for i in range(batch)], device=device)
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(device)  # [batch, heads, head_dim]
    own = [(torch.randn(1, KV_HEADS, int(n), HEAD_DIM, generator=gen).to(device),
            torch.randn(1, KV_HEADS, int(n), HEAD_DIM, generator=gen).to(device)) for n in context_lens]

    def paged() -> torch.Tensor:
        return paged_attention(query, pool, 0, block_tables, context_lens)

    def rows_pool() -> torch.Tensor:
        outs = []
        for row in range(batch):
            n = int(context_lens[row])
            ids = block_tables[row]
            k = pool.keys(0).index_select(1, ids).flatten(1, 2)[:, :n]  # [kv_heads, n, head_dim]
            v = pool.values(0).index_select(1, ids).flatten(1, 2)[:, :n]
            outs.append(F.scaled_dot_product_attention(query[row, None, :, None], k[None], v[None],
                                                       enable_gqa=True))
        return torch.cat(outs)

    def rows_own() -> torch.Tensor:
        outs = [F.scaled_dot_product_attention(query[row, None, :, None], k, v, enable_gqa=True)
                for row, (k, v) in enumerate(own)]
        return torch.cat(outs)

    with torch.inference_mode():
        return {"paged": _best_ms(paged, repeat), "rows, pool": _best_ms(rows_pool, repeat),
                "rows, own buffers": _best_ms(rows_own, repeat)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"decode attention, one layer, fp32, block {BLOCK}, {args.threads} thread(s), {device}; ms per call "
          f"(x30 = per decode step)\n")
    print("| batch | context | paged | rows, pool | rows, own buffers | paged x30 | paged per row |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for context in (256, 1024):
        for batch in (1, 8, 16):
            r = measure(batch, context, args.repeat, device)
            print(f"| {batch} | {context} | {r['paged']:.3f} | {r['rows, pool']:.3f} | {r['rows, own buffers']:.3f} "
                  f"| {r['paged'] * LAYERS:.1f} | {r['paged'] / batch:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
