"""The stats read-model: the tier rule, the frozen Stats, the one set of counters, and their rendering."""

from __future__ import annotations

import dataclasses

import pytest

from chatd.counters import Counters, EvictionReason
from chatd.domain import Tier
from chatd.server.admin import render_stats
from chatd.server.metrics import Metrics
from chatd.service.core import Chatd
from chatd.service.types import GenerationOptions, TurnResult

# Long enough (> restore_min_tokens) that an evicted session is restored rather than recomputed.
LONG_MESSAGE = "Please read this sentence about caches and tiers carefully. " * 12


def greedy(n: int) -> GenerationOptions:
    return GenerationOptions(temperature=0, max_tokens=n)


async def _turn(core: Chatd, session_id: str, content: str = LONG_MESSAGE) -> TurnResult:
    result = await core.sessions.send(session_id, content, greedy(4)).wait()
    assert isinstance(result, TurnResult)
    return result


async def _listed(core: Chatd, tier: Tier) -> tuple[set[str], int]:
    listing = await core.list_sessions(tier, limit=500)
    return {s.info.session_id for s in listing.sessions}, listing.total


async def test_tier_rule_follows_the_cache_through_evict_and_restore(tiny_core: Chatd) -> None:
    core = tiny_core
    cold = (await core.sessions.create(system="Be brief.")).session_id
    warm = (await core.sessions.create(system="Be brief.")).session_id
    assert core.tier(cold) == core.tier(warm) == "none"
    assert core.tier("no-such-session-000000") == "none"

    await _turn(core, warm)
    assert core.tier(warm) == "device" and core.tier(cold) == "none"
    assert await _listed(core, "device") == ({warm}, 1)
    assert await _listed(core, "none") == ({cold}, 1)

    evicted = await core.evict(warm)
    assert evicted.done and evicted.tier == "disk" == core.tier(warm)
    assert await _listed(core, "disk") == ({warm}, 1)
    assert await _listed(core, "device") == (set(), 0)

    restored = await core.restore(warm)
    # The snapshot stays on disk after a restore: a resident cache still decides the tier.
    assert core.snapshots.has(warm)
    assert restored.done and restored.tier == "device" == core.tier(warm)
    assert await _listed(core, "disk") == (set(), 0)
    assert await _listed(core, "host") == (set(), 0)

    # Every listing reports the tier the rule gives, and the filters partition the sessions.
    everyone = await core.list_sessions(None, limit=500)
    assert {s.info.session_id: s.info.tier for s in everyone.sessions} == {warm: "device", cold: "none"}
    assert (await core.session_detail(warm)).summary.info.tier == "device"


async def test_stats_reflect_turns_tiers_and_engine_work(tiny_core: Chatd) -> None:
    core = tiny_core
    session_id = (await core.sessions.create(system="Be brief.")).session_id
    first = await _turn(core, session_id)
    second = await _turn(core, session_id, "And once more, briefly.")
    assert second.usage.cached_tokens > 0

    stats = await core.stats()
    c = stats.counters
    assert c.num_turns == 2
    assert c.num_cached_tokens == first.usage.cached_tokens + second.usage.cached_tokens
    assert c.num_prefill_tokens == first.usage.prefill_tokens + second.usage.prefill_tokens
    # The engine prefilled exactly what the turns reported as prefilled, and decoded what they output.
    assert c.num_engine_prefill_tokens == c.num_prefill_tokens
    assert c.num_engine_decode_tokens == first.usage.output_tokens + second.usage.output_tokens - 2
    assert 0 < stats.cached_token_ratio < 1
    assert stats.num_sessions == 1 and stats.num_generating == 0
    device, disk = stats.tiers
    assert (device.tier, disk.tier) == ("device", "disk")
    assert device.num_sessions == 1 and device.used_bytes == core.kv.kv_bytes(session_id) > 0
    assert device.budget_bytes == 1024 * 1024 * 1024
    assert disk.num_sessions == 0 and disk.used_bytes == 0 and stats.restore_ms_mean is None
    assert stats.model.kv_bytes_per_token == core.runner.info.bytes_per_token
    assert core.live_stats().num_sessions is None

    await core.evict(session_id)
    after = await core.stats()
    assert after.tier_use("disk").num_sessions == 1 and after.tier_use("device").num_sessions == 0
    assert after.tier_use("disk").used_bytes == after.counters.num_snapshot_bytes_written > 0
    assert after.counters.num_evictions == 1 and after.counters.num_snapshot_writes == 1
    assert list(after.counters.eviction_log) == [(session_id, "admin")]


