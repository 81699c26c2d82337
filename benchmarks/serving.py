"""Figures 5 and 6: a real ``chatd serve`` process driven over its websocket by the client library.

5. ``decode_overhead`` — greedy decode tokens/s of one reply streamed through the websocket vs the
   same prompt decoded by calling the model directly (ModelRunner prefill + decode loop, no server):
   the server's overhead as a ratio.
6. ``concurrency`` — aggregate tokens/s and p50 / p99 time to first token with 1 / 4 / 8 / ... clients
   at once, each on its own connection and session; the engine batches their decode steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
import torch

from benchmarks.common import ROOT, Bench, Column, Figure, median, percentile, proc_status_bytes, ratio
from chatd.chat.template import ChatTemplate
from chatd.client.client import ChatClient
from devtools.servers import ServerProcess

if TYPE_CHECKING:
    from chatd.engine.model.runner import ModelRunner

DECODE_PROMPT = ("Write a long, detailed story about a lighthouse keeper who finds a message in a bottle. "
                 "Describe the island, the weather and the keeper's daily routine.")
CONCURRENT_PROMPTS = (
    "Explain how a bicycle stays upright.", "Write a short poem about the sea.",
    "List some uses of a paper clip.", "Describe a walk through a forest in autumn.",
    "What makes bread rise?", "Give advice for a first day at a new job.",
    "Explain what a compiler does.", "Describe the taste of a lemon to someone who never had one.",
)


def fresh_prompt(request: int) -> str:
    """Request ``request``'s message: one of CONCURRENT_PROMPTS behind a number no other request of the run has,
    so only the chat template's opening (shared by every conversation) is ever found in the cache, and every
    client of every level prefills its own message."""
    return f"Request {request}. {CONCURRENT_PROMPTS[request % len(CONCURRENT_PROMPTS)]}"


def start_server(bench: Bench) -> ServerProcess:
    # Large budget and no background maintenance: eviction is figure 7's subject, not this one's.
    server = ServerProcess(bench.subdir("server"), bench.model_dir(), model=bench.model_settings(),
                           cache={"device_budget_mb": 4096})
    server.start(timeout=300)
    try:
        server.wait_pool_populated()
    except BaseException:
        server.stop()
        raise
    return server


async def _stream(client: ChatClient, session_id: str, content: str, max_tokens: int) -> dict[str, Any]:
    """Send one message, stream the reply; client-side timings plus the server's usage."""
    sent = time.perf_counter()
    reply = await client.send(session_id, content, max_tokens=max_tokens, temperature=0.0)
    first: float | None = None
    async for _ in reply:
        if first is None:
            first = time.perf_counter()
    done = time.perf_counter()
    assert reply.done is not None
    usage = reply.done.usage
    first = first if first is not None else done
    return {
        "ttft_s": first - sent, "total_s": done - sent, "output_tokens": usage.output_tokens, "text": reply.text,
        "first_at": first, "done_at": done,
        "client_decode_tps": ratio(usage.output_tokens - 1, done - first) if usage.output_tokens > 1 else 0.0,
        "server_decode_tps": usage.decode_tokens_per_s, "server_ttft_ms": usage.ttft_ms,
    }


