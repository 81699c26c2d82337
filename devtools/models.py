"""The model folders the tests and benchmarks run on: the packaged SmolLM2 converted once per machine, and a tiny
random-init Llama with its real tokenizer (fast tests). Kept in ``.cache/`` (``CHATD_TEST_CACHE``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from chatd.engine.model.packaged import convert_packaged_model

ROOT = Path(__file__).resolve().parent.parent  # the checkout
CACHE_DIR = Path(os.environ.get("CHATD_TEST_CACHE", ROOT / ".cache"))
TINY_VERSION = 1


def packaged_model_dir() -> Path:
    """The packaged SmolLM2 converted to safetensors once per machine (kept in .cache/)."""
    return convert_packaged_model(CACHE_DIR / "data")


def tiny_model_dir(wide: bool = False) -> Path:
    """A 2-layer random-init llama with SmolLM2's real tokenizer and chat template (fast tests). ``wide``: hidden
    256 and intermediate 512, so every matrix's rows hold whole K-quant super-blocks of 256."""
    target = CACHE_DIR / f"tiny-llama{'-wide' if wide else ''}-v{TINY_VERSION}"
    if (target / "config.json").exists():
        return target
    real = packaged_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(real)
    hidden, head_dim = (256, 64) if wide else (64, 16)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=4096,
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
