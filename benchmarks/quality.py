"""How closely each weight / KV setting follows the fp32 forward of the same weights (teacher forcing).

    python -m benchmarks.quality

The reference is transformers' fp32 forward of the converted packaged model (the GGUF's blocks
dequantised exactly), decoding greedily from four chat prompts. Each setting is then fed the reference's
own continuation token by token (teacher forcing), so every position compares like with like: top-1
agreement with the reference, how many disagreements are not near-ties (the reference's two best logits
0.5 or more apart), and the largest |Δlogit|. ``copies`` runs each prompt that many times in one batch, so
a setting can be checked on the wide-step path (the q4 model's dense bf16 twin) as well as on one row.
tests/test_llama_forward.py asserts on the same numbers.

    python -m benchmarks.quality --types Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q4_K_M,Q5_K_M,Q6_K

Per GGUF quantisation type instead: the packaged model's fp32 weights and the tests' wide tiny model written as a
GGUF of each type (K-quants only where rows hold whole super-blocks of 256: not the packaged model's 576), run as
``q4`` with the default KV cache against transformers' fp32 forward of the same file's weights dequantised, so
the rows measure what chatd's reading of each type costs (repacks, requantisations, int8 activations), not the
type's own loss against the original weights.
"""

from __future__ import annotations

import torch

from chatd.engine.model.runner import ModelRunner
from devtools.reference import CHAT_PROMPTS, teacher_forced_agreement


def per_type(types: list[str]) -> None:
    import tempfile
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from chatd.config import ModelSettings
    from chatd.engine.model.gguf_file import write_gguf
    from chatd.engine.model.packaged import PACKAGED_GGUF
    from chatd.engine.model.packaged import packaged_model_dir as packaged_gguf_dir
    from devtools.kquants import ENCODERS
    from devtools.models import packaged_model_dir, tiny_model_dir

    mixes = {"Q4_K_M": ("Q4_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}),
             "Q5_K_M": ("Q5_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"})}
    print("| model | type | top-1 agreement | clear misses | max abs diff | runs as |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as scratch:
        for name, folder in (("SmolLM2-135M", packaged_model_dir()), ("tiny wide (random)", tiny_model_dir(wide=True))):
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            for type_name in types:
                matrix_type, kinds = mixes.get(type_name, (type_name, {}))
                if type_name.endswith(("_K", "_K_M")) and model.config.hidden_size % 256:
                    print(f"| {name} | {type_name} | n/a: rows of {model.config.hidden_size} hold no whole "
                          "super-block | | | |")
                    continue
                path = Path(scratch) / f"{folder.name}-{type_name}.gguf"
                write_gguf(model, path, matrix_type, tokenizer_from=packaged_gguf_dir() / PACKAGED_GGUF,
                                 encoders=ENCODERS, kind_types=kinds)
                runner = ModelRunner.load(ModelSettings(source=str(path), weights="q4"), Path(scratch))
                a = teacher_forced_agreement(runner, runner.model)
                print(f"| {name} | {type_name} | {a.agree} / {a.total} ({100 * a.ratio:.1f} %) | {a.clear_misses} | "
                      f"{a.max_abs_diff:.3f} | {runner.info.weights_from} |", flush=True)
                path.unlink()


def main() -> None:
    import argparse
    import dataclasses

    parser = argparse.ArgumentParser(prog="python -m benchmarks.quality")
    parser.add_argument("--types", help="GGUF types to measure as q4 runs them, e.g. Q4_0,Q8_0,Q4_K_M")
    args = parser.parse_args()
    if args.types:
        per_type(args.types.split(","))
        return

    from transformers import AutoModelForCausalLM

    from chatd.config import ModelSettings
    from chatd.engine.model.choices import BF16_TWIN_MIN_ROWS, FP32_TWIN_MIN_ROWS
    from chatd.engine.model.weights import bf16_matmul_is_fast
    from devtools.models import packaged_model_dir

    folder = packaged_model_dir()
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # Enough rows per step for the dense twin this CPU has (bf16 where it multiplies bf16 in hardware, else fp32).
    twin_rows = BF16_TWIN_MIN_ROWS if bf16_matmul_is_fast() else FP32_TWIN_MIN_ROWS
    wide = -(-twin_rows // len(CHAT_PROMPTS))
    print("| weights | KV dtype | rows per step | top-1 agreement | clear misses | max abs diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    for weights in ("float32", "q4"):
        runner = ModelRunner.load(ModelSettings(source=str(folder), weights=weights), folder)
        for kv in (torch.float32, torch.bfloat16, torch.int8):
            kv_runner = ModelRunner(runner.model, runner.tokenizer, dataclasses.replace(runner.info, dtype=kv),
                                    runner.forward)
            for copies in (1, wide):
                a = teacher_forced_agreement(kv_runner, reference, copies=copies)
                print(f"| {weights} | {str(kv).removeprefix('torch.')} | {copies * len(CHAT_PROMPTS)} | "
                      f"{a.agree} / {a.total} ({100 * a.ratio:.1f} %) | {a.clear_misses} | {a.max_abs_diff:.3f} |",
                      flush=True)


if __name__ == "__main__":
    main()
