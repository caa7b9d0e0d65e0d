"""What a push reports to its caller: a `SyncReport`, with one `ReceiverOutcome` per receiver."""

from __future__ import annotations

import dataclasses

from weightsync.errors import RemoteError, WeightSyncError, one_line
from weightsync.messages import SyncTimes

__all__ = ["ReceiverOutcome", "SyncReport", "moved"]

REFUSALS = frozenset({"AuthError", "NegotiationError", "PlanError"})
"""The error kinds of a receiver that refused a push (its terms, its plan, its token) rather than
failing while it moved."""


def moved(num_bytes: int, seconds: float, unit: str = "bytes") -> str:
    """What a sync moved, for people: bytes (`unit` names them) and milliseconds, then GB/s where
    it is a rate worth reading (a latency-bound sync of a small model would read "0.00 GB/s")."""
    text = f"{num_bytes} {unit} in {seconds * 1e3:.1f} ms"
    gbps = num_bytes / seconds / 1e9 if seconds > 0 else 0.0
    return f"{text} ({gbps:.2f} GB/s)" if round(gbps, 2) > 0 else text


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

    @classmethod
    def failed_with(
        cls,
        address: str,
        error: WeightSyncError,
        mode: str = "full",
        wire_bytes: int = 0,
        changed_fraction: float = 1.0,
    ) -> ReceiverOutcome:
        """A receiver that did not commit because of `error` (the receiver's own error kind,
        where it reported one)."""
        kind = error.kind if isinstance(error, RemoteError) and error.kind else type(error).__name__
        return cls(address, False, kind, str(error), None, mode, wire_bytes, changed_fraction)

    @property
    def refused(self) -> bool:
        """True when the receiver refused the push (`REFUSALS`): nothing of it was served."""
        return not self.committed and self.kind in REFUSALS

    def cause(self) -> str:
        """Why it did not commit, on one line: address, error kind and message ("" if it committed)."""
        return f"{self.address}: {self.kind}: {one_line(self.error)}" if not self.committed else ""


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
    whole_tensors: tuple[str, ...] = ()
    """Sharded sync: the tensors sent whole to a receiver that keeps boxes of the others (its
    engine's loaders could not be traced for these; docs/architecture.md)."""

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

    def summary(self) -> str:
        """The push on one line: where it committed, how (full or delta) and the bytes on the wire,
        else who refused or failed it and why (the first cause; a refusal's message names its fix). A push that committed nowhere
        moved nothing anyone serves, so it reports no bytes or GB/s."""
        committed = len(self.outcomes) - len(self.failed)
        if not committed:
            verb = "refused by" if all(outcome.refused for outcome in self.outcomes) else "failed on"
            return f"version {self.version} {verb} every receiver ({len(self.outcomes)}): {self._causes()}"
        wire = self.wire_bytes or self.total_bytes
        pushed = "" if wire == self.total_bytes else f" (of {self.total_bytes} pushed)"
        done = (
            f"version {self.version} committed on {committed} of {len(self.outcomes)} receivers ({self.modes()}): "
            f"{self.num_tensors} tensors, {moved(wire, self.seconds, 'bytes on the wire')}{pushed}"
        )
        return done if self.ok else f"{done}; {len(self.failed)} did not: {self._causes()}"

    def modes(self) -> str:
        """How the receivers that committed were sent the version: "full", "delta" (only what
        changed), or both with their counts ("delta 1, full 1")."""
        counts: dict[str, int] = {}
        for outcome in self.outcomes:
            if outcome.committed:
                counts[outcome.mode] = counts.get(outcome.mode, 0) + 1
        if len(counts) == 1:
            return next(iter(counts))
        return ", ".join(f"{mode} {count}" for mode, count in sorted(counts.items()))

    def failure(self) -> str:
        """Why the push did not commit everywhere, on one line: the receivers that did not, and
        the first cause (the message of `SyncFailed`); "" when every receiver committed."""
        if self.ok:
            return ""
        return f"version {self.version} did not commit on {len(self.failed)} of {len(self.outcomes)} receivers: " + (
            self._causes()
        )

    def _causes(self) -> str:
        """The receivers that did not commit and the first one's cause."""
        first, *others = self.failed
        if not others:
            return first.cause()
        return f"{', '.join(o.address for o in self.failed)}; the first: {first.kind}: {one_line(first.error)}"
