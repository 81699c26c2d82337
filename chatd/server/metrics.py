"""Prometheus metrics. State and totals are rendered at scrape time from the core's stats (chatd.service.stats);
per-turn distributions are histograms observed as turns finish.

Each app gets its own registry, so several servers can live in one process (tests)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from chatd.service.stats import Stats

if TYPE_CHECKING:
    from chatd.service.core import Chatd
    from chatd.service.types import TurnResult

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _StatsCollector(Collector):
    """Renders one :class:`Stats`, built anew for every scrape."""

    def __init__(self, read_stats: Callable[[], Stats]) -> None:
        self.read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        stats = self.read_stats()
        kv_bytes = GaugeMetricFamily("chatd_kv_bytes", "KV cache bytes per tier (disk: compressed files)",
                                     labels=["tier"])
        budget = GaugeMetricFamily("chatd_kv_budget_bytes", "KV cache budget per tier", labels=["tier"])
        sessions = GaugeMetricFamily("chatd_sessions", "Sessions with a cache, per tier", labels=["tier"])
        for use in stats.tiers:
            kv_bytes.add_metric([use.tier], use.used_bytes)
            budget.add_metric([use.tier], use.budget_bytes)
            sessions.add_metric([use.tier], use.num_sessions)
        yield kv_bytes
        yield budget
        yield sessions
        yield GaugeMetricFamily("chatd_active_generations", "Generations running", value=stats.num_generating)
        pool = stats.pool
        blocks = GaugeMetricFamily("chatd_kv_pool_blocks", "KV pool blocks by state (shared: used by several)",
                                   labels=["state"])
        for state, count in (("used", pool.used_blocks), ("cached", pool.cached_blocks),
                             ("free", pool.num_blocks - pool.used_blocks - pool.cached_blocks),
                             ("shared", pool.shared_blocks)):
            blocks.add_metric([state], count)
        yield blocks
        yield GaugeMetricFamily("chatd_kv_unique_bytes", "KV bytes of used pool blocks, each counted once",
                                value=pool.unique_bytes)
        yield GaugeMetricFamily("chatd_kv_logical_bytes", "KV bytes the sessions would hold without sharing",
                                value=pool.logical_bytes)
        yield GaugeMetricFamily("chatd_kv_prefix_hit_ratio", "Share of looked-up prompt tokens found in the pool",
                                value=pool.hit_ratio)
        yield GaugeMetricFamily("chatd_kv_pool_populated",
                                "1 once the KV pool's pages are faulted in (0 while a thread still does it)",
                                value=int(pool.populated))

        c = stats.counters
        for name, doc, value in (
            ("chatd_evictions", "Caches evicted from memory", c.num_evictions),
            ("chatd_restores", "Caches restored from snapshots", c.num_restores),
            ("chatd_restore_failures", "Snapshots rejected or unreadable (recomputed instead)",
             c.num_restore_failures),
            ("chatd_snapshot_writes", "Snapshots written", c.num_snapshot_writes),
            ("chatd_snapshot_write_failures", "Snapshot writes that failed (disk full, I/O)",
             c.num_snapshot_write_failures),
            ("chatd_prefix_shares", "Caches started from a prefix already in the KV pool", c.num_prefix_shares),
            ("chatd_prefix_shared_tokens", "Tokens of prefixes shared from the KV pool instead of computed",
             c.num_prefix_shared_tokens),
            ("chatd_resumes_from_pool", "Evicted sessions brought back from blocks still in the KV pool",
             c.num_resumes_from_pool),
            ("chatd_turns", "Turns completed", c.num_turns),
            ("chatd_cached_tokens", "Prompt tokens served from a cache", c.num_cached_tokens),
            ("chatd_prefilled_tokens", "Prompt tokens computed", c.num_prefill_tokens),
            ("chatd_decode_steps", "Batched decode steps run by the engine", c.num_engine_decode_steps),
            ("chatd_decoded_tokens", "Tokens decoded by the engine", c.num_engine_decode_tokens),
        ):
            yield CounterMetricFamily(name, doc, value=value)


class Metrics:
    def __init__(self, core: Chatd) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_StatsCollector(core.live_stats))
        self.ttft = Histogram("chatd_ttft_seconds", "Time to first token", registry=self.registry,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60))
        self.decode_speed = Histogram("chatd_decode_tokens_per_second", "Decode speed per turn",
                                      registry=self.registry, buckets=(1, 2, 5, 10, 15, 20, 30, 50, 100, 200, 500))
        self.restore_seconds = Histogram("chatd_restore_seconds", "Snapshot restore time", registry=self.registry,
                                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5))
        self.connections = Gauge("chatd_websocket_connections", "Open websocket connections",
                                 registry=self.registry)
        core.on_turn(self.observe_turn)

    def observe_turn(self, result: TurnResult) -> None:
        self.ttft.observe(result.usage.ttft_ms / 1000)
        if result.usage.output_tokens > 1:
            self.decode_speed.observe(result.usage.decode_tokens_per_s)
        if result.usage.restore_ms is not None:
            self.restore_seconds.observe(result.usage.restore_ms / 1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)
