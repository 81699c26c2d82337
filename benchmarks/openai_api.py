"""Figure 9: ``openai_resend`` — a stateless client on the OpenAI-compatible API, turn by turn.

A 10-turn conversation is sent through ``POST /v1/chat/completions`` the way every OpenAI client sends
it: each request carries the whole conversation so far plus one new user message. Two runs against the
same `chatd serve` (packaged model, greedy, the same messages):

* **cache** — the requests of one caller: chatd matches each request's tokens to the cache the previous
  request left (longest common prefix) and prefills only what is new;
* **no cache** — each request from another caller (``user`` differs) with ``[cache] share_prefixes = false``,
  so no cached KV can serve it and the whole conversation is prefilled every turn: a server without
  prompt caching.

TTFT is measured by the client: from sending the request to the first content chunk of the SSE stream.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from benchmarks.common import Bench, Column, Corpus, Figure, ratio
from devtools.servers import ServerProcess

TURNS = 10
USER_TOKENS = 48
SYSTEM = "You are a careful assistant. The user shares notes in parts; answer briefly."


def _stream(http: httpx.Client, body: dict[str, Any]) -> tuple[float, str, dict[str, Any]]:
    """One streamed request: client TTFT in ms, the reply text, and the usage chunk (with chatd's field, or
    llama-server's ``timings``)."""
    started = time.perf_counter()
    ttft_ms = 0.0
    text: list[str] = []
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True,
                                                            "stream_options": {"include_usage": True}}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                if not ttft_ms:
                    ttft_ms = (time.perf_counter() - started) * 1000
                text.append(chunk["choices"][0]["delta"]["content"])
            if chunk.get("usage"):
                usage = {**chunk["usage"], "chatd": chunk.get("chatd")}
            timings = chunk.get("timings") or timings
    return ttft_ms or (time.perf_counter() - started) * 1000, "".join(text), {**usage, "timings": timings}


def cached_tokens(usage: dict[str, Any]) -> int:
    """Prompt tokens served from cache: OpenAI's ``prompt_tokens_details``, else llama-server's ``cache_n``."""
    details = usage.get("prompt_tokens_details") or {}
    if "cached_tokens" in details:
        return int(details["cached_tokens"])
    return int(usage.get("timings", {}).get("cache_n", 0))


def conversation(http: httpx.Client, model: str, questions: list[str], reply_tokens: int,
                 user_of: Any, extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Send ``questions`` as one growing conversation, the whole of it every turn; one row per turn.
    ``extra``: more request fields (llama-server's ``cache_prompt``)."""
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    rows = []
    for turn, question in enumerate(questions, start=1):
        messages.append({"role": "user", "content": question})
        ttft_ms, text, usage = _stream(http, {"model": model, "messages": messages, "max_tokens": reply_tokens,
                                              "temperature": 0, "user": user_of(turn), **(extra or {})})
        messages.append({"role": "assistant", "content": text})
        rows.append({"turn": turn, "prompt_tokens": usage.get("prompt_tokens", 0),
                     "cached_tokens": cached_tokens(usage), "ttft_ms": ttft_ms})
    return rows


def run_openai_resend(bench: Bench, corpus: Corpus) -> Figure:
    fig = Figure(
        "openai_resend", "OpenAI API: a 10-turn conversation resent whole, with and without chatd's cache",
        "Each turn's request carries the whole conversation (as OpenAI clients send it) to /v1/chat/completions. "
        "Time to first streamed token per turn, when the request's tokens are matched to the cache the "
        "previous request left vs prefilled whole (no cache can serve it).",
        columns=[Column("turn", "turn"), Column("prompt_tokens", "prompt tokens"),
                 Column("cached_tokens", "cached (cache run)", "{:,}"),
                 Column("ttft_cache_ms", "TTFT cache ms", "{:.0f}"),
                 Column("ttft_nocache_ms", "TTFT no cache ms", "{:.0f}"),
                 Column("speedup", "speed-up", "{:.1f}x")],
    )
    questions = [corpus.text(USER_TOKENS) for _ in range(TURNS)]
    server = ServerProcess(bench.subdir("openai"), bench.model_dir(), model=bench.model_settings(),
                           cache={"device_budget_mb": 4096, "share_prefixes": False}).start(timeout=300)
    try:
        server.wait_pool_populated()
        with httpx.Client(base_url=server.http_url, timeout=600) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            reply_tokens = bench.plan.reply_tokens
            kept = conversation(http, model, questions, reply_tokens, lambda turn: "kept")
            cold = conversation(http, model, questions, reply_tokens, lambda turn: f"cold-{turn}")
    finally:
        server.stop()
    for k, c in zip(kept, cold, strict=True):
        fig.rows.append({"turn": k["turn"], "prompt_tokens": k["prompt_tokens"], "cached_tokens": k["cached_tokens"],
                         "ttft_cache_ms": k["ttft_ms"], "ttft_nocache_ms": c["ttft_ms"],
                         "speedup": ratio(c["ttft_ms"], k["ttft_ms"]),
                         "nocache_cached_tokens": c["cached_tokens"]})
    last = fig.rows[-1]
    fig.add_headline(f"TTFT at turn {TURNS}, no cache ÷ cache", last["speedup"], "{:.1f}x")
    total_kept = sum(r["ttft_cache_ms"] for r in fig.rows)
    total_cold = sum(r["ttft_nocache_ms"] for r in fig.rows)
    fig.summary = {"turns": TURNS, "reply_tokens": reply_tokens, "ttft_cache_total_ms": total_kept,
                   "ttft_nocache_total_ms": total_cold, "total_speedup": ratio(total_cold, total_kept)}
    fig.notes.append("the no-cache run's cached_tokens are 0 on every turn "
                     f"({sum(r['nocache_cached_tokens'] for r in fig.rows)} in all): nothing served it.")
    fig.notes.append("llama-server's OpenAI endpoint (cache_prompt on) runs the same kind of conversation in the "
                     "peer section.")
    return fig
