"""Figure 7: resident KV bytes vs the budget over a many-session workload with eviction.

``memory`` — 100 sessions take turns (a few at a time) under a small ``[cache] device_budget_mb``, so
chatd must evict idle caches to snapshots and restore them when their sessions come back. Resident
bytes (``core.kv.resident_bytes``) are sampled after every turn and by a 2 ms background sampler, and
set against the budget (``core.kv.budget_bytes``); evictions, restores and per-tier turn counts come
from the KV manager. Peak RSS is the workload process's own (it runs in a child process, so the rest
of the suite does not count).

Run as ``python -m benchmarks.memory --json-out FILE ...`` by :func:`run_memory`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, Bench, Column, Corpus, Figure, open_chatd, peak_rss_bytes, proc_status_bytes, ratio

MIB = 1024 * 1024


def run_memory(bench: Bench) -> Figure:
    plan = bench.plan
    fig = Figure(
        "memory", "Resident KV bytes vs the budget, 100 sessions with eviction",
        f"{plan.memory_sessions} sessions x {plan.memory_turns} turns ({plan.memory_parallel} sessions at a "
        f"time, later rounds in shuffled order) under a KV budget of {plan.memory_budget_tokens} tokens. "
        "Resident bytes are sampled after every turn (and every 2 ms) and divided by the budget. Peak RSS "
        "is the workload process's VmHWM; 'after load' is its RSS once the model is loaded.",
        columns=[
            Column("model", "model"), Column("turns", "turns"), Column("budget_mb", "budget MB", "{:.2f}"),
            Column("max_used_over_budget", "max used / budget (after turns)", "{:.3f}"),
            Column("max_used_over_budget_sampled", "max used / budget (2 ms samples)", "{:.3f}"),
            Column("mean_used_over_budget", "mean used / budget", "{:.3f}"),
            Column("evictions", "evictions"), Column("restores", "restores"),
            Column("turns_device", "turns from device"), Column("turns_disk", "turns from disk"),
            Column("turns_none", "turns recomputed"),
            Column("rss_after_load_mb", "RSS after load MB", "{:.0f}"), Column("peak_rss_mb", "peak RSS MB", "{:.0f}"),
        ])
    out = bench.scratch / "memory.json"
    data_dir = bench.subdir("memory")
    command = [
        sys.executable, "-m", "benchmarks.memory", "--json-out", str(out), "--data-dir", str(data_dir),
        "--model", plan.memory_model, "--device", bench.device, "--dtype", bench.dtype,
        "--threads", str(bench.threads), "--sessions", str(plan.memory_sessions), "--turns", str(plan.memory_turns),
        "--budget-tokens", str(plan.memory_budget_tokens), "--parallel", str(plan.memory_parallel),
    ]
    bench.log(f"  child: {plan.memory_sessions} sessions, {plan.memory_model} model")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"memory workload failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    row = {k: v for k, v in result.items() if not isinstance(v, (list, dict))}
    fig.rows.append(row)
    fig.summary = {"model_dir": result["model_dir"], "kv_bytes_per_token": result["kv_bytes_per_token"]}
    if plan.memory_model == "tiny":
        fig.notes.append("model: the tiny random-init 2-layer llama with the real tokenizer "
                         "(devtools.models.tiny_model_dir()), so 100 sessions fit the time budget; the "
                         "eviction and restore logic is the same as with the real model.")
    else:
        fig.notes.append("model: the packaged SmolLM2-135M-Instruct.")
    fig.add_headline("max resident KV / budget over 100 sessions", row["max_used_over_budget_sampled"], "{:.3f}")
    fig.add_headline("evictions in the memory workload", row["evictions"], "{:.0f}")
    fig.add_headline("restores from snapshots in the memory workload", row["restores"], "{:.0f}")
    fig.add_headline("peak RSS of the memory workload process", row["peak_rss_mb"], "{:.0f} MB")
    return fig


# ----------------------------------------------------------------------------- child process


async def _workload(args: argparse.Namespace) -> dict[str, Any]:
    from chatd import config
    from chatd.config import ModelSettings
    from chatd.engine.model.runner import ModelRunner
    from chatd.service.types import GenerationOptions, TurnResult
    from devtools.models import packaged_model_dir, tiny_model_dir

    folder = tiny_model_dir() if args.model == "tiny" else packaged_model_dir()
    runner = ModelRunner.load(ModelSettings(source=str(folder), device=args.device, dtype=args.dtype,
                                            threads=args.threads), folder)
    rss_after_load = proc_status_bytes("VmRSS")
    bytes_per_token = runner.info.bytes_per_token
    budget_mb = args.budget_tokens * bytes_per_token / MIB
    settings = config.load(env={}, overrides={
        "data_dir": args.data_dir,
        "model": {"source": str(folder), "device": args.device, "dtype": args.dtype, "threads": args.threads},
        "cache": {"device_budget_mb": budget_mb, "persist_idle_s": 0, "idle_evict_s": 0, "disk_budget_mb": 65536},
        "log_level": "warning",
    })
    params = GenerationOptions(max_tokens=args.reply_tokens, temperature=0.0)
    corpus = Corpus(runner.tokenizer)
    after_turns: list[float] = []
    sampled_max = 0.0
    tiers: Counter[str] = Counter()
    started = time.perf_counter()
    async with open_chatd(settings, runner) as core:
        kv = core.kv
        stop = asyncio.Event()

        async def sampler() -> None:
            nonlocal sampled_max
            while not stop.is_set():
                sampled_max = max(sampled_max, kv.resident_bytes / kv.budget_bytes)
                await asyncio.sleep(0.002)

        sampling = asyncio.ensure_future(sampler())
        sessions = [(await core.sessions.create()).session_id for _ in range(args.sessions)]
        for turn in range(args.turns):
            order = list(sessions)
            if turn:
                random.Random(turn).shuffle(order)
            for start in range(0, len(order), args.parallel):
                group = order[start : start + args.parallel]
                texts = [f"Turn {turn + 1}. Read this and reply:\n\n" + corpus.text(args.message_tokens) for _ in group]

                async def one(session_id: str, text: str) -> None:
                    result = await core.sessions.send(session_id, text, params).wait()
                    assert isinstance(result, TurnResult)
                    tiers[result.usage.cache_tier] += 1
                    after_turns.append(kv.resident_bytes / kv.budget_bytes)

                await asyncio.gather(*(one(s, t) for s, t in zip(group, texts, strict=True)))
        stop.set()
        await sampling
        counters = core.counters
        result: dict[str, Any] = {
            "model": runner.info.name if args.model == "real" else "tiny (random init)",
            "model_dir": str(folder), "sessions": args.sessions, "turns": sum(tiers.values()),
            "kv_bytes_per_token": bytes_per_token, "budget_bytes": kv.budget_bytes, "budget_mb": kv.budget_bytes / 1e6,
            "max_used_over_budget": max(after_turns),
            "max_used_over_budget_sampled": max(sampled_max, max(after_turns)),
            "mean_used_over_budget": sum(after_turns) / len(after_turns),
            "evictions": counters.num_evictions, "evictions_for_room": counters.num_evictions_for_room,
            "restores": counters.num_restores, "restore_failures": counters.num_restore_failures,
            "snapshot_writes": counters.num_snapshot_writes,
            "snapshot_write_failures": counters.num_snapshot_write_failures,
            "turns_device": tiers["device"], "turns_disk": tiers["disk"], "turns_none": tiers["none"],
            "disk_bytes": core.snapshots.disk_bytes,
            "within_budget": max(sampled_max, max(after_turns)) <= 1.0,
        }
    result["elapsed_s"] = time.perf_counter() - started
    result["rss_after_load_mb"] = rss_after_load / 1e6
    result["peak_rss_mb"] = peak_rss_bytes() / 1e6
    result["turns_per_s"] = ratio(result["turns"], result["elapsed_s"])
    if args.device == "cuda":
        import torch

        result["peak_device_allocated_mb"] = torch.cuda.max_memory_allocated() / 1e6
    return result


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory")
    parser.add_argument("--json-out", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--model", choices=["tiny", "real"], default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--budget-tokens", type=int, default=1600)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--message-tokens", type=int, default=100)
    parser.add_argument("--reply-tokens", type=int, default=16)
    args = parser.parse_args()
    result = asyncio.run(_workload(args))
    Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
