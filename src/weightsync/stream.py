"""Weights as a stream of (name, tensor) pairs, pulled on the caller's thread: `StreamSink`.

Most engines load weights by iterating pairs (vLLM's `load_weights`, verl's server adapters,
SGLang's bucket callbacks). A `StreamSink` hands each sync to such a loader while it lands, one
bucket at a time, so the whole model is never held at once:

    sink = StreamSink(timeout=60)
    receiver = WeightReceiver(sink, transport="shm").start()
    ...                                                  # a sender pushes version 7
    with sink.stream(version=7) as tensors:              # on the engine's own thread
        for name, tensor in tensors:
            engine.load_weights([(name, tensor)])        # copy what you keep
    # the loop ended without an error: version 7 is committed

Two threads meet here. The receiver's connection thread lands each bucket and calls `load` with
the tensors it completed; `load` hands them over (a queue of one bucket) and waits until the
consumer has moved past the last of them. The consumer's `TensorStream` yields them one by one.

- A tensor is valid until the consumer asks for the next one. It may be a view into the
  transport's buffer, which the receiver reuses as soon as `load` returns. A subclass whose
  traits say `borrows=False` is handed tensors of its own, valid as long as they are kept: its `load`
  returns once the consumer has taken the bucket, and the receiver lands the next meanwhile.
- All or nothing: the iteration ends normally only once the sync committed, which is after the
  consumer took every tensor and the receiver verified the sync (checksums, content digest). A
  sync that fails raises its error from the consumer's `next()`. A loader writes into the weights
  it serves, so the sink's traits say `live_loads`: a sync that fails after any bucket was
  handed over leaves the receiver "dirty" until the next good sync.
- Every wait is bounded by `timeout`: the consumer's wait for a sync to begin and for each next
  bucket (TransferTimeout), and the receiver's wait for the consumer to take a bucket (the sync is
  then aborted).
- A consumer that stops early (breaks out of its loop, closes the stream, raises, or is collected)
  aborts the sync: the receiver's next `load` or `commit` raises SinkError, this receiver aborts,
  and the sender reports it failed. Closing a stream is safe from any thread.
- An offer the receiver refuses before its sync begins (busy with another sync, a plan it
  cannot take) reaches the sink as `refused`: the stream waiting for that version raises the
  refusal at once rather than wait out its timeout.

One receiver per sink, one stream per sync: a stream takes the next sync nobody has taken yet.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType

import torch

from weightsync.errors import ConfigError, PlanError, SinkError, TransferTimeout, WeightSyncError
from weightsync.messages import Plan
from weightsync.options import DEFAULT_TIMEOUT_S, check_timeout
from weightsync.sink import SinkTraits, WeightSink

__all__ = ["StreamSink", "TensorStream"]

NamedTensors = list[tuple[str, torch.Tensor]]


@dataclasses.dataclass(eq=False, slots=True)
class _Sync:
    """One sync as the sink sees it, from `begin` to commit or abort; guarded by the sink's lock."""

    version: int
    batch: NamedTensors | None = None
    """The bucket handed over by `load`, until the consumer moves past its last tensor."""
    claimed: bool = False
    committed: bool = False
    error: BaseException | None = None
    stopped: str = ""
    """Why the consumer left before the end ("" while it has not)."""

    @property
    def finished(self) -> bool:
        return self.committed or self.error is not None


