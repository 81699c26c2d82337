"""Figures 1 and 2: what a KV snapshot saves, and what it costs.

1. ``restore_vs_prefill`` — time to prefill N tokens from scratch vs time to restore the same cache
   from its snapshot file (read + decode into preallocated tensors), at several N; every restore is
   checked bit-exact against the cache it was written from.
2. ``snapshot_codecs`` — snapshot size ratio and compress / decompress throughput for each codec
   setting (zstd level, lossless vs bfloat16 storage), on a real KV cache of the model prefilled with
   real text; plain zstd on the unshuffled bytes is measured beside it so the byte-plane shuffle's
   gain is visible.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from benchmarks.common import MB, Bench, Column, Corpus, Figure, median, ratio, tensors_equal, timed
from chatd.engine.model.runner import ModelRunner
from chatd.engine.pool.kvcache import SessionKV
from chatd.kv.persistence import fingerprint_of, finish_restore, read_snapshot_file, restore_targets
from chatd.kv.snapshot import FORMAT_VERSION, ModelFingerprint, allocate_targets, read_snapshot, write_snapshot
from chatd.kv.snapshot_frames import PlaneKernels, default_threads

Layers = list[tuple[torch.Tensor, torch.Tensor]]


def prefix_layers(cache: SessionKV, n: int) -> Layers:
    """Per-layer ``[kv_heads, n, head_dim]`` views of the first n positions, on the CPU (snapshot input)."""
    layers = [(k[:, :n], v[:, :n]) for k, v in cache.filled_layers()]
    if cache.device.type == "cpu":
        return layers
    return [(k.to("cpu"), v.to("cpu")) for k, v in layers]


def drop_page_cache(path: Path) -> bool:
    """Ask the kernel to forget this one file's cached pages (only ours, no global cache drop), so the
    next read comes from the disk. False where the platform cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def restore_file(bench: Bench, runner: ModelRunner, fingerprint: ModelFingerprint, path: Path,
                 ids: Sequence[int], kernels: PlaneKernels | None) -> tuple[SessionKV, float]:
    """Restore a snapshot file through the KV manager's own three steps (chatd.kv.persistence:
    targets, decode, finish), into a cache preallocated before the clock starts, like the manager's;
    the byte planes joined by ``kernels`` (the server passes ``runner.kernels``). Returns (cache, seconds)."""
    cache = runner.new_cache()
    cache.reserve(len(ids))
    with timed(bench) as t:
        targets = restore_targets(cache, ids, fingerprint)
        read_snapshot_file(path, fingerprint, ids, targets, kernels)
        finish_restore(cache, targets)
    return cache, t[0]


