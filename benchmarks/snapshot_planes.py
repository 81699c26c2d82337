"""Snapshot write and restore with the byte planes split and joined by numpy vs the native kernels.

    python -m benchmarks.snapshot_planes [--tokens 2048] [--rounds 3] [--samples 5]

The packaged model prefills ``--tokens`` tokens of the benchmark corpus; its cache is written to a
snapshot file, then restored through the production path (chatd.kv.persistence: targets, decode,
finish) into the engine's KV pool, on one decode thread and on the default number. Cold restores drop
the file's pages from the page cache first. The two settings take turns, ``--rounds`` rounds of
``--samples`` each, so a disturbance on a shared machine falls on both; medians are printed as a
Markdown table, with numpy's time divided by the native one's.
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
from benchmarks.snapshots import drop_page_cache, prefill_chunked, prefix_layers
from chatd.config import ModelSettings
from chatd.engine.runner import ModelRunner
from chatd.engine.threads import confine_to_one_thread
from chatd.kv.persistence import fingerprint_of, finish_restore, restore_targets
from chatd.kv.snapshot import ModelFingerprint, read_snapshot, write_snapshot
from chatd.kv.snapshot_frames import PlaneKernels, default_threads


def restore_ms(runner: ModelRunner, fingerprint: ModelFingerprint, path: Path, ids: list[int], threads: int,
               kernels: PlaneKernels | None) -> float:
    cache = runner.new_cache()
    cache.reserve(len(ids))
    started = time.perf_counter()
    targets = restore_targets(cache, ids, fingerprint)
    with path.open("rb") as f:
        read_snapshot(f, expected=fingerprint, expected_ids=ids, targets=targets, threads=threads,
                      thread_setup=confine_to_one_thread, kernels=kernels)
    finish_restore(cache, targets)
    elapsed = (time.perf_counter() - started) * 1000
    cache.free()
    return elapsed


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
        thread_counts = sorted({1, default_threads()})
        samples: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for name, kernels in settings.items():
                for _ in range(args.samples):
                    out = io.BytesIO()
                    started = time.perf_counter()
                    write_snapshot(out, fingerprint, ids, layers, kernels=kernels)
                    samples.setdefault((name, "write"), []).append((time.perf_counter() - started) * 1000)
                for threads in thread_counts:
                    for _ in range(args.samples):
                        warm = restore_ms(runner, fingerprint, path, ids, threads, kernels)
                        samples.setdefault((name, f"restore warm, {threads} thread(s)"), []).append(warm)
                    for _ in range(args.samples):
                        drop_page_cache(path)
                        cold = restore_ms(runner, fingerprint, path, ids, threads, kernels)
                        samples.setdefault((name, f"restore cold, {threads} thread(s)"), []).append(cold)
        cache.free()

    print(f"{args.tokens} tokens, {runner.info.dtype_name} KV, snapshot {size / 1e6:.1f} MB; medians of "
          f"{args.rounds * args.samples} samples, ms")
    print()
    print("| step | numpy | native | numpy / native |")
    print("| --- | --- | --- | --- |")
    for step in dict.fromkeys(step for _, step in samples):
        a, b = statistics.median(samples[("numpy", step)]), statistics.median(samples[("native", step)])
        print(f"| {step} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
