"""transformers' own forward over chatd's paged caches (``[model] weights = "transformers"``, and every architecture
the compact forward does not cover): prompt runs through transformers' SDPA, decode tokens of several sessions in
one batched pass whose attention reads each session's own cache (no padding)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from chatd.engine.pool.kvcache import SessionKV, any_layer_kv, appending

ATTN_IMPLEMENTATION = "chatd_rows"
"""The attention implementation a model must be loaded with (``attn_implementation``) to run here; see
:func:`register_row_attention`."""


class _RowBatchCache(Cache):
    """Stands in for a cache during a batched decode step: row ``i``'s new K/V go to ``rows[i]``."""

    def __init__(self, rows: Sequence[SessionKV]) -> None:
        super().__init__(layers=[])
        self.rows = rows

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states: [batch, kv_heads, 1, head_dim]
        for i, row in enumerate(self.rows):
            row.paged_layers[layer_idx].update(key_states[i : i + 1], value_states[i : i + 1])
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def _row_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None,
                   chatd_rows: Sequence[SessionKV] | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention for our model: per-row over each session's own cache during batched decode,
    transformers' SDPA otherwise (prefill)."""
    if chatd_rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    layer_idx: int = module.layer_idx  # type: ignore[assignment]
    window = kwargs.get("sliding_window")  # a layer of sliding-window attention sees its last `window` positions
    outputs = []
    for i, row in enumerate(chatd_rows):
        keys, values = any_layer_kv(row, layer_idx)
        if window:
            keys, values = keys[:, -window:], values[:, -window:]
        # query[i]: [heads, 1, head_dim]; keys: [kv_heads, length, head_dim]
        outputs.append(F.scaled_dot_product_attention(
            query[i : i + 1], keys[None].to(query.dtype), values[None].to(query.dtype), scale=scaling,
            enable_gqa=True))
    out = torch.cat(outputs, dim=0)  # [batch, heads, 1, head_dim]
    return out.transpose(1, 2).contiguous(), None


def register_row_attention() -> None:
    """Make ``ATTN_IMPLEMENTATION`` known to transformers (before a model is loaded with it; idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, _row_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)


class TransformersForward:
    """A loaded transformers causal LM run over :class:`SessionKV` caches. Engine thread only."""

    def __init__(self, model: Any) -> None:
        self.model = model

    @torch.inference_mode()
    def step(self, caches: Sequence[SessionKV], runs: Sequence[Sequence[int]]) -> torch.Tensor:
        """The single-token runs as one batched decode, each longer run as its own prefill; the logits of each
        run's last position, ``[len(runs), vocab]``."""
        logits: list[torch.Tensor | None] = [None] * len(runs)
        singles = [i for i, run in enumerate(runs) if len(run) == 1]
        if singles:
            rows = [caches[i] for i in singles]
            with appending(rows, [runs[i] for i in singles]) as step:
                batch = self._decode(rows, [runs[i][0] for i in singles], step.starts)
            for row, i in enumerate(singles):
                logits[i] = batch[row]
        for i, run in enumerate(runs):
            if len(run) > 1:
                with appending([caches[i]], [run]) as step:
                    logits[i] = self._prefill(caches[i], run, step.starts[0])
        return torch.stack([row for row in logits if row is not None])

    def _prefill(self, cache: SessionKV, token_ids: Sequence[int], start: int) -> torch.Tensor:
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.model.device)  # [1, n]
        positions = torch.arange(start, start + ids.shape[1], device=self.model.device)[None]
        out = self.model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    def _decode(self, caches: Sequence[SessionKV], token_ids: Sequence[int], starts: Sequence[int]) -> torch.Tensor:
        device = self.model.device
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)[:, None]  # [batch, 1]
        positions = torch.tensor(list(starts), dtype=torch.long, device=device)[:, None]
        # A 4-D mask makes transformers skip building one; _row_attention does not need it.
        no_mask = torch.empty((len(caches), 1, 1, 0), device=device)
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=no_mask,
                         cache=_RowBatchCache(caches), use_cache=True, logits_to_keep=1, chatd_rows=caches)
        return out.logits[:, -1]
