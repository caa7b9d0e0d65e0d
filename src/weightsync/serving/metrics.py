"""Prometheus metrics of one server (own registry: several servers may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from weightsync.messages import SyncTimes

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
        self.sync_phase_seconds = Histogram(
            "weightsync_sync_phase_seconds",
            "Where committed syncs spent their time: transfer, landing, load (the engine's reload), pause",
            ["phase"],
            buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.sync_bytes = Counter("weightsync_sync_bytes", "Bytes of committed syncs", registry=r)
        self.sync_modes = Counter(
            "weightsync_sync_modes",
            "Committed syncs by how they travelled: full, or delta (only what changed, patched in place)",
            ["mode"],
            registry=r,
        )
        for mode in ("full", "delta"):
            self.sync_modes.labels(mode)  # both at 0 from the start
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

    def observe_times(self, times: SyncTimes, mode: str | None = None) -> None:
        """One committed sync's phases, and how it travelled ("full" or "delta")."""
        if mode is not None:
            self.sync_modes.labels(mode).inc()
        for phase in ("transfer", "landing", "load", "pause"):
            self.sync_phase_seconds.labels(phase).observe(getattr(times, f"{phase}_s"))

    def render(self) -> bytes:
        return generate_latest(self.registry)
