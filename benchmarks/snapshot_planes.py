"""Snapshot write and restore with the byte planes split and joined by numpy vs the native kernels.

    python -m benchmarks.snapshot_planes [--tokens 2048] [--rounds 3] [--samples 5]

The packaged model prefills ``--tokens`` tokens of the benchmark corpus; its cache is written to a
snapshot file, then restored the way figure 1 restores it (``benchmarks.snapshots.restore_file``: the KV
manager's three steps, on the default decode threads) into the engine's KV pool. Cold restores drop the
file's pages from the page cache first. The two settings take turns, ``--rounds`` rounds of ``--samples``
each, so a disturbance on a shared machine falls on both; medians are printed as a Markdown table, with
numpy's time divided by the native one's.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import Bench, Corpus, plan_for
from benchmarks.snapshots import drop_page_cache, prefill_chunked, prefix_layers, restore_file
from chatd.config import ModelSettings
from chatd.kv.persistence import fingerprint_of
from chatd.kv.snapshot import write_snapshot
from chatd.kv.snapshot_frames import PlaneKernels, default_threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=5)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        bench = Bench(plan=plan_for("quick", "cpu"), mode="quick", device="cpu", dtype="auto", threads=0,
                      out_dir=scratch, scratch=scratch, llama_server=None, log=print)
        runner = bench.runner()
        if runner.kernels is None:
            raise SystemExit("the native kernels are not built here (no C compiler?): nothing to compare")
        ids = Corpus(runner.tokenizer).token_ids(args.tokens)
        cache, _ = prefill_chunked(bench, runner, ids, [args.tokens], ModelSettings().prefill_chunk_tokens)
        fingerprint = fingerprint_of(runner.info)
        layers = prefix_layers(cache, args.tokens)
        path = scratch / "restore.kvsnap"
        with path.open("wb") as f:
            size = write_snapshot(f, fingerprint, ids, layers, kernels=runner.kernels)
            f.flush()
            os.fsync(f.fileno())
        settings: dict[str, PlaneKernels | None] = {"numpy": None, "native": runner.kernels}
        samples: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for name, kernels in settings.items():
                for _ in range(args.samples):
                    out = io.BytesIO()
                    started = time.perf_counter()
                    write_snapshot(out, fingerprint, ids, layers, kernels=kernels)
                    samples.setdefault((name, "write"), []).append((time.perf_counter() - started) * 1000)
                for kind in ("warm", "cold"):
                    for _ in range(args.samples):
                        if kind == "cold":
                            drop_page_cache(path)
                        restored, seconds = restore_file(bench, runner, fingerprint, path, ids, kernels)
                        restored.free()
                        samples.setdefault((name, f"restore {kind}"), []).append(seconds * 1000)
        cache.free()

    print(f"{args.tokens} tokens, {runner.info.dtype_name} KV, snapshot {size / 1e6:.1f} MB, "
          f"{default_threads()} decode threads; medians of {args.rounds * args.samples} samples, ms")
    print()
    print("| step | numpy | native | numpy / native |")
    print("| --- | --- | --- | --- |")
    for step in dict.fromkeys(step for _, step in samples):
        a, b = statistics.median(samples[("numpy", step)]), statistics.median(samples[("native", step)])
        print(f"| {step} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