def run_restore_vs_prefill(bench: Bench, corpus: Corpus) -> tuple[Figure, SessionKV, list[int]]:
    """Figure 1. Returns the figure and the longest prefilled cache (reused by figure 2)."""
    fig = Figure(
        "restore_vs_prefill", "Restore from snapshot vs re-prefill",
        "Time to prefill N tokens from scratch (chunked like the engine) vs time to restore the same cache "
        "from its snapshot file: open, read, verify, decode into preallocated tensors. Cold = the file's "
        "pages dropped from the page cache first (read from disk); warm = read again from memory.",
        columns=[
            Column("tokens", "tokens"), Column("prefill_s", "prefill s", "{:.2f}"),
            Column("restore_cold_s", "restore cold s", "{:.3f}"), Column("restore_warm_s", "restore warm s", "{:.3f}"),
            Column("speedup_cold", "prefill / restore (cold)", "{:.1f}x"),
            Column("speedup_warm", "prefill / restore (warm)", "{:.1f}x"),
            Column("snapshot_mb", "snapshot MB", "{:.1f}"), Column("write_s", "write s", "{:.2f}"),
            Column("bit_exact", "bit-exact"),
        ])
    runner = bench.runner()
    from chatd.config import ModelSettings

    chunk = ModelSettings().prefill_chunk_tokens
    longest = max((*bench.plan.restore_tokens, bench.plan.codec_tokens))
    ids = corpus.token_ids(longest)
    cache, prefill_s = prefill_chunked(bench, runner, ids, bench.plan.restore_tokens, chunk)
    fingerprint = fingerprint_of(runner.info)
    folder = bench.subdir("restore")
    cold_ok = True
    for n in bench.plan.restore_tokens:
        path = folder / f"restore-{n}.kvsnap"
        layers = prefix_layers(cache, n)
        with timed(bench) as w, path.open("wb") as f:
            file_bytes = write_snapshot(f, fingerprint, ids[:n], layers, kernels=runner.kernels)
            f.flush()
            os.fsync(f.fileno())
        cold: list[float] = []
        warm: list[float] = []
        exact = True
        for _ in range(bench.plan.repeats):
            cold_ok = drop_page_cache(path) and cold_ok
            restored, seconds = restore_file(bench, runner, fingerprint, path, ids[:n], runner.kernels)
            cold.append(seconds)
            exact = exact and tensors_equal(restored.filled_layers(), [(k[:, :n], v[:, :n])
                                                                       for k, v in cache.filled_layers()])
            restored.free()
        for _ in range(bench.plan.repeats):
            restored, seconds = restore_file(bench, runner, fingerprint, path, ids[:n], runner.kernels)
            warm.append(seconds)
            restored.free()
        fig.rows.append({
            "tokens": n, "prefill_s": prefill_s[n], "restore_cold_s": median(cold), "restore_warm_s": median(warm),
            "speedup_cold": ratio(prefill_s[n], median(cold)), "speedup_warm": ratio(prefill_s[n], median(warm)),
            "snapshot_mb": file_bytes / MB, "snapshot_bytes": file_bytes, "raw_bytes": n * runner.info.bytes_per_token,
            "snapshot_bytes_per_token": file_bytes / n,
            "write_s": w[0], "bit_exact": exact, "restore_cold_runs_s": cold, "restore_warm_runs_s": warm,
        })
        path.unlink()
    fig.summary = {"prefill_chunk_tokens": chunk, "repeats": bench.plan.repeats, "cold_reads": cold_ok,
                   "all_bit_exact": all(r["bit_exact"] for r in fig.rows), "snapshot_format": FORMAT_VERSION,
                   "restore_decode_threads": default_threads()}
    if not cold_ok:
        fig.notes.append("posix_fadvise is unavailable: 'cold' restores may have read from the page cache.")
    for row in fig.rows:
        fig.add_headline(f"restore vs re-prefill at {row['tokens']} tokens (cold file)", row["speedup_cold"],
                         "{:.1f}x faster")
    return fig, cache, ids


def prefill_chunked(bench: Bench, runner: ModelRunner, ids: Sequence[int], checkpoints: Sequence[int],
                    chunk: int) -> tuple[SessionKV, dict[int, float]]:
    """Prefill ``ids`` in chunks of ``chunk`` tokens, as the engine worker does; return the cache and the
    elapsed seconds at each checkpoint length.

    The time at N is exactly the cost of prefilling N tokens from scratch: the first N positions are
    computed the same way whether or not more follow (causal attention, the same chunk boundaries)."""
    cache = runner.new_cache()
    cache.reserve(len(ids))
    wanted = sorted(n for n in set(checkpoints) if n <= len(ids))
    elapsed: dict[int, float] = {}
    # One warm-up forward pass, so the first checkpoint does not pay for lazy initialisation.
    warm = runner.new_cache()
    runner.prefill(warm, ids[:32])
    warm.free()
    bench.sync()
    started = time.perf_counter()
    start = 0
    while start < len(ids):
        end = min([start + chunk, len(ids), *(n for n in wanted if n > start)])
        runner.prefill(cache, ids[start:end])
        start = end
        if start in wanted:
            bench.sync()
            elapsed[start] = time.perf_counter() - started
    return cache, elapsed


# ----------------------------------------------------------------------------- figure 2


