"""Figures 3 and 4: what keeping a conversation's cache saves a user, turn by turn.

3. ``ttft_vs_history`` — a multi-turn conversation whose history grows; at each turn the time to first
   token with the session's cache kept (normal chatd) vs the same turn in a twin session whose cache is
   dropped before every turn (the whole history recomputed), and their ratio per history length.
4. ``edit_cost`` — a long conversation; a user message early / in the middle / late is edited. Each
   edit's prefill (time to first token and ``usage.prefill_tokens``) is set against the number of
   tokens after the edit and against a full recompute of the same edited history.

Both run in-process on a real :class:`chatd.service.core.Chatd` (store, KV manager, engine worker) with the
packaged model; every number comes from the turn's own ``usage``.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from benchmarks.common import Bench, Column, Corpus, Figure, open_chatd, ratio
from chatd import config
from chatd.service.core import Chatd
from chatd.service.types import GenerationOptions, TurnResult

SYSTEM = "You are a careful assistant. The user shares notes in parts; answer briefly."
PROBE_TOKENS = 24  # about the length of the measured question, with its framing
FRAMING_TOKENS = 12  # message header/footer and generation prompt around a message's content


def _settings(bench: Bench, name: str) -> config.Settings:
    # Background maintenance off: no idle persistence or eviction may land inside a measured turn. Prefix
    # sharing off: the recomputed twin must not start from the kept session's cache.
    return config.load(env={}, overrides={
        "data_dir": str(bench.subdir(name)),
        "model": bench.model_settings(),
        "cache": {"persist_idle_s": 0, "idle_evict_s": 0, "device_budget_mb": 4096, "share_prefixes": False},
        "log_level": "warning",
    })


def _params(bench: Bench) -> GenerationOptions:
    return GenerationOptions(max_tokens=bench.plan.reply_tokens, temperature=0.0)


async def _conversation_tokens(core: Chatd, session_id: str) -> int:
    return sum(len(m.token_ids) for m in await core.repo.get_messages(session_id))


async def _direct_ms(core: Chatd, session_id: str) -> float:
    """The model's own time for the prompt of the session's last reply (all messages before it): a chunked
    prefill from an empty cache, chunked like the engine, and the first token's argmax, called directly on
    the engine thread with nothing else queued. The floor a recomputed turn's TTFT is held against."""
    messages = await core.repo.get_messages(session_id)
    prompt = core.sessions.template.prompt_ids(m.token_ids for m in messages[:-1])
    runner, chunk = core.runner, core.settings.model.prefill_chunk_tokens

    def run() -> float:
        cache = runner.new_cache()
        cache.reserve(len(prompt) + 1)
        started = time.perf_counter()
        for start in range(0, len(prompt), chunk):
            logits = runner.prefill(cache, prompt[start:start + chunk])
        int(logits.argmax())
        elapsed = time.perf_counter() - started
        cache.free(forget=True)
        return elapsed * 1000

    return float(await core.worker.call(run))


async def _turn(core: Chatd, session_id: str, content: str, params: GenerationOptions) -> TurnResult:
    result = await core.sessions.send(session_id, content, params).wait()
    assert isinstance(result, TurnResult)
    return result


