"""Decode speed side by side with llama.cpp's llama-server: same model file, same threads, one run.

    python -m benchmarks.decode_peer --llama-server PATH [--threads 2] [--weights float32,q4,q4/bfloat16]
                                     [--contexts 256,1024,2048] [--tokens 64] [--rounds 3] [--batch 8,16]
                                     [--gguf FILE]

The packaged GGUF unless ``--gguf`` names another (``python -m benchmarks.shapes`` writes random-weight ones of
real models' shapes in each quantisation type).

For each context length a greedy decode of ``--tokens`` tokens after a prompt of that many tokens: chatd's
engine step (``ModelRunner.prefill`` then ``ModelRunner.decode`` one token at a time, the calls the engine
worker makes) against llama-server's ``/completion`` (``timings.predicted_per_second``, prompt caching off).
The prompt's prefill is compared too: chatd's in chunks of 256 tokens, as the engine prefills one prompt
alone, against ``timings.prompt_per_second`` of the same request. Runs alternate chatd and llama-server round
by round, so a busy moment of the machine hits both. With ``--batch N`` it also measures aggregate decode of N
sessions at once: chatd's batched ``decode`` of N caches against N concurrent requests to llama-server started
with ``-np N`` (the largest N given). A ``--weights`` entry ``W/D`` runs weights ``W`` with a ``D`` KV cache
(``[model] dtype``).
The table reports medians and chatd ÷ llama-server. ``make peer`` builds llama-server.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.peer import LlamaServer, packaged_gguf
from chatd.config import ModelSettings
from chatd.engine.model.runner import ModelRunner
from devtools.models import CACHE_DIR, ROOT, packaged_model_dir


def prompt_ids(runner: ModelRunner, n: int) -> list[int]:
    text = " ".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids: list[int] = runner.tokenizer(text, add_special_tokens=False).input_ids
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def chatd_decode(runner: ModelRunner, prompt: list[int], tokens: int, batch: int = 1) -> tuple[float, float]:
    """Aggregate greedy decode tok/s of ``batch`` sessions with ``prompt`` cached, and the prefill tok/s of
    the prompts (one session after another, each in chunks of 256)."""
    caches = []
    started = time.perf_counter()
    for _ in range(batch):
        cache = runner.new_cache()
        cache.reserve(len(prompt) + tokens + 1)
        for start in range(0, len(prompt), 256):
            logits = runner.prefill(cache, prompt[start:start + 256])
        caches.append(cache)
    prefill = batch * len(prompt) / (time.perf_counter() - started)
    nxt = [int(logits.argmax())] * batch
    started = time.perf_counter()
    for _ in range(tokens):
        nxt = runner.decode(caches, nxt).argmax(-1).tolist()
    elapsed = time.perf_counter() - started
    for cache in caches:
        cache.free(forget=True)  # the next case gets the whole pool
    return batch * tokens / elapsed, prefill


def llama_decode(server: LlamaServer, prompt: list[int], tokens: int, batch: int = 1) -> tuple[float, float]:
    """Aggregate decode tok/s of ``batch`` concurrent requests, and one request's prompt tok/s."""
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
            "ignore_eos": True, "stream": False}
    if batch == 1:
        timings = server.post("/completion", body)["timings"]
        return float(timings["predicted_per_second"]), float(timings["prompt_per_second"])
    with concurrent.futures.ThreadPoolExecutor(batch) as pool:
        results = list(pool.map(lambda _: server.post("/completion", body), range(batch)))
    # The requests decode together; their rates add up to the aggregate.
    return (sum(float(r["timings"]["predicted_per_second"]) for r in results),
            float(results[0]["timings"]["prompt_per_second"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", ""))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weights", default="float32")
    parser.add_argument("--contexts", default="256,1024,2048")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", default="", help="also measure N sessions at once, e.g. 8,16")
    parser.add_argument("--gguf", type=Path, help="another GGUF than the packaged one, for both (e.g. one that "
                        "python -m benchmarks.shapes wrote)")
    args = parser.parse_args(argv)
    gguf = args.gguf or packaged_gguf()
    if not args.llama_server or gguf is None:
        print("needs --llama-server (make peer builds it) and the packaged GGUF", file=sys.stderr)
        return 2
    source = str(gguf) if args.gguf else "packaged"
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    packaged_model_dir()  # converted once into CACHE_DIR/data, where ModelRunner.load finds it
    runners = {}
    for entry in args.weights.split(","):
        weights, _, kv = entry.partition("/")
        settings = ModelSettings(source=source, weights=weights, dtype=kv or "auto", threads=args.threads)
        runners[entry] = ModelRunner.load(settings, CACHE_DIR / "data")
        runners[entry].pool.wait_populated()  # timed steps do not share the cores with it
    any_runner = next(iter(runners.values()))
    batches = [int(b) for b in args.batch.split(",") if b and int(b) > 1]
    cases = [(c, 1) for c in contexts] + [(min(contexts), b) for b in batches]
    results: dict[tuple[str, int, int], list[float]] = {}
    prefills: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        slots = max([1, *batches])
        server = LlamaServer(args.llama_server, gguf, Path(scratch), context=slots * (max(contexts) + args.tokens + 16),
                             threads=args.threads, device="cpu", slots=slots)
        server.start()
        try:
            for round_ in range(args.rounds):
                for context, batch in cases:
                    prompt = prompt_ids(any_runner, context)
                    for name, runner in [*runners.items(), ("llama-server", None)]:
                        decode, prefill = (chatd_decode(runner, prompt, args.tokens, batch) if runner is not None
                                           else llama_decode(server, prompt, args.tokens, batch))
                        results.setdefault((name, context, batch), []).append(decode)
                        if batch == 1:
                            prefills.setdefault((name, context), []).append(prefill)
                print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        finally:
            server.stop()
    print(f"{gguf.name}: decode tok/s, median of {args.rounds} alternating rounds, {args.tokens} tokens, "
          f"{args.threads} threads, torch {torch.__version__}")
    for name, runner in runners.items():
        print(f"chatd {name}: {runner.info.weights_from}")
    names = [*runners, "llama-server"]
    print("| context | sessions | " + " | ".join(names) + " | " +
          " | ".join(f"{n} ÷ llama-server" for n in runners) + " |")
    print("|" + " --- |" * (2 + len(names) + len(runners)))
    for context, batch in cases:
        med = {n: statistics.median(results[(n, context, batch)]) for n in names}
        ratios = [f"{med[n] / med['llama-server']:.2f}" for n in runners]
        print(f"| {context} | {batch} | " + " | ".join(f"{med[n]:.1f}" for n in names) + " | "
              + " | ".join(ratios) + " |")
    print(f"\nprefill tok/s of the same prompts, median of {args.rounds} rounds (chatd in chunks of 256)")
    print("| context | " + " | ".join(names) + " | " + " | ".join(f"{n} ÷ llama-server" for n in runners) + " |")
    print("|" + " --- |" * (1 + len(names) + len(runners)))
    for context in contexts:
        med = {n: statistics.median(prefills[(n, context)]) for n in names}
        print(f"| {context} | " + " | ".join(f"{med[n]:.1f}" for n in names) + " | "
              + " | ".join(f"{med[n] / med['llama-server']:.2f}" for n in runners) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