def _plain_frames(layers: Layers, dtype: torch.dtype) -> list[np.ndarray]:
    """Each head slab's raw bytes (no shuffle), in the snapshot body's order, cast to ``dtype``."""
    frames = []
    for keys, values in layers:
        for tensor in (keys, values):
            for head in range(tensor.shape[0]):
                slab = tensor[head].to(dtype).contiguous()  # [seq, head_dim]
                frames.append(slab.view(torch.uint8).numpy().reshape(-1))
    return frames


def _plain_zstd(frames: list[np.ndarray], level: int, repeats: int) -> dict[str, Any]:
    """Plain zstd on the unshuffled bytes, one frame per head slab (the codec's framing, so only the
    shuffle differs)."""
    compressor = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    decompressor = zstandard.ZstdDecompressor()
    compress_s, decompress_s = [], []
    compressed: list[bytes] = []
    for _ in range(repeats):
        with timed() as t:
            compressed = [compressor.compress(frame.data) for frame in frames]
        compress_s.append(t[0])
    dest = [np.empty_like(frame) for frame in frames]
    for _ in range(repeats):
        with timed() as t:
            for blob, out in zip(compressed, dest, strict=True):
                out[:] = np.frombuffer(decompressor.decompress(blob), dtype=np.uint8)
        decompress_s.append(t[0])
    exact = all(np.array_equal(a, b) for a, b in zip(frames, dest, strict=True))
    return {"stored_bytes": sum(len(b) for b in compressed), "compress_s": median(compress_s),
            "decompress_s": median(decompress_s), "roundtrip_exact": exact}


def _codec(layers: Layers, fingerprint: ModelFingerprint, ids: Sequence[int], level: int, stored: str | None,
           repeats: int, kernels: PlaneKernels | None) -> dict[str, Any]:
    """chatd's snapshot codec (byte-plane shuffle + zstd) to and from memory, so no disk time is counted."""
    compress_s, decompress_s = [], []
    blob = b""
    for _ in range(repeats):
        buffer = io.BytesIO()
        with timed() as t:
            write_snapshot(buffer, fingerprint, ids, layers, level=level, stored_dtype=stored, kernels=kernels)
        compress_s.append(t[0])
        blob = buffer.getvalue()
    targets = allocate_targets(fingerprint, len(ids))
    for _ in range(repeats):
        with timed() as t:
            read_snapshot(io.BytesIO(blob), expected=fingerprint, expected_ids=ids, targets=targets, kernels=kernels)
        decompress_s.append(t[0])
    max_rel = 0.0
    max_abs = 0.0
    for (k, v), (rk, rv) in zip(layers, targets, strict=True):
        for orig, back in ((k, rk), (v, rv)):
            diff = (orig.float() - back.float()).abs()
            max_abs = max(max_abs, float(diff.max()))
            nonzero = orig != 0
            if bool(nonzero.any()):
                max_rel = max(max_rel, float((diff[nonzero] / orig.float().abs()[nonzero]).max()))
    return {"stored_bytes": len(blob), "compress_s": median(compress_s), "decompress_s": median(decompress_s),
            "roundtrip_exact": tensors_equal(layers, targets), "max_rel_error": max_rel, "max_abs_error": max_abs}