async def _ttft_vs_history(bench: Bench, corpus: Corpus) -> Figure:
    fig = Figure(
        "ttft_vs_history", "Time to first token vs history length, cache kept vs recomputed",
        "A conversation grows (user messages are parts of a document). At each history length a short "
        "question is sent to two sessions with identical histories: one keeps its KV cache between turns "
        "(normal chatd, only the question is prefilled), the other has its cache dropped just before the "
        "question, so the whole history is prefilled again. TTFT is usage.ttft_ms, from the request to the "
        "first token.",
        columns=[
            Column("history_tokens", "history tokens"), Column("new_tokens", "new tokens"),
            Column("kept_ttft_ms", "TTFT kept ms", "{:.0f}"),
            Column("recompute_ttft_ms", "TTFT recomputed ms", "{:.0f}"),
            Column("speedup", "recomputed / kept", "{:.1f}x"), Column("kept_cached_tokens", "cached tokens"),
            Column("recompute_prefill_tokens", "recomputed tokens"), Column("same_reply", "same reply"),
            Column("direct_ms", "direct on the model ms", "{:.0f}"),
            Column("recompute_vs_direct", "recomputed / direct", "{:.2f}x"),
        ])
    runner = bench.runner()
    params = _params(bench)
    async with open_chatd(_settings(bench, "ttft"), runner) as core:
        kept = (await core.sessions.create(system=SYSTEM)).session_id
        recomputed = (await core.sessions.create(system=SYSTEM)).session_id
        opening = "I will send you my notes in several parts. Please read each part."
        await _turn(core, kept, opening, params)  # also warms the model up
        await _turn(core, recomputed, opening, params)
        for number, target in enumerate(bench.plan.history_tokens, start=1):
            # Grow both histories to about `target` with a part of the notes (not measured; the twin
            # keeps its cache for this turn), then measure a short question on top of it.
            current = await _conversation_tokens(core, kept)
            need = target - current - PROBE_TOKENS - 2 * FRAMING_TOKENS - bench.plan.reply_tokens
            if need >= 16:
                part = "Next part of the notes:\n\n" + corpus.text(need)
                await _turn(core, kept, part, params)
                await _turn(core, recomputed, part, params)
            probe = f"Question {number}: what is the main point of the notes so far? Answer in one sentence."
            bench.log(f"  turn at ~{target} history tokens")
            a = await _turn(core, kept, probe, params)
            await core.kv.drop(recomputed)
            b = await _turn(core, recomputed, probe, params)
            direct = await _direct_ms(core, recomputed)
            fig.rows.append({
                "history_tokens": a.usage.input_tokens, "new_tokens": a.usage.prefill_tokens,
                "kept_ttft_ms": a.usage.ttft_ms, "recompute_ttft_ms": b.usage.ttft_ms,
                "speedup": ratio(b.usage.ttft_ms, a.usage.ttft_ms),
                "kept_cached_tokens": a.usage.cached_tokens, "kept_tier": a.usage.cache_tier,
                "recompute_prefill_tokens": b.usage.prefill_tokens, "recompute_cached_tokens": b.usage.cached_tokens,
                "same_reply": a.assistant_message.content == b.assistant_message.content,
                "direct_ms": direct, "recompute_vs_direct": ratio(b.usage.ttft_ms, direct),
            })
    fig.summary = {"reply_tokens": bench.plan.reply_tokens}
    for row in fig.rows:
        fig.add_headline(f"TTFT recomputed / kept at {row['history_tokens']} history tokens", row["speedup"],
                         "{:.1f}x")
    if fig.rows:
        last = fig.rows[-1]
        fig.add_headline(f"recomputed TTFT / direct prefill on the model at {last['history_tokens']} tokens",
                         last["recompute_vs_direct"], "{:.2f}x")
    return fig


