"""Test-only helpers: a from-scratch reference decoder. Model folders and the server process come from
chatd.dev, which the benchmarks share."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicCache

from chatd.dev import CACHE_DIR, ROOT, ServerProcess, free_port, packaged_model_dir, tiny_model_dir

__all__ = ["CACHE_DIR", "ROOT", "ServerProcess", "free_port", "packaged_model_dir", "reference_greedy",
           "tiny_model_dir"]


@torch.inference_mode()
def reference_greedy(model: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int,
                     eos_ids: frozenset[int]) -> list[int]:
    """Greedy decoding from scratch with transformers' own DynamicCache (no chatd code on the path)."""
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([list(prompt_ids)]), cache=cache, use_cache=True)
    generated: list[int] = []
    while True:
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        if token in eos_ids or len(generated) >= max_new_tokens:
            return generated
        out = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
