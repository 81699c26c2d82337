"""Helpers shared by tests and benchmarks: model folders and a from-scratch reference decoder."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache

from chatd.engine.runner import convert_packaged_model

ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = Path(os.environ.get("CHATD_TEST_CACHE", ROOT / ".cache"))
TINY_VERSION = 1


def packaged_model_dir() -> Path:
    """The packaged SmolLM2 converted to safetensors once per machine (kept in .cache/)."""
    return convert_packaged_model(CACHE_DIR / "data")


def tiny_model_dir() -> Path:
    """A 2-layer random-init llama with SmolLM2's real tokenizer and chat template (fast tests)."""
    target = CACHE_DIR / f"tiny-llama-v{TINY_VERSION}"
    if (target / "config.json").exists():
        return target
    real = packaged_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(real)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Wider logits than the default init, so sampled text varies and EOS is rare.
        model.lm_head.weight.normal_(0, 0.5)
    tmp = target.with_name(target.name + f".{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


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
