"""Random-weight Llama GGUFs of real models' shapes, in a chosen quantisation type, for speed comparisons
(``python -m benchmarks.decode_peer --gguf FILE``): chatd and llama-server read the same file.

    python -m benchmarks.shapes --shape qwen2.5-0.5b --type Q4_0 --out FILE

The weights are random (std 0.02, as transformers initialises them): the text is noise, the work per token is a
real model's. The vocabulary is the packaged model's (49,152 tokens, with its tokenizer), not the real model's,
and the file is a llama one (no Qwen2 biases), so the LM head is smaller than the real model's. Types: those the
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
from transformers import LlamaConfig, LlamaForCausalLM

from chatd.engine.model.gguf_file import write_gguf
from chatd.engine.model.packaged import PACKAGED_GGUF, packaged_model_dir
from devtools.kquants import ENCODERS

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64, "rope_theta": 1e6},
    "llama-3.2-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "rope_theta": 5e5},
}
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
    config = LlamaConfig(vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, **SHAPES[args.shape])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.02)
            else:
                parameter.fill_(1.0)
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