def run_snapshot_codecs(bench: Bench, cache: SessionKV, ids: Sequence[int]) -> Figure:
    """Figure 2, on the first ``plan.codec_tokens`` positions of the real cache from figure 1."""
    runner = bench.runner()
    n = min(bench.plan.codec_tokens, cache.length)
    fig = Figure(
        "snapshot_codecs", "Snapshot codec settings on a real KV cache",
        f"Size ratio (raw {runner.info.dtype_name} KV bytes / stored bytes) and compress / decompress "
        f"throughput (raw MB per second, in memory, one thread) of a real {n}-token KV cache of the model "
        "prefilled with real text. 'chatd' is the snapshot codec (byte-plane shuffle, then zstd); 'plain "
        "zstd' compresses the same head slabs unshuffled. bfloat16 storage of a float32 cache is lossy: its "
        "max relative and absolute errors are measured against the live cache.",
        columns=[
            Column("codec", "codec"), Column("stored_dtype", "stored as"), Column("level", "zstd level"),
            Column("size_ratio", "size ratio", "{:.3f}x"), Column("stored_mb", "stored MB", "{:.1f}"),
            Column("compress_mbps", "compress MB/s", "{:.0f}"), Column("decompress_mbps", "decompress MB/s", "{:.0f}"),
            Column("max_rel_error", "max rel. error", "{:.2e}"), Column("lossless", "bit-exact"),
        ])
    fingerprint = fingerprint_of(runner.info)
    layers = prefix_layers(cache, n)
    live = runner.info.dtype_name
    raw_bytes = n * runner.info.bytes_per_token
    repeats = max(1, bench.plan.repeats // 2)
    stored_options: list[str | None] = [None]
    if live == "float32":
        stored_options.append("bfloat16")
    else:
        fig.notes.append(f"the live cache is {live}: lossy bfloat16 storage applies only to float32 caches.")
    for stored in stored_options:
        stored_name = stored or live
        for level in bench.plan.zstd_levels:
            bench.log(f"  codec chatd {stored_name} level {level}")
            result = _codec(layers, fingerprint, ids[:n], level, stored, repeats, runner.kernels)
            fig.rows.append(_codec_row("chatd", stored_name, level, raw_bytes, result))
        frames = _plain_frames(layers, torch.bfloat16 if stored == "bfloat16" else layers[0][0].dtype)
        for level in bench.plan.zstd_levels:
            bench.log(f"  codec plain {stored_name} level {level}")
            result = _plain_zstd(frames, level, repeats)
            if stored == "bfloat16":
                # Plain zstd of the rounded values has the same rounding error as the codec's bf16 mode.
                chatd_row = next(r for r in fig.rows if r["codec"] == "chatd" and r["stored_dtype"] == "bfloat16")
                result["max_rel_error"] = chatd_row["max_rel_error"]
                result["max_abs_error"] = chatd_row["max_abs_error"]
                result["roundtrip_exact"] = False
            else:
                result["max_rel_error"] = 0.0
                result["max_abs_error"] = 0.0
            fig.rows.append(_codec_row("plain zstd", stored_name, level, raw_bytes, result))
    fig.summary = {"tokens": n, "raw_bytes": raw_bytes, "repeats": repeats}
    by = {(r["codec"], r["stored_dtype"], r["level"]): r for r in fig.rows}
    first = bench.plan.zstd_levels[0]
    for stored in stored_options:
        name = stored or live
        gain = ratio(by[("chatd", name, first)]["size_ratio"], by[("plain zstd", name, first)]["size_ratio"])
        fig.summary[f"shuffle_gain_{name}_level{first}"] = gain
        fig.add_headline(f"snapshot size ratio, {name}, zstd {first} (shuffled)",
                         by[("chatd", name, first)]["size_ratio"], "{:.3f}x")
        fig.add_headline(f"byte-plane shuffle gain over plain zstd, {name}", gain, "{:.3f}x")
    if "bfloat16" in stored_options:
        fig.add_headline("bfloat16 storage max relative error", by[("chatd", "bfloat16", first)]["max_rel_error"],
                         "{:.2e}")
    return fig


def _codec_row(codec: str, stored: str, level: int, raw_bytes: int, result: dict[str, Any]) -> dict[str, Any]:
    return {
        "codec": codec, "stored_dtype": stored, "level": level, "raw_bytes": raw_bytes,
        "stored_bytes": result["stored_bytes"], "stored_mb": result["stored_bytes"] / MB,
        "size_ratio": ratio(raw_bytes, result["stored_bytes"]),
        "compress_s": result["compress_s"], "decompress_s": result["decompress_s"],
        "compress_mbps": ratio(raw_bytes / MB, result["compress_s"]),
        "decompress_mbps": ratio(raw_bytes / MB, result["decompress_s"]),
        "max_rel_error": result["max_rel_error"], "max_abs_error": result["max_abs_error"],
        "lossless": result["roundtrip_exact"],
    }
