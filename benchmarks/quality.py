"""How closely each weight / KV setting follows the fp32 forward of the same weights (teacher forcing).

    python -m benchmarks.quality

The reference is transformers' fp32 forward of the converted packaged model (the GGUF's blocks
dequantised exactly), decoding greedily from four chat prompts. Each setting is then fed the reference's
own continuation token by token (teacher forcing), so every position compares like with like: top-1
agreement with the reference, how many disagreements are not near-ties (the reference's two best logits
0.5 or more apart), and the largest |Δlogit|. ``copies`` runs each prompt that many times in one batch, so
a setting can be checked on the wide-step path (the q4 model's dense bf16 twin) as well as on one row.
tests/test_llama_forward.py asserts on the same numbers.
"""

from __future__ import annotations

import torch

from chatd.engine.model.runner import ModelRunner
from devtools.reference import CHAT_PROMPTS, teacher_forced_agreement


def main() -> None:
    import dataclasses

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
