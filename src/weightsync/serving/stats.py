"""What GET /weight_info reports beside the sync control's state: what the server serves, fixed
once its receivers are up (`Served`), and the last sync as the server saw it (`SyncStats`, with
the sync metrics it moves; serving/control.py owns the one instance)."""

from __future__ import annotations

import dataclasses

from weightsync.serving.metrics import ServerMetrics

__all__ = ["Served", "SyncStats"]


@dataclasses.dataclass(slots=True)
class SyncStats:
    """The last sync as the server saw it (GET /weight_info)."""

    version: int | None = None
    total_bytes: int = 0
    bucket_bytes: int = 0
    """The bucket size the push agreed on: what `weightsync digest` needs to recompute its digest."""
    seconds: float = 0.0
    ok: bool | None = None
    error: str = ""
    num_committed: int = 0
    num_failed: int = 0

    @property
    def gbps(self) -> float:
        return self.total_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def next(self, version: int, total_bytes: int, bucket_bytes: int, metrics: ServerMetrics) -> SyncStats:
        """The stats of a sync of `version` beginning now; the counts carry over."""
        metrics.sync_in_progress.set(1)
        return SyncStats(
            version, total_bytes, bucket_bytes, num_committed=self.num_committed, num_failed=self.num_failed
        )

    def committed(self, seconds: float, metrics: ServerMetrics) -> None:
        self.seconds, self.ok = seconds, True
        self.num_committed += 1
        metrics.syncs.labels("committed").inc()
        metrics.sync_seconds.observe(seconds)
        metrics.sync_bytes.inc(self.total_bytes)
        if self.version is not None:
            metrics.version.set(self.version)
        metrics.sync_in_progress.set(0)

    def failed(self, seconds: float, error: str, metrics: ServerMetrics) -> None:
        self.seconds, self.ok, self.error = seconds, False, error
        self.num_failed += 1
        metrics.syncs.labels("failed").inc()
        metrics.sync_in_progress.set(0)

    def to_json(self) -> dict[str, object]:
        return {
            "version": self.version,
            "bytes": self.total_bytes,
            "bucket_bytes": self.bucket_bytes,
            "seconds": round(self.seconds, 6),
            "gbps": round(self.gbps, 3),
            "ok": self.ok,
            "error": self.error,
            "num_committed": self.num_committed,
            "num_failed": self.num_failed,
        }


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Served:
    """What a server serves, fixed once its receivers are up (the static half of /weight_info)."""

    engine: str
    """The engine's name in `weightsync serve --engine`."""
    model: str
    transport: str
    addresses: tuple[str, ...]
    """Where a sender pushes: one receiver per worker."""
    weight_bytes: int
    """The bytes of the base weights each worker holds."""