async def _ws_decode(bench: Bench, server: ServerProcess) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Websocket runs alternating with direct runs (the server idles meanwhile), so both paths see
    the same machine: on a shared machine the load drifts within a minute."""
    ws_runs: list[dict[str, Any]] = []
    direct_runs: list[dict[str, Any]] = []
    direct = DirectDecoder(bench)
    try:
        async with await ChatClient.connect(server.ws_url, request_timeout=300) as client:
            warm = await client.create_session()
            await _stream(client, warm.session_id, "Hello!", 4)  # first forward passes are slower
            for _ in range(bench.plan.decode_runs):
                session = await client.create_session()
                ws_runs.append(await _stream(client, session.session_id, DECODE_PROMPT, bench.plan.decode_tokens))
                # Waited for on a thread: the client's event loop keeps answering the server's keepalive pings
                # (20 s timeout), which a direct run at a few tokens/s on a busy machine outlasts.
                direct_runs.append(await asyncio.to_thread(direct.decode, max(2, ws_runs[0]["output_tokens"])))
    finally:
        direct.close()
    return ws_runs, direct_runs


def decode_directly(runner: ModelRunner, num_tokens: int, sync: Callable[[], None]) -> dict[str, Any]:
    """Greedy decode of DECODE_PROMPT by calling the model directly: prefill, then one decode call per
    token. Timed like the server's decode_tokens_per_s: from the first sampled token to the last."""
    template = ChatTemplate(runner.tokenizer)
    prompt = template.prompt_ids([template.message_ids("user", DECODE_PROMPT, 0)])
    cache = runner.new_cache()
    cache.reserve(len(prompt) + num_tokens)
    logits = runner.prefill(cache, prompt)
    token = int(torch.argmax(logits))
    ids = [token]
    sync()
    started = time.perf_counter()
    for _ in range(num_tokens - 1):
        logits = runner.decode([cache], [token])
        token = int(torch.argmax(logits[0]))
        ids.append(token)
    elapsed = time.perf_counter() - started
    cache.free()
    content = [t for t in ids if t not in runner.info.eos_token_ids]
    return {"tps": ratio(num_tokens - 1, elapsed), "text": runner.tokenizer.decode(content), "ids": ids}


class DirectDecoder:
    """The direct path in a fresh child process of its own, like the server's: a process that has run
    the other figures decodes measurably slower (allocator and thread-pool state), which would make
    the comparison unfair. It loads the model once and decodes on request, so runs can alternate with
    the websocket runs."""

    def __init__(self, bench: Bench) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.serving", "--direct-worker", "--device", bench.device,
             "--dtype", bench.dtype, "--threads", str(bench.threads)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._receive()  # the model is loaded

    def _receive(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(_RESULT):
                answer: dict[str, Any] = json.loads(line[len(_RESULT):])
                return answer
        raise RuntimeError(f"the direct decode process exited with {self.process.wait()}")

    def decode(self, num_tokens: int) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{num_tokens}\n")
        self.process.stdin.flush()
        return self._receive()

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)


_RESULT = "DIRECT-RESULT "


