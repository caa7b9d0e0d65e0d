"""Relay: a sink that forwards every sync it receives to other receivers, as it arrives.

    trainer --tcp/collective (once per host)--> RelaySink --shm (written once, read N times)--> servers

One receiver per host takes the sync from the trainer and pushes it on, with the same version,
names, shapes and dtypes, to the other receivers on its host. Each tensor is forwarded as soon as
it is complete (handed to a `StreamSink` the push pulls from), so the downstream push runs
alongside the upstream one and adds about one tensor of latency, not a whole sync. The trainer's
NIC carries one copy per host instead of one per server.

The relay commits once the downstream push has finished, so when the trainer sees the relay
commit, the servers behind it have committed or failed (`last_report` says which). A failed
upstream sync aborts the downstream one: no server claims a version it does not hold intact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from weightsync.dtypes import dtype_from_name
from weightsync.errors import RemoteError, SinkError, TransferTimeout, WeightSyncError
from weightsync.messages import Plan
from weightsync.options import SenderOptions
from weightsync.report import SyncReport
from weightsync.sender import WeightSender
from weightsync.sink import SinkTraits, WeightSink, as_sink
from weightsync.source import TensorMeta
from weightsync.stream import StreamSink, TensorStream

__all__ = ["RelaySink"]

log = logging.getLogger(__name__)


class _Handover(StreamSink):
    traits = SinkTraits(live_loads=True, borrows=False)  # see RelaySink.traits


@dataclasses.dataclass(frozen=True, slots=True)
class _Forwarded:
    """The downstream push's source: the plan's tensors, pulled from the stream as they complete."""

    specs: list[TensorMeta]
    stream: TensorStream

    def metas(self) -> list[TensorMeta]:
        return self.specs

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return itertools.islice(self.stream, len(self.specs))  # not past the last: that waits for the commit


class RelaySink(WeightSink):
    """Forward every sync to `addresses`, and optionally land it in `sink` too.

    Args:
        addresses: the downstream receivers (e.g. the shm addresses of the other servers on
            this host).
        sink: this host's own sink (a mapping, callable or WeightSink), or None to forward only.
        timeout: seconds any wait may last, upstream-facing and downstream.
        sender: further `WeightSender` options for the downstream push (bucket_bytes, verify...).
            A downstream receiver that does not commit is logged (a warning) and reported in
            `last_report`, never raised: `raise_on_failure` is always False here.
    """

    traits = SinkTraits(borrows=False)
    """The downstream push reads a tensor after `load` returned and after taking later ones: it
    keeps a bucket's tensors until the bucket is sent, a tensor larger than a bucket across the
    buckets it spans, and inproc hands the tensors themselves to its receivers, two buckets
    ahead. So the relay is handed tensors of its own, which nothing reuses (never views of a
    transport's buffer; over inproc, the trainer's, which stay put until this sync commits), and
    the stream only drops its references. `load` returns once the push has taken its bucket."""

    def __init__(
        self,
        addresses: Sequence[str] | str,
        sink: WeightSink | Callable[[list[tuple[str, torch.Tensor]]], None] | Mapping[str, torch.Tensor] | None = None,
        *,
        timeout: float = 60.0,
        sender: SenderOptions | None = None,
    ) -> None:
        self._inner = as_sink(sink) if sink is not None else None
        # a downstream receiver that fails is logged, not raised: this host's own sync goes on;
        # SenderOptions checks the timeout
        options = dataclasses.replace(sender or SenderOptions(), timeout=timeout, raise_on_failure=False)
        self._sender = WeightSender(addresses, options=options)
        self._timeout = float(timeout)
        inner = self._inner.traits if self._inner is not None else None
        self.traits = SinkTraits(
            live_loads=inner is not None and (inner.live_loads or inner.live_destinations), borrows=False
        )
        self._handover = _Handover(timeout=timeout)
        self._thread: threading.Thread | None = None
        self._outcome: list[SyncReport | BaseException] = []
        self.last_report: SyncReport | None = None
        """The downstream push of the last sync that committed here."""

    def begin(self, plan: Plan, version: int) -> None:
        if self._inner is not None:
            self._inner.begin(plan, version)
        metas = [TensorMeta(spec.name, spec.shape, dtype_from_name(spec.dtype)) for spec in plan.tensors]
        self._handover.begin(plan, version)
        self._outcome = []
        args = (_Forwarded(metas, self._handover.stream(version)), version, self._outcome)
        self._thread = threading.Thread(target=self._forward, args=args, daemon=True, name="weightsync-relay")
        self._thread.start()

    def _forward(self, source: _Forwarded, version: int, outcome: list[SyncReport | BaseException]) -> None:
        """The downstream push, on its own thread; then whatever it left untaken (it ended early:
        every receiver failed) is taken and dropped, so that the upstream sync goes on."""
        with source.stream:
            try:
                outcome.append(self._sender.push(source, version))
            except BaseException as exc:  # reported by commit; the thread must not die loudly
                outcome.append(exc)
            with contextlib.suppress(WeightSyncError):  # the upstream sync failed: `abort` says so
                for _ in source.stream:
                    pass

    def destination(self, name: str) -> torch.Tensor | None:
        return None  # every tensor comes to `load` whole, so that it can be forwarded

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        if self._thread is None:
            raise SinkError("the relay was handed tensors outside a sync (load before begin)")
        inner = self._inner
        own = []
        for name, tensor in named_tensors:
            dest = inner.destination(name) if inner is not None else None
            if dest is not None:
                dest.copy_(tensor)
            else:
                own.append((name, tensor))
        if inner is not None and own:
            inner.load(own)
        self._handover.load(named_tensors)  # returns once the push has taken them

    def commit(self, version: int) -> None:
        if self._thread is not None:
            self._handover.commit(version)  # returns once the push has taken every tensor
        report = self._finish()
        if isinstance(report, BaseException):
            raise SinkError(f"the relay's downstream push of version {version} failed: {report}") from report
        if self._inner is not None:
            self._inner.commit(version)
        self.last_report = report
        for outcome in report.failed:
            log.warning(
                "relay: %s did not commit version %d: %s: %s", outcome.address, version, outcome.kind, outcome.error
            )

    def abort(self, version: int, error: BaseException, *, intact: bool) -> None:
        failed = RemoteError(f"the relay's own sync of version {version} failed: {error}")
        self._handover.abort(version, failed, intact=intact)  # raised from the push's next tensor
        self._finish()
        if self._inner is not None:
            self._inner.abort(version, error, intact=intact)

    def refused(self, version: int, error: BaseException) -> None:
        if self._inner is not None:
            self._inner.refused(version, error)

    def _finish(self) -> SyncReport | BaseException:
        """Wait for the downstream push (it ends once the last tensor was sent and committed)."""
        if self._thread is None:
            return SinkError("the relay has no sync to finish (commit or abort before begin)")
        self._thread.join(self._timeout * 3)  # the push's own waits are bounded by the timeout
        if self._thread.is_alive() or not self._outcome:
            return TransferTimeout("the downstream push did not finish in time")
        return self._outcome[0]

    def close(self) -> None:
        """Close the downstream connections."""
        self._sender.close()
