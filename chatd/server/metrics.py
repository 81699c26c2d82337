"""Prometheus metrics. State (bytes and sessions per tier, counters kept by the parts) is read at
scrape time by a collector; per-turn distributions are histograms observed as turns finish.

Each app gets its own registry, so several servers can live in one process (tests)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from chatd.core import Chatd
    from chatd.sessions import TurnResult

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _StateCollector(Collector):
    def __init__(self, core: Chatd) -> None:
        self.core = core

    def collect(self) -> Iterator[Metric]:
        core = self.core
        kv, snaps, svc, worker = core.kv, core.snapshots, core.sessions, core.worker
        resident = set(kv.resident_ids())
        on_disk = set(snaps.records()) - resident

        kv_bytes = GaugeMetricFamily("chatd_kv_bytes", "KV cache bytes per tier (disk: compressed files)",
                                     labels=["tier"])
        kv_bytes.add_metric(["device"], kv.resident_bytes)
        kv_bytes.add_metric(["disk"], snaps.disk_bytes)
        yield kv_bytes
        budget = GaugeMetricFamily("chatd_kv_budget_bytes", "KV cache budget per tier", labels=["tier"])
        budget.add_metric(["device"], kv.budget_bytes)
        budget.add_metric(["disk"], snaps.disk_budget_bytes)
        yield budget
        sessions = GaugeMetricFamily("chatd_sessions", "Sessions with a cache, per tier", labels=["tier"])
        sessions.add_metric(["device"], len(resident))
        sessions.add_metric(["disk"], len(on_disk))
        yield sessions
        yield GaugeMetricFamily("chatd_active_generations", "Generations running", value=svc.num_generating)

        stats = kv.stats
        for name, doc, value in (
            ("chatd_evictions", "Caches evicted from memory", stats.evictions),
            ("chatd_restores", "Caches restored from snapshots", stats.restores),
            ("chatd_restore_failures", "Snapshots rejected or unreadable (recomputed instead)",
             stats.restore_failures),
            ("chatd_snapshot_writes", "Snapshots written", stats.snapshot_writes),
            ("chatd_snapshot_write_failures", "Snapshot writes that failed (disk full, I/O)",
             stats.snapshot_write_failures),
            ("chatd_turns", "Turns completed", svc.num_turns),
            ("chatd_cached_tokens", "Prompt tokens served from a cache", svc.num_cached_tokens),
            ("chatd_prefilled_tokens", "Prompt tokens computed", svc.num_prefill_tokens),
            ("chatd_decode_steps", "Batched decode steps run by the engine", worker.num_decode_steps),
            ("chatd_decoded_tokens", "Tokens decoded by the engine", worker.num_decode_tokens),
        ):
            yield CounterMetricFamily(name, doc, value=value)


class Metrics:
    def __init__(self, core: Chatd) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_StateCollector(core))
        self.ttft = Histogram("chatd_ttft_seconds", "Time to first token", registry=self.registry,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60))
        self.decode_speed = Histogram("chatd_decode_tokens_per_second", "Decode speed per turn",
                                      registry=self.registry, buckets=(1, 2, 5, 10, 15, 20, 30, 50, 100, 200, 500))
        self.restore_seconds = Histogram("chatd_restore_seconds", "Snapshot restore time", registry=self.registry,
                                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5))
        self.connections = Gauge("chatd_websocket_connections", "Open websocket connections",
                                 registry=self.registry)
        core.sessions.on_turn.append(self.observe_turn)

    def observe_turn(self, result: TurnResult) -> None:
        self.ttft.observe(result.usage.ttft_ms / 1000)
        if result.usage.output_tokens > 1:
            self.decode_speed.observe(result.usage.decode_tokens_per_s)
        if result.usage.restore_ms is not None:
            self.restore_seconds.observe(result.usage.restore_ms / 1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)
