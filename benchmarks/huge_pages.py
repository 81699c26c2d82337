"""Engine decode with the weights and the KV pool on huge pages vs on the kernel's default pages.

    python -m benchmarks.huge_pages [--weights q4] [--rounds 4] [--tokens 48]

Where pages come from is decided when a process maps its memory, so each setting runs in a fresh process
(``[model] huge_pages`` true / false), the two taking turns ``--rounds`` times so a disturbance on a shared
machine falls on both. Each process loads the packaged model and times greedy decode as
``benchmarks.decode_peer`` does (``ModelRunner.decode``, the prompt cached, best of 2 per case) for one
session at 256 and 2,048 tokens of context and 8 and 16 sessions at 256. Prints medians over the rounds as a
Markdown table, tok/s, with huge ÷ default, and how much of each process's memory was on huge pages.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import torch

CASES = ((256, 1), (2048, 1), (256, 8), (256, 16))


def _huge_bytes() -> int:
    try:
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def child(weights: str, huge_pages: bool, tokens: int, threads: int) -> None:
    from benchmarks.decode_peer import chatd_decode, prompt_ids
    from chatd.config import ModelSettings
    from chatd.engine.model.runner import ModelRunner
    from devtools.models import CACHE_DIR, packaged_model_dir

    torch.set_num_threads(threads)
    packaged_model_dir()
    runner = ModelRunner.load(ModelSettings(source="packaged", weights=weights, threads=threads,
                                            huge_pages=huge_pages), CACHE_DIR / "data")
    runner.pool.wait_populated()  # timed steps do not share the cores with it
    rates = {}
    for context, batch in CASES:
        prompt = prompt_ids(runner, context)
        rates[f"{context}x{batch}"] = max(chatd_decode(runner, prompt, tokens, batch)[0] for _ in range(2))
    print(json.dumps({"rates": rates, "huge_bytes": _huge_bytes()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", default="q4")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=("huge", "default"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.weights, args.child == "huge", args.tokens, args.threads)
        return
    results: dict[str, list[dict[str, object]]] = {"huge": [], "default": []}
    for _ in range(args.rounds):
        for setting in results:
            done = subprocess.run([sys.executable, "-m", "benchmarks.huge_pages", "--child", setting,
                                   "--weights", args.weights, "--tokens", str(args.tokens),
                                   "--threads", str(args.threads)], capture_output=True, text=True, check=True)
            results[setting].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{args.weights} weights, {args.threads} threads, {args.tokens} tokens per case, medians of "
          f"{args.rounds} processes per setting, tok/s")
    print()
    print("| context | sessions | default pages | huge pages | huge / default |")
    print("| --- | --- | --- | --- | --- |")
    for context, batch in CASES:
        key = f"{context}x{batch}"
        a, b = (statistics.median(float(r["rates"][key]) for r in results[s])  # type: ignore[index]
                for s in ("default", "huge"))
        print(f"| {context:,} | {batch} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    print()
    for setting, runs in results.items():
        mb = statistics.median(int(r["huge_bytes"]) for r in runs) / 1e6  # type: ignore[call-overload]
        print(f"{setting}: {mb:.0f} MB of the process on huge pages")


if __name__ == "__main__":
    main()
