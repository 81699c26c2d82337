"""The suite's entry point: parse arguments, run every figure in order, write results.json and
results.md, print the Markdown.

Order matters on a small machine: the in-process figures (1-4) run first on the shared model; the
server figures (5, 6) run while the in-process model idles; the memory workload (7) and the peer run
in child processes of their own. A figure that fails is recorded as failed (with its traceback) and
the suite goes on; the exit status is 1 when any figure failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.common import (
    FIGURE_KEYS,
    ROOT,
    SCHEMA_VERSION,
    Bench,
    Corpus,
    Figure,
    machine_info,
    model_info,
    peak_rss_bytes,
    plan_for,
    software_info,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="CI-sized run (the default): a few minutes on 2 CPU cores")
    size.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="longer caches and histories, more repetitions, the real model for memory")
    parser.set_defaults(mode="quick")
    parser.add_argument("--out", type=Path, help="output folder (default: benchmarks/results/<UTC time>)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16", "int8"], default="auto",
                        help="model and KV dtype (auto: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "0")),
                        help="torch intra-op threads for every model in the run; 0 keeps torch's default")
    parser.add_argument("--figures", default="",
                        help=f"comma-separated subset of: {', '.join(FIGURE_KEYS)}, peer (default: all)")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", ""),
                        help="llama-server binary for the peer section (default: $LLAMA_SERVER)")
    parser.add_argument("--note", default="", help="a line written at the top of the report")
    parser.add_argument("--keep-scratch", action="store_true", help="keep snapshot files, databases and logs")
    return parser.parse_args(argv)


def _environment_problem() -> str:
    """The `chatd serve` children inherit this environment, and chatd reads every CHATD_* variable as
    a setting (unknown ones are a configuration error): name those up front instead of failing later."""
    from chatd import config
    from chatd.errors import ConfigError

    rejected = []
    for name in sorted(k for k in os.environ if k.startswith(config.ENV_PREFIX) and k != "CHATD_CONFIG"):
        try:
            config.load(os.devnull, env={name: os.environ[name]})
        except ConfigError:
            rejected.append(name)
    if rejected:
        return (f"the environment sets {', '.join(rejected)}, which chatd serve rejects as unknown settings; "
                "unset them for the benchmark run")
    return ""


def _run(bench: Bench, key: str, work: Callable[[], Figure]) -> Figure:
    bench.log(f"[{key}]")
    started = time.perf_counter()
    try:
        fig = work()
    except Exception:
        fig = Figure(key, key.replace("_", " "), "", status="failed", error=traceback.format_exc())
        bench.log(f"[{key}] FAILED\n{fig.error}")
    fig.elapsed_s = time.perf_counter() - started
    bench.results[key] = fig
    bench.log(f"[{key}] {fig.status} in {fig.elapsed_s:.1f} s")
    bench.on_figure()
    return fig


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started_wall = time.perf_counter()
    started_at = datetime.now(UTC)
    out_dir: Path = args.out or ROOT / "benchmarks" / "results" / started_at.strftime("%Y%m%dT%H%M%SZ")
    out_dir = out_dir.resolve()
    scratch = out_dir / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    wanted = [k.strip() for k in args.figures.split(",") if k.strip()] or [*FIGURE_KEYS, "peer"]
    unknown = set(wanted) - {*FIGURE_KEYS, "peer"}
    if unknown:
        print(f"unknown figures: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    problem = _environment_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("--device cuda: torch sees no CUDA device", file=sys.stderr)
            return 2

    def log(message: str) -> None:
        print(f"{time.perf_counter() - started_wall:7.1f}s {message}", file=sys.stderr, flush=True)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    plan = plan_for(args.mode, args.device)
    bench = Bench(plan=plan, mode=args.mode, device=args.device, dtype=args.dtype, threads=args.threads,
                  out_dir=out_dir, scratch=scratch, llama_server=args.llama_server or None, log=log)
    log(f"mode {args.mode}, plan {plan.name}, device {args.device}, threads {args.threads or 'default'}")
    machine = machine_info(args.device)
    runner = bench.runner()
    info = runner.info
    log(f"model {info.name} loaded in {info.load_s:.1f} s ({info.dtype_name}, {info.device})")
    corpus = Corpus(runner.tokenizer)
    figures = bench.results
    software = software_info()
    peer_section: dict[str, Any] = {"status": "skipped", "reason": "not run yet"}

    from benchmarks.peer import peer_markdown, run_peer
    from benchmarks.report import render_markdown, write_report

    def build(complete: bool) -> tuple[dict[str, Any], str]:
        report: dict[str, Any] = {
            "schema": SCHEMA_VERSION,
            "complete": complete,
            "mode": args.mode,
            "plan": plan.__dict__,
            "started_at": started_at.isoformat(timespec="seconds"),
            "duration_s": time.perf_counter() - started_wall,
            "note": args.note,
            "machine": machine,
            "software": software,
            "model": model_info(runner),
            "settings": {
                "threads": args.threads, "torch_threads": torch.get_num_threads(),
                "torch_interop_threads": torch.get_num_interop_threads(), "device": args.device,
                "dtype": args.dtype,
            },
            "process_peak_rss_bytes": peak_rss_bytes(),
            "figures": {key: fig.to_json() for key, fig in figures.items()},
            "peer": peer_section,
            "failed": [key for key, fig in figures.items() if fig.status != "ok"],
        }
        return report, render_markdown(report, figures, peer_markdown(peer_section))

    def checkpoint() -> None:
        # Written after every figure, so a run stopped by a time limit still leaves its results.
        write_report(out_dir, *build(complete=False))

    bench.on_figure = checkpoint
    try:
        _run_figures(bench, wanted, corpus)
        if "peer" in wanted:
            log("[peer]")
            peer_section = run_peer(bench, corpus, figures)
            log(f"[peer] {peer_section['status']}{': ' + peer_section['reason'] if 'reason' in peer_section else ''}")
        else:
            peer_section = {"status": "skipped", "reason": "not selected (--figures)"}
    except KeyboardInterrupt:
        log("interrupted: writing the results so far")
        peer_section = {"status": "skipped", "reason": "the run was interrupted"}
        write_report(out_dir, *build(complete=False))
        return 130
    report, markdown = build(complete=True)
    json_path, md_path = write_report(out_dir, report, markdown)
    if not args.keep_scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    print(markdown)
    log(f"wrote {json_path} and {md_path}")
    return 1 if report["failed"] else 0


def _run_figures(bench: Bench, wanted: list[str], corpus: Corpus) -> None:
    from benchmarks import conversation, memory, openai_api, serving, snapshots

    figures = bench.results
    if "restore_vs_prefill" in wanted or "snapshot_codecs" in wanted:
        box: dict[str, Any] = {}

        def restore() -> Figure:
            fig, box["cache"], box["ids"] = snapshots.run_restore_vs_prefill(bench, corpus)
            return fig

        fig1 = _run(bench, "restore_vs_prefill", restore)
        if "restore_vs_prefill" not in wanted:
            del figures["restore_vs_prefill"]
        if "snapshot_codecs" in wanted:
            if fig1.status == "ok":
                _run(bench, "snapshot_codecs", lambda: snapshots.run_snapshot_codecs(bench, box["cache"], box["ids"]))
            else:
                figures["snapshot_codecs"] = Figure("snapshot_codecs", "snapshot codecs", "", status="failed",
                                                    error="needs the cache of restore_vs_prefill, which failed")
        if "cache" in box:
            box["cache"].free()
        box.clear()
    if "ttft_vs_history" in wanted:
        _run(bench, "ttft_vs_history", lambda: conversation.run_ttft_vs_history(bench, corpus))
    if "edit_cost" in wanted:
        _run(bench, "edit_cost", lambda: conversation.run_edit_cost(bench, corpus))
    if "decode_overhead" in wanted or "concurrency" in wanted:
        pair: dict[str, Figure] = {}

        def serve() -> Figure:
            pair["decode"], pair["concurrency"] = serving.run_serving(bench)
            return pair["decode"]

        _run(bench, "decode_overhead", serve)
        if "concurrency" in pair:
            figures["concurrency"] = pair["concurrency"]  # its elapsed_s is its own part of the server run
            figures["decode_overhead"].notes.append(
                "the time below includes starting the server and the concurrency figure, which share it.")
        elif "concurrency" in wanted:
            figures["concurrency"] = Figure("concurrency", "concurrency", "", status="failed",
                                            error=figures["decode_overhead"].error)
        for key in ("decode_overhead", "concurrency"):
            if key not in wanted:
                figures.pop(key, None)
    if "memory" in wanted:
        _run(bench, "memory", lambda: memory.run_memory(bench))
    if "shared_prefix" in wanted:
        _run(bench, "shared_prefix", lambda: conversation.run_shared_prefix(bench, corpus))
    if "openai_resend" in wanted:
        _run(bench, "openai_resend", lambda: openai_api.run_openai_resend(bench, corpus))
