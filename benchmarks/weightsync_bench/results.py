"""What a run measured, per method and receiver count, as JSON and as a plain-text table."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from weightsync.pack import STREAMING_COPY
from weightsync_bench.config import GIB, MIB
from weightsync_bench.measure import environment

__all__ = ["BenchReport", "MethodResult", "format_table"]


@dataclasses.dataclass(slots=True)
class MethodResult:
    """One method (weightsync over a transport, or a baseline) at one receiver count."""

    method: str
    transport: str | None
    receivers: int
    total_bytes: int
    bucket_bytes: int | None = None
    seconds_per_sync: list[float] = dataclasses.field(default_factory=list)
    sender_rss_growth: list[int] = dataclasses.field(default_factory=list)
    receiver_rss_growth: list[int] = dataclasses.field(default_factory=list)
    """The largest growth among the receivers, per sync."""
    verified_syncs: list[bool] = dataclasses.field(default_factory=list)
    sink: str = "-"
    """weightsync's receivers: "dict" (destinations written in place) or "callable" (a loader)."""

    @property
    def gbps(self) -> float:
        """Median over the syncs, in 1e9 bytes per second."""
        return self.total_bytes / statistics.median(self.seconds_per_sync) / 1e9

    @property
    def first_sync_gbps(self) -> float:
        return self.total_bytes / self.seconds_per_sync[0] / 1e9

    @property
    def best_gbps(self) -> float:
        return self.total_bytes / min(self.seconds_per_sync) / 1e9

    @property
    def verified(self) -> bool:
        return bool(self.verified_syncs) and all(self.verified_syncs)

    def to_json(self, memcpy_gbps: float) -> dict[str, Any]:
        return {
            "method": self.method,
            "transport": self.transport,
            "receivers": self.receivers,
            "sink": self.sink,
            "gbps": round(self.gbps, 3),
            "ratio_to_memcpy": round(self.gbps / memcpy_gbps, 3),
            "bucket_bytes": self.bucket_bytes,
            "sender_peak_rss_growth_bytes": max(self.sender_rss_growth),
            "receiver_peak_rss_growth_bytes": max(self.receiver_rss_growth),
            "verified": self.verified,
            "total_bytes": self.total_bytes,
            "seconds_per_sync": [round(s, 4) for s in self.seconds_per_sync],
            "first_sync_gbps": round(self.first_sync_gbps, 3),
            "best_gbps": round(self.best_gbps, 3),
        }


@dataclasses.dataclass(slots=True)
class BenchReport:
    """Everything one run measured."""

    memcpy_gbps: float
    total_bytes: int
    num_tensors: int
    largest_tensor_bytes: int
    results: list[MethodResult]
    device: str = "cpu"
    h2d_gbps: float | None = None
    """device cuda: one pinned host-to-device copy of the memcpy buffer's size, best of 3, GB/s."""
    loader_copy_gbps: float | None = None
    """With a callable sink: a loader's own copy (`torch.Tensor.copy_` in 64 MiB tensors), GB/s."""

    def to_json(self) -> dict[str, Any]:
        return {
            "memcpy_gbps": round(self.memcpy_gbps, 3),
            "device": self.device,
            "h2d_gbps": None if self.h2d_gbps is None else round(self.h2d_gbps, 3),
            "loader_copy_gbps": None if self.loader_copy_gbps is None else round(self.loader_copy_gbps, 3),
            "results": [result.to_json(self.memcpy_gbps) for result in self.results],
            "total_bytes": self.total_bytes,
            "num_tensors": self.num_tensors,
            "largest_tensor_bytes": self.largest_tensor_bytes,
            "environment": environment(),
        }


_COLUMNS = (
    ("method", "<"),
    ("transport", "<"),
    ("receivers", ">"),
    ("sink", "<"),
    ("GB/s", ">"),
    ("x memcpy", ">"),
    ("first GB/s", ">"),
    ("bucket MiB", ">"),
    ("sender RSS+ MiB", ">"),
    ("receiver RSS+ MiB", ">"),
    ("verified", "<"),
    ("s/sync", "<"),
)


def _row(result: MethodResult, memcpy: float) -> list[str]:
    return [
        result.method,
        result.transport or "-",
        str(result.receivers),
        result.sink,
        f"{result.gbps:.2f}",
        f"{result.gbps / memcpy:.2f}",
        f"{result.first_sync_gbps:.2f}",
        f"{result.bucket_bytes / MIB:g}" if result.bucket_bytes else "-",
        f"{max(result.sender_rss_growth) / MIB:.0f}",
        f"{max(result.receiver_rss_growth) / MIB:.0f}",
        "yes" if result.verified else "NO",
        " ".join(f"{s:.3f}" for s in result.seconds_per_sync),
    ]


def format_table(report: BenchReport) -> str:
    """The results as a plain-text table, with a header line naming the model and the memcpy."""
    rows = [[name for name, _ in _COLUMNS]] + [_row(result, report.memcpy_gbps) for result in report.results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = [
        "  ".join(f"{cell:{align}{width}}" for cell, (_, align), width in zip(row, _COLUMNS, widths, strict=True))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    header = (
        f"model: {report.total_bytes / GIB:.2f} GiB bf16, {report.num_tensors} tensors, "
        f"largest {report.largest_tensor_bytes / MIB:.0f} MiB; "
        f"memcpy (numpy.copyto, 1 thread, pre-faulted): {report.memcpy_gbps:.2f} GB/s; "
        f"weightsync copies with {'native streaming stores' if STREAMING_COPY else 'numpy.copyto'}; "
        f"GB/s = median over syncs, 1e9 bytes of payload per second end to end"
    )
    if report.loader_copy_gbps is not None:
        header += (
            f"\na loader's own copy (torch copy_, 64 MiB tensors, default threads): "
            f"{report.loader_copy_gbps:.2f} GB/s = {report.loader_copy_gbps / report.memcpy_gbps:.2f}x memcpy, "
            f"the ceiling of a callable sink"
        )
    if report.device != "cpu":
        header += (
            f"\nsource and destinations on {report.device}; "
            f"pinned host-to-device copy (torch, one buffer of the memcpy's size): {report.h2d_gbps:.2f} GB/s"
        )
    return "\n".join([header, "", *(line.rstrip() for line in lines)])
