"""Random-weight GGUFs of real models' shapes and architectures, in a chosen quantisation type, for speed
comparisons (``python -m benchmarks.decode_peer --gguf FILE``): chatd and llama-server read the same file.

    python -m benchmarks.shapes --shape qwen2.5-0.5b --type Q4_0 --out FILE

The weights are random (std 0.02, as transformers initialises them): the text is noise, the work per token is a
real model's. The vocabulary is the packaged model's (49,152 tokens, with its tokenizer), not the real model's, so
the LM head is smaller than the real model's. ``qwen2.5-0.5b`` and ``llama-3.2-1b`` are written as llama files
(Llama's arithmetic at those shapes); ``qwen2.5-0.5b-qwen2`` (q/k/v biases), ``qwen3-0.6b`` (q/k norms) and
``gemma-3-1b`` (Gemma 3's layer, local attention over 512 positions) in their own architectures. Types: those the
``gguf`` package quantises (F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0...) and Q4_K_M / Q5_K_M / Q6_K mixes as llama.cpp
makes them (tests' K-quant encoders; rows must hold whole super-blocks of 256).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from chatd.engine.model.gguf_file import write_gguf
from chatd.engine.model.packaged import PACKAGED_GGUF, packaged_model_dir
from devtools.kquants import ENCODERS

_QWEN25 = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
           "num_key_value_heads": 2, "head_dim": 64, "rope_theta": 1e6}
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": _QWEN25,
    "llama-3.2-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "rope_theta": 5e5},
    "qwen2.5-0.5b-qwen2": _QWEN25,
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1e6},
    "gemma-3-1b": {"hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
                   "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512, "query_pre_attn_scalar": 256},
}
# The architecture each shape is written in (its transformers classes).
FAMILIES: dict[str, tuple[Any, Any]] = {
    "qwen2.5-0.5b-qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3-0.6b": (Qwen3Config, Qwen3ForCausalLM),
    "gemma-3-1b": (Gemma3TextConfig, Gemma3ForCausalLM)}
MIXES = {"Q4_K_M": ("Q4_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}),
         "Q5_K_M": ("Q5_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}),
         "Q6_K": ("Q6_K", {})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--type", required=True, help="Q4_0, Q8_0, Q4_K_M, F16, ...")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    config_class, model_class = FAMILIES.get(args.shape, (LlamaConfig, LlamaForCausalLM))
    config = config_class(vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
                          bos_token_id=1, eos_token_id=2, **SHAPES[args.shape])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = model_class(config)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.02)
            else:  # norms (Gemma's: 1 + 0) and Qwen2's biases: 1
                parameter.fill_(0.0 if config.model_type.startswith("gemma") else 1.0)
    matrix_type, kinds = MIXES.get(args.type, (args.type, {}))
    if args.type in MIXES and any(SHAPES[args.shape][k] % 256 for k in ("hidden_size", "intermediate_size")):
        parser.error(f"{args.shape}'s rows do not hold whole K-quant super-blocks of 256: no {args.type}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(model, args.out, matrix_type, tokenizer_from=packaged_model_dir() / PACKAGED_GGUF,
                     name=f"{args.shape}-{args.type}-random", encoders=ENCODERS, kind_types=kinds)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - started:.0f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
