"""A from-scratch reference for the engine's arithmetic: greedy decoding with transformers' own cache (no chatd
code on the path), and the teacher-forced agreement of a runner with it, which tests/test_llama_forward.py asserts on
and ``python -m benchmarks.quality`` tabulates."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers.cache_utils import DynamicCache

from chatd.engine.model.runner import ModelRunner

CHAT_PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
                "Explain what a KV cache is in one sentence.", "List three prime numbers.",
                "Give me a tip for learning to cook.", "Why is the sky blue?",
                "Describe a cat to someone who has never seen one.", "What should I pack for a day hike?")
NEAR_TIE = 0.5


@torch.inference_mode()
def reference_greedy(model: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int,
                     eos_ids: frozenset[int]) -> list[int]:
    """Greedy decoding from scratch with transformers' own DynamicCache (no chatd code on the path)."""
    cache = DynamicCache(config=cast(Any, model).config)
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
        rendered = cast(Any, tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                           add_generation_prompt=True, return_dict=True))
        prompt = [int(token) for token in rendered["input_ids"]]
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
