"""Relay: a sink that forwards every sync it receives to other receivers, as it arrives.

    trainer --tcp/collective (once per host)--> RelaySink --shm (written once, read N times)--> servers

One receiver per host takes the sync from the trainer and pushes it on, with the same version,
names, shapes and dtypes, to the other receivers on its host. Each tensor is forwarded as soon as
it is complete, so the downstream push runs alongside the upstream one and adds about one tensor
of latency, not a whole sync. The trainer's NIC carries one copy per host instead of one per
server.

The relay commits once the downstream push has finished, so when the trainer sees the relay
commit, the servers behind it have committed or failed (`last_report` says which). A failed
upstream sync aborts the downstream one: no server claims a version it does not hold intact.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from weightsync.dtypes import dtype_from_name
from weightsync.errors import ConfigError, RemoteError, SinkError, TransferTimeout
from weightsync.messages import Plan
from weightsync.options import SenderOptions
from weightsync.report import SyncReport
from weightsync.sender import WeightSender
from weightsync.sink import SinkTraits, WeightSink, as_sink
from weightsync.source import TensorMeta

__all__ = ["RelaySink"]

log = logging.getLogger(__name__)

QUEUED_TENSORS = 8
"""Completed tensors waiting for the downstream push at most: bounds the relay's memory."""


class _Stream:
    """The downstream push's source: the tensors the relay completes, in plan order."""

    def __init__(self, metas: list[TensorMeta], timeout: float) -> None:
        self._metas = metas
        self._timeout = timeout
        self._queue: queue.Queue[tuple[str, torch.Tensor] | BaseException] = queue.Queue(QUEUED_TENSORS)
        self.done = threading.Event()
        """Set once the downstream push has ended: nothing will consume what is put any more."""

    def metas(self) -> list[TensorMeta]:
        return self._metas

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for _ in self._metas:
            try:
                item = self._queue.get(timeout=self._timeout)
            except queue.Empty:
                raise TransferTimeout(f"the relay received no tensor within {self._timeout} s") from None
            if isinstance(item, BaseException):
                raise item
            yield item

    def put(self, item: tuple[str, torch.Tensor] | BaseException) -> None:
        """Queue `item` for the push, waiting while the queue is full; dropped once it has ended."""
        deadline = time.monotonic() + self._timeout
        while not self.done.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return
            except queue.Full:
                if time.monotonic() > deadline:
                    raise TransferTimeout(f"the downstream push took no tensor within {self._timeout} s") from None


class RelaySink(WeightSink):
    """Forward every sync to `addresses`, and optionally land it in `sink` too.

    Args:
        addresses: the downstream receivers (e.g. the shm addresses of the other servers on
            this host).
        sink: this host's own sink (a mapping, callable or WeightSink), or None to forward only.
        timeout: seconds any wait may last, upstream-facing and downstream.
        sender: further `WeightSender` options for the downstream push (bucket_bytes, verify...).
    """

    traits = SinkTraits(borrows=False)
    """The downstream push sends a tensor after `load` returned: it must be the relay's own."""

    def __init__(
        self,
        addresses: Sequence[str] | str,
        sink: WeightSink | Callable[[list[tuple[str, torch.Tensor]]], None] | Mapping[str, torch.Tensor] | None = None,
        *,
        timeout: float = 60.0,
        sender: SenderOptions | None = None,
    ) -> None:
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self._inner = as_sink(sink) if sink is not None else None
        options = dataclasses.replace(sender or SenderOptions(), timeout=timeout)
        self._sender = WeightSender(addresses, options=options)
        self._timeout = float(timeout)
        inner = self._inner.traits if self._inner is not None else None
        self.traits = SinkTraits(
            live_loads=inner is not None and (inner.live_loads or inner.live_destinations), borrows=False
        )
        self._stream: _Stream | None = None
        self._thread: threading.Thread | None = None
        self._outcome: list[SyncReport | BaseException] = []
        self.last_report: SyncReport | None = None
        """The downstream push of the last sync that committed here."""

    def begin(self, plan: Plan, version: int) -> None:
        if self._inner is not None:
            self._inner.begin(plan, version)
        metas = [TensorMeta(spec.name, spec.shape, dtype_from_name(spec.dtype)) for spec in plan.tensors]
        stream = self._stream = _Stream(metas, self._timeout)
        outcome: list[SyncReport | BaseException] = []
        self._outcome = outcome

        def forward() -> None:
            try:
                outcome.append(self._sender.push(stream, version))
            except BaseException as exc:  # reported by commit; the thread must not die loudly
                outcome.append(exc)
            finally:
                stream.done.set()

        self._thread = threading.Thread(target=forward, daemon=True, name="weightsync-relay")
        self._thread.start()

    def destination(self, name: str) -> torch.Tensor | None:
        return None  # every tensor comes to `load` whole, so that it can be forwarded

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        if self._stream is None:
            raise SinkError("the relay was handed tensors outside a sync (load before begin)")
        inner = self._inner
        own = []
        for name, tensor in named_tensors:
            if inner is not None:
                dest = inner.destination(name)
                if dest is not None:
                    dest.copy_(tensor)
                else:
                    own.append((name, tensor))
            # A tensor handed to `load` is the relay's own (staged by the landing), or the
            # trainer's (inproc), which stays put until this sync commits: safe to queue as is.
            self._stream.put((name, tensor))
        if inner is not None and own:
            inner.load(own)

    def commit(self, version: int) -> None:
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
        if self._stream is not None:
            self._stream.put(RemoteError(f"the relay's own sync of version {version} failed: {error}"))
        self._finish()
        if self._inner is not None:
            self._inner.abort(version, error, intact=intact)

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
