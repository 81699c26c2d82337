"""The decode step of the compact forward, captured once as CUDA graphs and replayed every token.

Eager on a GPU, a decode step of a small model is launch-bound: some twenty kernels per layer, each
queued by Python, most of them finishing in a few microseconds. A CUDA graph records the whole step's
kernels once and replays them with one launch, as vLLM and SGLang do. A graph fixes every shape and
address, so:

* The step reads its inputs from static device buffers: token ids, positions, KV slots, context lengths
  and block tables, one row per sequence. A replay copies the step's rows into them (one host-to-device
  copy) and launches the graph.
* Graphs are captured for bucketed batch sizes (1, 2, 4, 8, 16, 24, 32, ... up to the engine's
  ``max_batch_size``) and context widths (16, 24, 32, 48, 64, ... blocks up to the model's context). A step runs
  the smallest graph that holds it: missing rows are padding, which write their K/V to a scratch block
  that no session holds and attend only to it; table columns past a sequence's length are masked out.
* Attention gathers every row's blocks in one indexed copy per layer (:func:`chatd.engine.pool.paged.gather_blocks`)
  and runs as two batched matmuls around a masked softmax; no Python loop over sessions. Not SDPA: with
  a mask and a few query rows per KV head, SDPA made the graphs slower than the eager forward at long contexts.
* Masked positions still flow through SDPA's weighted sum as ``0 * value``, so every slot must hold a
  finite number: the pool is zeroed once when the graphs are built, before any session exists, and from
  then on slots hold K/V some forward pass wrote.

Prompt chunks (and decode steps that mix in one) run the eager step: their shapes vary too much to be
worth graphs, and each is long enough to keep the GPU busy by itself.

The same step runs uncaptured (``capture=False``) on any device: the tests compare it to the eager
forward on the CPU, and the GPU benchmark uses it to separate what the graphs gain from what the batched
attention gains.

Only the engine worker thread may use this.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence

import torch

from chatd.engine.model.forward import LlamaForward
from chatd.engine.pool.kvcache import KVPool, SessionKV
from chatd.engine.pool.paged import gather_blocks

log = logging.getLogger("chatd.engine.model.graphs")

# Batch sizes with a graph of their own (vLLM's buckets start the same way); the engine's largest batch
# is always one too.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# Narrowest context width with a graph, in blocks; wider ones grow by 1.5x and 4/3x in turn (16, 24, 32,
# 48, 64, ...) up to the model's context, so a row pads its table by at most half its length.
MIN_WIDTH_BLOCKS = 16

# The input buffer's leading columns; the block table follows them.
_IDS, _POSITIONS, _SLOTS, _LENGTHS = range(4)
_TABLE = 4


def batch_buckets(max_batch_size: int) -> list[int]:
    return [b for b in BATCH_BUCKETS if b < max_batch_size] + [max_batch_size]


def width_buckets(max_blocks: int) -> list[int]:
    """Context widths in blocks: MIN_WIDTH_BLOCKS times 1, 1.5, 2, 3, 4, 6, ..., the last one exactly
    ``max_blocks``."""
    widths: list[int] = []
    power = MIN_WIDTH_BLOCKS
    while power < max_blocks:
        widths.extend(w for w in (power, power * 3 // 2) if w < max_blocks)
        power *= 2
    return [*widths, max_blocks]


class DecodeGraphs:
    """Decode steps of ``forward`` over ``pool``, as replayed CUDA graphs (``capture=True``, CUDA only)
    or as the same fixed-shape step run eagerly."""

    def __init__(self, forward: LlamaForward, pool: KVPool, max_batch_size: int, max_context: int, *,
                 capture: bool) -> None:
        if capture and forward.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if pool.allocator.stats().num_tables:
            raise RuntimeError("decode graphs are built before any session holds blocks")
        self.forward = forward
        self.pool = pool
        self.capture = capture
        self.batches = batch_buckets(max_batch_size)
        block_size = pool.block_size
        # Every width must fit the pool too (a session never holds more blocks than the pool has).
        max_blocks = min(-(-max_context // block_size), pool.num_blocks)
        self.widths = width_buckets(max_blocks)
        self.max_context = min(max_context, max_blocks * block_size)
        device = forward.device
        # One block no session will ever hold: padding rows write and read it. Held by a cache of our own
        # with one position, so the allocator never hands it out; a partly filled block is never shared.
        self._scratch = pool.session()
        self._scratch.begin([0])
        self._scratch.commit()
        self.scratch_block = self._scratch.block_ids[0]
        # Zero every slot once (see the module's docstring); nothing else holds blocks yet.
        pool.tensors.kv.zero_()
        rows, columns = self.batches[-1], _TABLE + self.widths[-1]
        # The step's inputs, [rows, 4 + width] int64 on the device; a replay overwrites its top-left corner.
        self.inputs = torch.zeros(rows, columns, dtype=torch.long, device=device)
        self._padding_row = [0, 0, self.scratch_block * block_size, 1, *[self.scratch_block] * self.widths[-1]]
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s = 0.0
        self.replays = 0

    # ------------------------------------------------------------------ the step

    def _step(self, batch: int, width: int) -> torch.Tensor:
        """The decode step over the first ``batch`` rows of the inputs and ``width`` table columns: the
        K/V of each row's token go to its slot, and the logits come back, ``[batch, vocab]`` fp32.
        Fixed shapes and no host synchronisation, so it can be captured."""
        f = self.forward
        s = f.shape
        inputs = self.inputs[:batch]
        ids, positions = inputs[:, _IDS], inputs[:, _POSITIONS]
        slots, lengths = inputs[:, _SLOTS], inputs[:, _LENGTHS]
        tables = inputs[:, _TABLE:_TABLE + width]
        h = f.weights.embed(ids)  # [batch, hidden] fp32
        rope = f._rope_table(positions)
        # [batch, 1, 1, width * block_size]: the positions each row does not attend (past its length)
        hidden = (torch.arange(width * self.pool.block_size, device=ids.device)[None, :] >= lengths[:, None])
        hidden = hidden[:, None, None, :]
        for index, layer in enumerate(f.weights.layers):
            q, k, v = f._qkv(layer, h, rope)
            self.pool.write(index, slots, k, v)
            keys, values = gather_blocks(self.pool.tensors, index, tables)  # [batch, kv_heads, tokens, head_dim]
            # Each KV head's query group as rows: [batch, kv_heads, group, head_dim]
            grouped = q.view(batch, s.num_kv_heads, f.group, s.head_dim)
            scores = torch.matmul(grouped, keys.to(q.dtype).transpose(-1, -2)).mul_(f.scale)
            weights = scores.masked_fill_(hidden, float("-inf")).softmax(dim=-1)
            out = torch.matmul(weights, values.to(q.dtype))  # [batch, kv_heads, group, head_dim]
            h = h + layer.o(out.reshape(batch, s.num_heads * s.head_dim))
            h = h + f._mlp(layer, h)
        return f._logits(h)

    # ------------------------------------------------------------------ capture

    def capture_all(self, progress: Callable[[int, int], None] | None = None) -> float:
        """Capture a graph for every (batch, width) bucket, largest first so the smaller ones reuse its
        memory pool. ``progress(done, total)`` after each. Returns seconds. Without ``capture``: nothing."""
        if not self.capture:
            return 0.0
        started = time.monotonic()
        buckets = [(b, w) for b in reversed(self.batches) for w in reversed(self.widths)]
        memory = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=self.forward.device)
        with torch.inference_mode():
            for done, (batch, width) in enumerate(buckets, start=1):
                self._fill([], [], [], [], batch, width)
                # Warm up on a side stream (lazy initialisation, cuBLAS workspaces), as capture requires.
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._step(batch, width)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=memory):
                    out = self._step(batch, width)
                self._graphs[(batch, width)] = (graph, out)
                if progress is not None:
                    progress(done, len(buckets))
        torch.cuda.synchronize(self.forward.device)
        self.capture_s = time.monotonic() - started
        return self.capture_s

    # ------------------------------------------------------------------ replay

    def fits(self, caches: Sequence[SessionKV]) -> bool:
        """Whether a decode step of these sessions (each gaining one position) has a bucket."""
        return len(caches) <= self.batches[-1] and all(c.length < self.max_context for c in caches)

    def decode(self, caches: Sequence[SessionKV], starts: Sequence[int], slots: Sequence[int],
               token_ids: Sequence[int]) -> torch.Tensor:
        """The step of one token per cache, whose slots are begun (``starts``: their positions, ``slots``:
        their pool slots): writes their K/V, returns logits ``[len(caches), vocab]`` fp32 (a copy, valid
        after the next step)."""
        count = len(caches)
        block_size = self.pool.block_size
        tables = [c.block_ids[:start // block_size + 1] for c, start in zip(caches, starts, strict=True)]
        batch = self.batches[bisect.bisect_left(self.batches, count)]
        width = self.widths[bisect.bisect_left(self.widths, max(len(t) for t in tables))]
        self._fill(token_ids, starts, slots, tables, batch, width)
        self.replays += 1
        if not self.capture:
            return self._step(batch, width)[:count]
        graph, out = self._graphs[(batch, width)]
        graph.replay()
        return out[:count].clone()

    def _fill(self, token_ids: Sequence[int], starts: Sequence[int], slots: Sequence[int],
              tables: Sequence[Sequence[int]], batch: int, width: int) -> None:
        """Write the step's rows (and padding up to ``batch``) into the inputs, in one copy."""
        columns = _TABLE + width
        pad = self._padding_row[:columns]
        rows = [[token, start, slot, start + 1, *table, *pad[_TABLE + len(table):]]
                for token, start, slot, table in zip(token_ids, starts, slots, tables, strict=True)]
        rows.extend([pad] * (batch - len(rows)))
        host = torch.tensor(rows, dtype=torch.long)
        self.inputs[:batch, :columns].copy_(host, non_blocking=self.inputs.is_cuda)

    def close(self) -> None:
        """Drop the graphs and give the scratch block back."""
        self._graphs.clear()
        self._scratch.free(forget=True)