def _direct_worker(args: argparse.Namespace) -> int:
    from chatd.config import ModelSettings
    from chatd.engine.model.runner import ModelRunner
    from devtools.models import packaged_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = packaged_model_dir()
    runner = ModelRunner.load(ModelSettings(source=str(folder), device=args.device, dtype=args.dtype,
                                            threads=args.threads), folder)
    runner.pool.wait_populated()  # timed steps do not share the cores with it

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    decode_directly(runner, 4, sync)  # warm-up
    print(_RESULT + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        result = decode_directly(runner, int(line), sync)
        print(_RESULT + json.dumps(result), flush=True)
    return 0


def _decode_figure(bench: Bench, ws_runs: list[dict[str, Any]], direct_runs: list[dict[str, Any]]) -> Figure:
    fig = Figure(
        "decode_overhead", "Decode through the websocket vs the model called directly",
        f"Greedy decode tokens/s of one reply (max_tokens {bench.plan.decode_tokens}) streamed by a real "
        "`chatd serve` process to the websocket client, vs the same prompt and token count decoded by "
        "ModelRunner.prefill + ModelRunner.decode in a loop with no server (in a fresh process of its own, "
        "like the server's; the runs alternate, each path idling while the other runs). Client tokens/s "
        "counts from the first token frame to message.done; server tokens/s is usage.decode_tokens_per_s.",
        columns=[
            Column("path", "path"), Column("tokens", "tokens"), Column("tokens_per_s", "tokens/s", "{:.1f}"),
            Column("overhead", "direct / this", "{:.2f}x"), Column("runs", "runs"),
        ])
    tokens = ws_runs[0]["output_tokens"]
    direct = median([r["tps"] for r in direct_runs])
    client = median([r["client_decode_tps"] for r in ws_runs])
    server = median([r["server_decode_tps"] for r in ws_runs])
    fig.rows = [
        {"path": "direct (ModelRunner)", "tokens": tokens, "tokens_per_s": direct, "overhead": 1.0,
         "runs": len(direct_runs), "runs_tps": [r["tps"] for r in direct_runs]},
        {"path": "server, measured inside (usage)", "tokens": tokens, "tokens_per_s": server,
         "overhead": ratio(direct, server), "runs": len(ws_runs),
         "runs_tps": [r["server_decode_tps"] for r in ws_runs]},
        {"path": "websocket client", "tokens": tokens, "tokens_per_s": client, "overhead": ratio(direct, client),
         "runs": len(ws_runs), "runs_tps": [r["client_decode_tps"] for r in ws_runs]},
    ]
    same = all(r["text"].strip() == direct_runs[0]["text"].strip() for r in ws_runs)
    fig.summary = {"same_text_as_direct": same, "ws_ttft_ms": median([1000 * r["ttft_s"] for r in ws_runs])}
    if tokens < bench.plan.decode_tokens:
        fig.notes.append(f"the reply ended at EOS after {tokens} tokens; both paths decode that many.")
    fig.add_headline("websocket decode overhead (direct tokens/s / websocket tokens/s)", ratio(direct, client),
                     "{:.2f}x")
    fig.add_headline("decode tokens/s through the websocket", client, "{:.1f} tok/s")
    return fig


async def _admin_engine(server: ServerProcess) -> dict[str, int]:
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.get(f"{server.http_url}/admin/stats", headers=server.admin_headers)
        response.raise_for_status()
        engine: dict[str, int] = response.json()["engine"]
        return engine


async def _concurrency(bench: Bench, server: ServerProcess) -> Figure:
    fig = Figure(
        "concurrency", "Concurrent clients: aggregate throughput and time to first token",
        f"N websocket clients, each on its own connection and a new session, send one message at the same "
        f"moment (greedy, max_tokens {bench.plan.concurrency_tokens}), every message of the run a different one "
        f"(only the chat template's opening is ever cached). The levels take turns, one round each, until every "
        f"level has at least {bench.plan.concurrency_min_samples} samples, so a slow spell of the machine falls "
        "on all of them; a level's rates are the medians of its rounds. Aggregate tokens/s = output tokens of a "
        "round / its wall time; aggregate decode tokens/s = the tokens after each client's first, over the span "
        "from the round's first first token to its last reply's end (the decode phase, without the prompts' prefill); "
        "TTFT is measured by each client from sending to its first token frame; server TTFT is the reply's "
        "usage.ttft_ms (from the server taking the message to its first token), so the difference is the "
        "time the frames spend between the processes, the clients' own work included. Mean batch = "
        "decoded tokens / decode steps, from /admin/stats.",
        columns=[
            Column("clients", "clients"), Column("samples", "samples"),
            Column("aggregate_tps", "aggregate tok/s", "{:.1f}"), Column("scaling", "vs 1 client", "{:.2f}x"),
            Column("decode_tps", "aggregate decode tok/s", "{:.1f}"),
            Column("decode_scaling", "decode vs 1 client", "{:.2f}x"),
            Column("per_client_tps", "per-client tok/s", "{:.1f}"),
            Column("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"), Column("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
            Column("server_ttft_p99_ms", "server TTFT p99 ms", "{:.0f}"),
            Column("mean_batch", "mean batch", "{:.1f}"),
        ])
    levels = bench.plan.concurrency
    cycles = max(-(-bench.plan.concurrency_min_samples // level) for level in levels)
    bench.log(f"  levels {', '.join(map(str, levels))} clients, taking turns, {cycles} rounds each")
    clients = {level: [await ChatClient.connect(server.ws_url, request_timeout=600) for _ in range(level)]
               for level in levels}
    seen: dict[int, dict[str, list[float]]] = {
        level: {key: [] for key in ("ttft", "server_ttft", "aggregate", "decode", "per_client", "decoded", "steps")}
        for level in levels}
    requests = 0
    try:
        for _ in range(cycles):
            for level in levels:
                got = seen[level]
                before = await _admin_engine(server)
                sessions = [(await c.create_session()).session_id for c in clients[level]]
                started = time.perf_counter()
                results = await asyncio.gather(*(
                    _stream(c, s, fresh_prompt(requests + i), bench.plan.concurrency_tokens)
                    for i, (c, s) in enumerate(zip(clients[level], sessions, strict=True))))
                requests += level
                wall = time.perf_counter() - started
                after = await _admin_engine(server)
                got["ttft"].extend(1000 * r["ttft_s"] for r in results)
                got["server_ttft"].extend(r["server_ttft_ms"] for r in results)
                got["aggregate"].append(ratio(sum(r["output_tokens"] for r in results), wall))
                span = max(r["done_at"] for r in results) - min(r["first_at"] for r in results)
                got["decode"].append(ratio(sum(max(0, r["output_tokens"] - 1) for r in results), span))
                got["per_client"].extend(r["client_decode_tps"] for r in results)
                got["decoded"].append(after["decoded_tokens"] - before["decoded_tokens"])
                got["steps"].append(after["decode_steps"] - before["decode_steps"])
    finally:
        for level_clients in clients.values():
            for c in level_clients:
                await c.close()
    for level in levels:
        got = seen[level]
        steps = sum(got["steps"])
        fig.rows.append({
            "clients": level, "samples": len(got["ttft"]), "rounds": cycles, "aggregate_tps": median(got["aggregate"]),
            "decode_tps": median(got["decode"]),
            "per_client_tps": median(got["per_client"]), "ttft_p50_ms": percentile(got["ttft"], 50),
            "ttft_p99_ms": percentile(got["ttft"], 99), "ttft_max_ms": max(got["ttft"]),
            "server_ttft_p50_ms": percentile(got["server_ttft"], 50),
            "server_ttft_p99_ms": percentile(got["server_ttft"], 99),
            "mean_batch": ratio(sum(got["decoded"]), steps) if steps else 0.0,
        })
    base = fig.rows[0]["aggregate_tps"]
    decode_base = fig.rows[0]["decode_tps"]
    for row in fig.rows:
        row["scaling"] = ratio(row["aggregate_tps"], base)
        row["decode_scaling"] = ratio(row["decode_tps"], decode_base)
    top = fig.rows[-1]
    fig.add_headline(f"aggregate tokens/s, {top['clients']} clients vs 1", top["scaling"], "{:.2f}x")
    fig.add_headline(f"aggregate decode tokens/s, {top['clients']} clients vs 1", top["decode_scaling"], "{:.2f}x")
    eight = next((row for row in fig.rows if row["clients"] == 8), None)
    if eight is not None and eight is not top:
        fig.add_headline("aggregate decode tokens/s, 8 clients vs 1", eight["decode_scaling"], "{:.2f}x")
    fig.add_headline(f"TTFT p99 with {top['clients']} clients", top["ttft_p99_ms"], "{:.0f} ms")
    fig.add_headline(f"TTFT p99 with {top['clients']} clients vs 1",
                     ratio(top["ttft_p99_ms"], fig.rows[0]["ttft_p99_ms"]), "{:.1f}x")
    fig.add_headline(f"server TTFT p99 with {top['clients']} clients vs 1",
                     ratio(top["server_ttft_p99_ms"], fig.rows[0]["server_ttft_p99_ms"]), "{:.1f}x")
    return fig


def run_serving(bench: Bench) -> tuple[Figure, Figure]:
    """Figures 5 and 6 on one server process."""
    bench.log("  starting chatd serve")
    server = start_server(bench)
    try:
        ws_runs, direct_runs = asyncio.run(_ws_decode(bench, server))
        started = time.perf_counter()
        concurrency = asyncio.run(_concurrency(bench, server))
        concurrency.elapsed_s = time.perf_counter() - started
        assert server.process is not None
        concurrency.summary["server_peak_rss_bytes"] = proc_status_bytes("VmHWM", server.process.pid)
    finally:
        code = server.stop()
    concurrency.summary["server_exit_code"] = code
    return _decode_figure(bench, ws_runs, direct_runs), concurrency


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving")
    parser.add_argument("--direct-worker", action="store_true", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=0)
    return _direct_worker(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
