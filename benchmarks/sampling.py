"""Time to pick the next tokens of one engine step, for N rows of the packaged model's vocabulary:
``sample_rows`` over the whole step against ``sample`` row by row, for greedy rows, the server's default
sampling (temperature 0.7, top-p 0.95, top-k 50) and nucleus sampling without a top-k.

    python -m benchmarks.sampling [--rows 1,8,16] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from chatd.engine.model.sampling import SamplingParams, make_generator, sample, sample_rows

VOCAB = 49152  # SmolLM2's vocabulary
SETTINGS = {
    "greedy": SamplingParams(max_tokens=1),
    "default (t 0.7, top-p 0.95, top-k 50)": SamplingParams(max_tokens=1, temperature=0.7, top_p=0.95, top_k=50),
    "nucleus (t 0.8, top-p 0.9)": SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9),
}


def per_call_ms(call: Callable[[], object], repeats: int = 30) -> float:
    call()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - started) / repeats * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"ms to sample one step, vocabulary {VOCAB}, {args.threads} threads, torch {torch.__version__}")
    print("| setting | rows | together (sample_rows) | row by row (sample) |")
    print("| --- | --- | --- | --- |")
    for name, params in SETTINGS.items():
        for rows in (int(r) for r in args.rows.split(",")):
            logits = torch.randn(rows, VOCAB) * 3
            gens = [make_generator(params) for _ in range(rows)]
            together = per_call_ms(lambda: sample_rows(logits, [params] * rows, gens))  # noqa: B023
            alone = per_call_ms(lambda: [sample(logits[r], params, gens[r]) for r in range(rows)])  # noqa: B023
            print(f"| {name} | {rows} | {together:.2f} | {alone:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