class StreamSink(WeightSink):
    """A sink whose syncs are pulled as (name, tensor) pairs with `stream()`.

    Args:
        timeout: seconds any single wait may last, on either thread (see the module docstring).

    Raises:
        ConfigError: `timeout` is not a positive number.
    """

    traits = SinkTraits(live_loads=True)

    def __init__(self, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        check_timeout(timeout)
        self.timeout = float(timeout)
        self._changed = threading.Condition()
        self._sync: _Sync | None = None
        self._refused: _Sync | None = None
        """The last offer refused before its sync began, as a sync that failed before it began:
        for the stream that waits for its version, until one takes it or the next sync begins."""

    def stream(self, version: int | None = None) -> TensorStream:
        """The tensors of the next sync nobody has taken yet, as they land.

        Args:
            version: the version expected, or None for whichever comes. A sync of another version
                in progress is aborted and the stream raises PlanError; one that already ended
                untaken is skipped. An offer of this version that the receiver refused before
                its sync began raises the refusal.

        Returns:
            A `TensorStream`: an iterator of (name, tensor) pairs in plan order, and a context
            manager that closes it (an early close aborts the sync).
        """
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ConfigError(f"version must be a non-negative integer or None, got {version!r}")
        return TensorStream(self, version)

    # --- the receiver's side (its connection thread) ------------------------------------------

    def begin(self, plan: Plan, version: int) -> None:
        with self._changed:
            self._sync, self._refused = _Sync(version), None
            self._changed.notify_all()

    def refused(self, version: int, error: BaseException) -> None:
        """The stream waiting for `version` (or the next to ask for it) raises `error`."""
        with self._changed:
            self._refused = _Sync(version, error=error)
            self._changed.notify_all()

    def load(self, named_tensors: NamedTensors) -> None:
        with self._changed:
            sync = self._current("load")
            sync.batch = named_tensors
            self._changed.notify_all()
            self._wait_taken(sync, f"a bucket of {len(named_tensors)} tensors")

    def commit(self, version: int) -> None:
        with self._changed:
            sync = self._current("commit")
            if sync.version != version:
                raise SinkError(f"commit of version {version} during the sync of version {sync.version}")
            self._wait_taken(sync, "the last bucket")  # every tensor taken before it commits
            sync.committed = True
            self._changed.notify_all()

    def _wait_taken(self, sync: _Sync, what: str) -> None:
        """Wait (holding the condition) until the consumer is done with the bucket handed over."""
        taken = self._changed.wait_for(lambda: sync.batch is None or bool(sync.stopped), self.timeout)
        if sync.stopped:
            raise SinkError(f"sync of version {sync.version} abandoned: {sync.stopped}")
        if not taken:
            sync.batch = None
            raise TransferTimeout(f"no consumer took {what} within {self.timeout:g} s", version=sync.version)

    def abort(self, version: int, error: BaseException, *, intact: bool) -> None:
        with self._changed:
            sync = self._sync
            if sync is not None and sync.version == version and not sync.finished:
                sync.error = error
                self._changed.notify_all()

    def _current(self, hook: str) -> _Sync:
        sync = self._sync
        if sync is None:
            raise SinkError(f"{hook} without a sync begun")
        if sync.stopped:
            raise SinkError(f"sync of version {sync.version} abandoned: {sync.stopped}")
        return sync

    # --- the consumer's side (TensorStream, on the consumer's thread) -------------------------

    def _claim(self, stream: TensorStream) -> _Sync:
        """Wait for a sync nobody has taken (of the version the stream expects, if any) and take it."""
        ends = time.monotonic() + self.timeout
        while True:
            sync = self._sync
            if stream._closed:
                raise SinkError("the stream was closed")
            if sync is not None and not sync.claimed:
                if stream._version is None or sync.version == stream._version:
                    sync.claimed = True
                    return sync
                if not sync.finished:
                    sync.claimed, sync.stopped = True, f"the consumer expected version {stream._version}"
                    self._changed.notify_all()
                    raise PlanError(f"the sync in progress is version {sync.version}, expected {stream._version}")
            refused = self._refused
            if refused is not None and refused.version == stream._version:
                self._refused, refused.claimed = None, True
                return refused  # ended before it began: the stream raises its error
            left = ends - time.monotonic()
            if left <= 0:
                which = "" if stream._version is None else f" of version {stream._version}"
                raise TransferTimeout(f"no sync{which} began within {self.timeout:g} s")
            self._changed.wait(left)

    def _next_batch(self, stream: TensorStream) -> NamedTensors:
        """Release the bucket `stream` holds and wait for the next; [] once the sync committed."""
        with self._changed:
            sync = stream._sync = stream._sync or self._claim(stream)
            if stream._holding:
                sync.batch = None
                stream._holding = False
                self._changed.notify_all()
            ready: Callable[[], bool] = lambda: (  # noqa: E731
                sync.error is not None or sync.batch is not None or sync.committed or bool(sync.stopped)
            )
            self._changed.wait_for(ready, self.timeout)
            if sync.error is not None:
                raise _reraisable(sync.error, sync.version)
            if sync.stopped:
                raise SinkError(f"sync of version {sync.version} abandoned: {sync.stopped}")
            if sync.batch is not None:
                batch, stream._holding = sync.batch, self.traits.borrows
                if not self.traits.borrows:  # the consumer's own tensors: the receiver may go on now
                    sync.batch = None
                    self._changed.notify_all()
                return batch
            if sync.committed:
                return []
            raise TransferTimeout(f"no bucket arrived within {self.timeout:g} s", version=sync.version)

    def _close(self, stream: TensorStream, reason: str) -> None:
        with self._changed:
            stream._closed = True
            sync = stream._sync
            if sync is not None and not sync.finished and not sync.stopped:
                sync.stopped = reason
            self._changed.notify_all()


class TensorStream:
    """The (name, tensor) pairs of one sync, in plan order, from a `StreamSink`.

    Iterate it on one thread. The first `next()` takes the sync (waiting for it to begin); each
    tensor is valid until the next `next()` (while kept, where the sink does not borrow); the
    iteration ends once the sync committed, or raises the sync's error. `close()` (from any
    thread, or leaving a `with` block) before the end aborts the sync.
    """

    def __init__(self, sink: StreamSink, version: int | None) -> None:
        self._version = version
        self._sync: _Sync | None = None
        self._holding = False
        self._closed = False
        self._sink = sink
        self._batch: NamedTensors = []
        self._index = 0
        self._num_taken = 0
        self._ended = False

    def __iter__(self) -> TensorStream:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        if self._index >= len(self._batch):
            self._batch, self._index = self._next_batch(), 0
        self._index += 1
        self._num_taken += 1
        return self._batch[self._index - 1]

    def batches(self) -> Iterator[NamedTensors]:
        """The same pairs a bucket at a time, for a loader that must act when a bucket ends:
        each list (and its tensors) is valid until the next one is asked for. Iterate the stream
        one way only, pairs or batches."""
        while True:
            try:
                batch = self._next_batch()
            except StopIteration:
                return
            self._batch, self._index = batch, len(batch)
            self._num_taken += len(batch)
            yield batch

    def _next_batch(self) -> NamedTensors:
        """Release the bucket held and take the next; StopIteration once the sync committed."""
        if self._closed:
            raise StopIteration
        try:
            batch = self._sink._next_batch(self)
        except BaseException as exc:  # the receiver learns why the consumer stopped
            self._sink._close(
                self, f"the consumer stopped after {self._num_taken} tensors: {type(exc).__name__}: {exc}"
            )
            raise
        if not batch:
            self._ended = True
            self._closed = True
            raise StopIteration
        return batch

    @property
    def committed_version(self) -> int | None:
        """The version this stream delivered whole, once its iteration ended normally."""
        return self._sync.version if self._ended and self._sync is not None else None

    def close(self) -> None:
        """Stop taking tensors; before the end, this aborts the sync (safe from any thread)."""
        if not self._ended:
            self._sink._close(self, f"the consumer stopped after {self._num_taken} tensors")

    def __enter__(self) -> TensorStream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        # A consumer that breaks out of `for ... in sink.stream()` drops the stream: abort now
        # rather than leave the receiver waiting out its timeout.
        if not self._closed:
            self.close()


def _reraisable(error: BaseException, version: int) -> BaseException:
    """The receiver's error, to raise on the consumer's thread: a copy of the same class (the
    original is raised on the receiver's thread too), else a SinkError naming it."""
    if isinstance(error, WeightSyncError):
        try:
            clone = copy.copy(error)
        except Exception:  # a class whose constructor takes more than the message
            clone = None
        if isinstance(clone, WeightSyncError) and str(clone) == str(error):
            clone.__cause__ = error
            return clone
    failed = SinkError(f"sync of version {version} failed: {type(error).__name__}: {error}")
    failed.__cause__ = error
    return failed