async def _edit_cost(bench: Bench, corpus: Corpus) -> Figure:
    fig = Figure(
        "edit_cost", "Cost of editing a past message",
        f"A conversation of about {bench.plan.edit_history_tokens} tokens in {bench.plan.edit_messages} user "
        "messages. A user message early, in the middle and late is edited (its first words change; later "
        "messages are dropped, as chatd's edit does). The edit's prefill (usage.prefill_tokens, "
        "usage.ttft_ms) is set against the tokens after the edit point in the old history and against a full "
        "recompute of the same edited history (cache dropped, same edit again). Edits run latest first, each "
        "on the history the previous one left.",
        columns=[
            Column("position", "edited message"), Column("history_tokens", "history tokens"),
            Column("edit_at_token", "edit at token"), Column("tokens_after_edit", "tokens after edit"),
            Column("prefill_tokens", "prefilled"), Column("edit_ttft_ms", "edit TTFT ms", "{:.0f}"),
            Column("recompute_prefill_tokens", "recompute prefilled"),
            Column("recompute_ttft_ms", "recompute TTFT ms", "{:.0f}"),
            Column("speedup", "recompute / edit", "{:.1f}x"), Column("same_reply", "same reply"),
            Column("direct_ms", "direct on the model ms", "{:.0f}"),
            Column("recompute_vs_direct", "recompute / direct", "{:.2f}x"),
        ])
    runner = bench.runner()
    params = _params(bench)
    per_message = bench.plan.edit_history_tokens // bench.plan.edit_messages - 24
    async with open_chatd(_settings(bench, "edit"), runner) as core:
        sid = (await core.sessions.create(system=SYSTEM)).session_id
        for i in range(bench.plan.edit_messages):
            await _turn(core, sid, f"Notes, part {i + 1}:\n\n" + corpus.text(per_message), params)
        messages = await core.repo.get_messages(sid)
        user_indices = [m.index for m in messages if m.role == "user"]
        picks = {"late": user_indices[-1], "middle": user_indices[len(user_indices) // 2], "early": user_indices[0]}
        for position, index in sorted(picks.items(), key=lambda item: -item[1]):
            messages = await core.repo.get_messages(sid)
            history = sum(len(m.token_ids) for m in messages)
            original = messages[index].content
            edited = "Correction to this part: " + original
            bench.log(f"  edit {position} message (index {index})")
            first = await core.sessions.edit(sid, index, edited, params).wait()
            await core.kv.drop(sid)
            again = await core.sessions.edit(sid, index, edited, params).wait()
            assert isinstance(first, TurnResult) and isinstance(again, TurnResult)
            direct = await _direct_ms(core, sid)
            edit_at = first.usage.invalidated_from if first.usage.invalidated_from is not None else 0
            fig.rows.append({
                "position": f"{position} (#{index})", "message_index": index, "history_tokens": history,
                "edit_at_token": edit_at, "tokens_after_edit": history - edit_at,
                "prefill_tokens": first.usage.prefill_tokens, "cached_tokens": first.usage.cached_tokens,
                "edit_ttft_ms": first.usage.ttft_ms, "recompute_prefill_tokens": again.usage.prefill_tokens,
                "recompute_ttft_ms": again.usage.ttft_ms, "speedup": ratio(again.usage.ttft_ms, first.usage.ttft_ms),
                "same_reply": first.assistant_message.content == again.assistant_message.content,
                "direct_ms": direct, "recompute_vs_direct": ratio(again.usage.ttft_ms, direct),
            })
    fig.summary = {"messages": bench.plan.edit_messages, "reply_tokens": bench.plan.reply_tokens}
    for row in fig.rows:
        fig.add_headline(f"edit of the {row['position'].split()[0]} message: recompute / edit TTFT", row["speedup"],
                         "{:.1f}x")
        fig.add_headline(f"edit of the {row['position'].split()[0]} message: recompute TTFT / direct prefill",
                         row["recompute_vs_direct"], "{:.2f}x")
    return fig


async def _shared_prefix(bench: Bench, corpus: Corpus) -> Figure:
    fig = Figure(
        "shared_prefix", "Sessions with one shared system prompt",
        f"N sessions are created with the same ~{bench.plan.shared_prefix_tokens}-token system prompt and each "
        "sends one short message, one after another. The first session prefills the system prompt; every "
        "later one references the blocks of the KV pool that hold it (found by the hash of their tokens, "
        "[cache] share_prefixes) and computes only its own message. Reported: the later sessions' cached "
        "tokens and median TTFT against the first session's, and the device KV bytes (pool blocks held, each "
        "counted once) of all N against one session's.",
        columns=[
            Column("sessions", "sessions"), Column("prompt_tokens", "prompt tokens"),
            Column("first_ttft_ms", "first TTFT ms", "{:.0f}"), Column("later_ttft_ms", "later TTFT ms (median)",
                                                                       "{:.0f}"),
            Column("ttft_ratio", "first / later", "{:.1f}x"), Column("later_cached_tokens", "later cached (min)"),
            Column("kv_mb", "device KV MB", "{:.1f}"), Column("kv_vs_one", "KV vs one session", "{:.1f}x"),
        ])
    runner = bench.runner()
    params = _params(bench)
    system = corpus.text(bench.plan.shared_prefix_tokens)
    for count in bench.plan.shared_prefix_sessions:
        settings = config.load(env={}, overrides={
            "data_dir": str(bench.subdir(f"shared-{count}")), "model": bench.model_settings(),
            "cache": {"persist_idle_s": 0, "idle_evict_s": 0, "device_budget_mb": 6144}, "log_level": "warning"})
        async with open_chatd(settings, runner) as core:
            results = []
            for index in range(count):
                sid = (await core.sessions.create(system=system)).session_id
                results.append(await _turn(core, sid, f"Hello, I am user {index}.", params))
                if index == 0:
                    one_session_bytes = core.kv.resident_bytes
            later = results[1:]
            first = results[0]
            later_ttft = statistics.median(r.usage.ttft_ms for r in later) if later else first.usage.ttft_ms
            fig.rows.append({
                "sessions": count, "prompt_tokens": first.usage.input_tokens,
                "first_ttft_ms": first.usage.ttft_ms, "later_ttft_ms": later_ttft,
                "ttft_ratio": ratio(first.usage.ttft_ms, later_ttft),
                "later_cached_tokens": min((r.usage.cached_tokens for r in later), default=first.usage.cached_tokens),
                "kv_mb": core.kv.resident_bytes / 1e6, "kv_vs_one": ratio(core.kv.resident_bytes, one_session_bytes),
                "prefix_shares": core.counters.num_prefix_shares,
            })
    for row in fig.rows:
        if row["sessions"] > 1:
            fig.add_headline(f"{row['sessions']} sessions: first / later TTFT", row["ttft_ratio"], "{:.1f}x")
    return fig


def run_shared_prefix(bench: Bench, corpus: Corpus) -> Figure:
    return asyncio.run(_shared_prefix(bench, corpus))


def run_ttft_vs_history(bench: Bench, corpus: Corpus) -> Figure:
    return asyncio.run(_ttft_vs_history(bench, corpus))


def run_edit_cost(bench: Bench, corpus: Corpus) -> Figure:
    return asyncio.run(_edit_cost(bench, corpus))


def rows_by_history(fig: Figure) -> dict[int, dict[str, Any]]:
    return {int(r["history_tokens"]): r for r in fig.rows}
