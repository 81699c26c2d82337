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

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from chatd.engine.runner import ModelRunner

CHAT_PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
                "Explain what a KV cache is in one sentence.", "List three prime numbers.",
                "Give me a tip for learning to cook.", "Why is the sky blue?",
                "Describe a cat to someone who has never seen one.", "What should I pack for a day hike?")
NEAR_TIE = 0.5


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


@dataclass(frozen=True)
class Agreement:
    agree: int
    total: int
    clear_misses: int  # disagreements where the reference's best two logits are NEAR_TIE or more apart
    max_abs_diff: float

    @property
    def ratio(self) -> float:
        return self.agree / self.total if self.total else 0.0


@torch.inference_mode()
def teacher_forced_agreement(runner: ModelRunner, reference: torch.nn.Module, *, copies: int = 1,
                             max_new_tokens: int = 24) -> Agreement:
    tokenizer = runner.tokenizer
    prompts, references, continuations = [], [], []
    for text in CHAT_PROMPTS:
        prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                    return_dict=True)["input_ids"])
        continuation = reference_greedy(reference, prompt, max_new_tokens, runner.info.eos_token_ids)
        logits = reference(input_ids=torch.tensor([prompt + continuation])).logits[0]
        prompts.append(prompt)
        continuations.append(continuation)
        references.append(logits[len(prompt) - 1 : len(prompt) + len(continuation) - 1])  # [n, vocab]
    rows = [i for i in range(len(CHAT_PROMPTS)) for _ in range(copies)]
    caches = [runner.new_cache() for _ in rows]
    got = [[runner.prefill(cache, prompts[i])] for cache, i in zip(caches, rows, strict=True)]
    for position in range(max(len(c) for c in continuations) - 1):
        # Rows whose continuation has ended drop out of the batch.
        active = [row for row, i in enumerate(rows) if position < len(continuations[i]) - 1]
        logits = runner.decode([caches[row] for row in active], [continuations[rows[row]][position] for row in active])
        for out, row in enumerate(active):
            got[row].append(logits[out])
    agree = total = clear = 0
    worst = 0.0
    for row, i in enumerate(rows):
        ours, want = torch.stack(got[row]).float(), references[i]
        worst = max(worst, float((ours - want).abs().max()))
        same = ours.argmax(-1) == want.argmax(-1)
        agree, total = agree + int(same.sum()), total + len(same)
        for position in (~same).nonzero().flatten().tolist():
            top2 = want[position].topk(2).values
            clear += int(float(top2[0] - top2[1]) >= NEAR_TIE)
    for cache in caches:
        cache.free()
    return Agreement(agree, total, clear, worst)


def main() -> None:
    import dataclasses

    from transformers import AutoModelForCausalLM

    from chatd.config import ModelSettings
    from chatd.dev import packaged_model_dir
    from chatd.engine.runner import BF16_TWIN_MIN_ROWS

    folder = packaged_model_dir()
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    wide = -(-BF16_TWIN_MIN_ROWS // len(CHAT_PROMPTS))
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
