"""What a push reports to its caller: a `SyncReport`, with one `ReceiverOutcome` per receiver."""

from __future__ import annotations

import dataclasses

from weightsync.messages import SyncTimes

__all__ = ["ReceiverOutcome", "SyncReport"]


@dataclasses.dataclass(frozen=True, slots=True)
class ReceiverOutcome:
    """How one receiver fared in a push.

    `kind` is the error's class name (the receiver's own for errors it reported, e.g.
    "PlanError"), and `error` its message; both are empty when the receiver committed.
    """

    address: str
    committed: bool
    kind: str = ""
    error: str = ""
    times: SyncTimes | None = None
    """Where this receiver's sync went (once it committed)."""
    mode: str = "full"
    """"delta" when it was sent only what changed since the version it held, else "full"."""
    wire_bytes: int = 0
    """Payload bytes its plan carried (every tensor's, or the patches')."""
    changed_fraction: float = 1.0
    """The fraction of elements whose wire bits changed since the sender's previous push (1.0
    without a previous push or with `delta` off)."""


@dataclasses.dataclass(frozen=True, slots=True)
class SyncReport:
    """What a push did: how much it moved, how fast, and what each receiver made of it."""

    version: int
    total_bytes: int
    num_tensors: int
    num_buckets: int
    bucket_bytes: int
    seconds: float
    outcomes: tuple[ReceiverOutcome, ...]
    content_digest: str = ""
    """With verify="bucket": what every receiver that committed verified it holds (compare with
    a server's /weight_info `content_digest`); "" otherwise."""
    wire_bytes: int = 0
    """Payload bytes sent, summed over the plans of the push (a full plan and a delta plan when
    both were needed); each receiver's share is in its outcome."""
    changed_fraction: float = 1.0
    """The fraction of elements whose wire bits changed since the previous push (1.0 without a
    previous push, or with `delta` off)."""

    @property
    def gbps(self) -> float:
        """Payload gigabytes (1e9 bytes) per second, end to end."""
        return self.total_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def ok(self) -> bool:
        """True when every receiver committed the version."""
        return all(outcome.committed for outcome in self.outcomes)

    @property
    def failed(self) -> tuple[ReceiverOutcome, ...]:
        return tuple(outcome for outcome in self.outcomes if not outcome.committed)
