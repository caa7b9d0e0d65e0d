"""What one benchmark run measures: the transports, sizes and counts, checked at construction."""

from __future__ import annotations

import dataclasses

import torch

from weightsync.errors import ConfigError
from weightsync.transports import get_transport, serving_transports

__all__ = ["BASELINES", "DEFAULT_TRANSPORTS", "DTYPE", "GIB", "MIB", "SINKS", "TRANSPORTS", "BenchConfig"]

MIB = 1 << 20
GIB = 1 << 30
TRANSPORTS = tuple(serving_transports())
"""Transports the benchmark can run: the cross-process ones (inproc never leaves the process);
those that need CUDA (cudaipc) only with device cuda."""
DEFAULT_TRANSPORTS = ("shm", "tcp")
"""What `--transport all` runs on the CPU; with device cuda, cudaipc too."""
BASELINES = ("torch_save", "safetensors", "mp_queue_pickle", "mp_queue_shared")
"""Run in this order: `mp_queue_shared` moves the source tensors into shared memory, so it goes last."""
DTYPE = torch.bfloat16
SINKS = ("dict", "callable")
"""The receivers' sinks a run can measure: destination tensors, or an engine-style loader."""


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class BenchConfig:
    """What one benchmark run measures."""

    transports: tuple[str, ...] = DEFAULT_TRANSPORTS
    """Transports to push through ("shm", "tcp", "collective", "cudaipc")."""
    size_bytes: int = 4 * GIB
    """Target size of the synthetic state dict (the actual size is within a layer of it)."""
    bucket_bytes: int | None = None
    """Bucket size to propose; None lets the sender choose ("auto")."""
    receivers: tuple[int, ...] = (1,)
    """Receiver counts to run each transport with (e.g. (1, 4) for the fan-out comparison)."""
    repeat: int = 3
    """Syncs per configuration; the first pays for connecting and mapping, later ones reuse."""
    baselines: bool = True
    """Also run `BASELINES` (one receiver)."""
    memcpy_bytes: int = GIB
    """Buffer size for the single-thread memcpy reference."""
    num_slots: int = 2
    """Shared-memory ring slots on the sender."""
    verify: str = "off"
    """With "bucket", every bucket is checksummed (the sender hashes, each receiver checks)."""
    seed: int = 0
    timeout: float = 120.0
    """Seconds any one step (a sync, a receiver's reply) may take."""
    progress: bool = False
    """Show a progress bar on stderr."""
    device: str = "cpu"
    """Where the trainer's tensors and every receiver's destinations live: "cpu" or "cuda"."""
    sinks: tuple[str, ...] = ("dict",)
    """How receivers take the weights: "dict" (destination tensors, written in place) and/or
    "callable" (a loader: each tensor handed over and copied into a preallocated destination)."""

    def __post_init__(self) -> None:
        if not self.sinks or set(self.sinks) - set(SINKS):
            raise ConfigError(f"sinks must be some of {', '.join(SINKS)}, got {self.sinks}")
        unknown = set(self.transports) - set(TRANSPORTS)
        if unknown:
            raise ConfigError(f"unknown transport(s) {sorted(unknown)}; the benchmark runs {list(TRANSPORTS)}")
        if self.size_bytes < MIB:
            raise ConfigError(f"size_bytes must be at least 1 MiB, got {self.size_bytes}")
        if not self.receivers or min(self.receivers) < 1:
            raise ConfigError(f"receivers must be positive counts, got {self.receivers}")
        if self.repeat < 1 or self.memcpy_bytes < MIB or self.timeout <= 0:
            raise ConfigError("repeat must be >= 1, memcpy_bytes >= 1 MiB and timeout > 0")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device cuda: torch sees no CUDA device here")
        on_gpu = [name for name in self.transports if name in TRANSPORTS and get_transport(name).needs_cuda]
        if on_gpu and self.device != "cuda":
            raise ConfigError(f"the {on_gpu[0]} transport moves GPU tensors: run it with device cuda")
        if self.device == "cuda" and self.baselines:
            raise ConfigError("the baselines run on cpu only: with device cuda, turn them off (--no-baselines)")
        if self.bucket_bytes is not None and self.bucket_bytes < 64:
            raise ConfigError(f"bucket_bytes must be >= 64, got {self.bucket_bytes}")