async def test_stats_is_a_frozen_picture_of_one_moment(tiny_core: Chatd) -> None:
    core = tiny_core
    session_id = (await core.sessions.create()).session_id
    await _turn(core, session_id)
    before = await core.stats()
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.num_generating = 3  # type: ignore[misc]

    await _turn(core, session_id, "Another one.")
    await core.evict(session_id)
    await core.restore(session_id)
    # Later events changed the live counters, not the earlier picture (recent samples included).
    assert core.counters.num_turns == 2 and before.counters.num_turns == 1
    assert before.counters.num_evictions == 0 and len(before.counters.eviction_log) == 0
    assert before.counters.num_restores == 0 and len(before.counters.restore_seconds) == 0
    assert before.tier_use("device").num_sessions == 1 and before.tier_use("disk").num_sessions == 0


def test_counters_count_evictions_by_reason_and_copy_independently() -> None:
    counters = Counters()
    evictions: list[tuple[str, EvictionReason]] = [("a", "room"), ("b", "idle"), ("c", "admin"), ("a", "room")]
    for session_id, reason in evictions:
        counters.count_eviction(session_id, reason)
    counters.count_restore(0.25)
    counters.count_turn(cached_tokens=30, prefill_tokens=10)
    copy = counters.copy()
    counters.count_eviction("d", "idle")
    counters.count_restore(0.5)
    assert (copy.num_evictions, copy.num_evictions_for_room, copy.num_evictions_idle) == (4, 2, 1)
    assert (counters.num_evictions, counters.num_evictions_idle) == (5, 2)
    assert list(copy.eviction_log)[-1] == ("a", "room") and list(copy.restore_seconds) == [0.25]
    assert (copy.num_turns, copy.num_cached_tokens, copy.num_prefill_tokens) == (1, 30, 10)


async def test_admin_json_and_metrics_render_the_same_stats(tiny_core: Chatd) -> None:
    core = tiny_core
    metrics = Metrics(core)
    session_id = (await core.sessions.create()).session_id
    await _turn(core, session_id)
    await core.evict(session_id)
    stats = await core.stats()

    body = render_stats(stats)
    # The documented shape of GET /admin/stats (docs/protocol.md), keys in order.
    assert list(body) == [
        "model", "tiers", "pool", "sessions", "turns", "cached_tokens", "prefilled_tokens", "cached_token_ratio",
        "evictions", "evictions_idle", "evictions_for_room", "restores", "restore_failures", "restore_ms_mean",
        "snapshot_writes", "snapshot_write_failures", "snapshot_bytes_written",
        "snapshots_deleted_for_disk_budget", "prefix_shares", "prefix_shared_tokens", "resumes_from_pool", "engine"]
    assert list(body["model"]) == ["name", "dtype", "device", "max_context", "kv_bytes_per_token", "weights",
                                   "cpu_features", "kernels", "architecture", "parameters", "weights_from"]
    info = core.runner.info
    assert body["model"]["weights"] == info.weights and body["model"]["cpu_features"] == list(info.cpu_features)
    assert body["model"]["kernels"] == info.kernels
    assert list(body["tiers"]) == ["device", "disk"]
    assert body["sessions"] == {"total": 1, "resident": 0, "evicted": 1, "generating": 0}
    assert body["turns"] == 1 and body["evictions"] == 1 and body["snapshot_writes"] == 1
    assert body["engine"]["prefilled_tokens"] == body["prefilled_tokens"]
    pool = body["pool"]
    pool_bytes = pool["blocks"] * pool["block_size"] * stats.model.kv_bytes_per_token
    assert pool_bytes == body["tiers"]["device"]["budget_bytes"]
    # Evicted: its blocks are held by nobody, but stay findable by their tokens until the room is needed.
    assert pool["used_blocks"] == 0 and pool["cached_blocks"] > 0 and pool["unique_bytes"] == 0

    text = metrics.render().decode()
    disk_bytes = stats.tier_use("disk").used_bytes
    for line in ('chatd_sessions{tier="disk"} 1.0', 'chatd_sessions{tier="device"} 0.0',
                 f'chatd_kv_bytes{{tier="disk"}} {float(disk_bytes)}', "chatd_turns_total 1.0",
                 "chatd_evictions_total 1.0", "chatd_snapshot_writes_total 1.0", "chatd_ttft_seconds_count 1.0",
                 "chatd_prefix_shares_total 0.0", 'chatd_kv_pool_blocks{state="used"} 0.0',
                 "chatd_kv_unique_bytes 0.0"):
        assert line in text.splitlines(), line
