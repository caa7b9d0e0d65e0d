"""Prometheus metrics of one server (own registry: several servers may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["ServerMetrics"]


class ServerMetrics:
    """The server's counters and gauges, exposed at GET /metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.syncs = Counter("weightsync_syncs", "Weight syncs, by outcome", ["outcome"], registry=r)
        self.sync_seconds = Histogram(
            "weightsync_sync_duration_seconds",
            "Receiver-side sync time, from accepted plan to commit",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.sync_bytes = Counter("weightsync_sync_bytes", "Bytes of committed syncs", registry=r)
        self.version = Gauge("weightsync_weight_version", "Weight version served (-1: none)", registry=r)
        self.sync_in_progress = Gauge("weightsync_sync_in_progress", "1 while a sync is landing", registry=r)
        self.waiting_at_gate = Gauge(
            "weightsync_requests_waiting_at_gate", "Requests waiting for the first committed version", registry=r
        )
        self.requests = Counter("weightsync_requests", "Completion requests, by HTTP status", ["status"], registry=r)
        self.engine_failures = Counter(
            "weightsync_engine_failures", "Engine steps that raised (their requests got a 500)", registry=r
        )
        self.version.set(-1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
