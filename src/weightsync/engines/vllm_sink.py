"""The weight sink of the vLLM engine: syncs land through vLLM's own layerwise reload.

vLLM does not keep weights in checkpoint layout: q/k/v become one `qkv_proj`, gate/up one
`gate_up_proj`, and the CPU backend repacks every linear layer after loading (the live
`qkv_proj.weight` is an empty tensor). So nothing is written in place. Instead each completed
bucket is handed, in Hugging Face checkpoint names and layouts, to the worker's
`reload_weights(weights_iterator=..., is_checkpoint_format=True)`, which runs on a loader thread
and pulls tensors from a bounded queue::

    begin   check names, shapes and dtypes against the checkpoint the model expects (PlanError);
            nothing reaches vLLM, the previous weights keep serving
    load    (first call) start the loader thread; put the bucket's tensors on the queue
    commit  end the iterator, join the loader (bounded), re-derive what vLLM caches from weights
    abort   end the iterator; vLLM puts back the layers it had not started, the others are new:
            the engine reports its weights dirty until the next good sync

The layerwise loader buffers a layer's tensors until the layer is complete, so `load` must be
given tensors it may keep until the sync ends: the receiver hands over staged tensors it no
longer touches.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Final

import torch

from weightsync.errors import SinkError
from weightsync.integrations.vllm.layout import CheckpointLayout, check_plan_layout
from weightsync.sink import WeightSink
from weightsync.types import Plan

__all__ = ["ReloadSink"]

log = logging.getLogger(__name__)

QUEUE_BUCKETS = 2
"""Buckets that may wait for the loader: bounds the memory a slow loader can pile up."""


class _End(enum.Enum):
    """The queue's end-of-sync marker (its own type, so the queue's items stay typed)."""

    END = enum.auto()


_END: Final = _End.END
_Batch = list[tuple[str, torch.Tensor]]


class ReloadSink(WeightSink):
    """Feeds a sync to vLLM's layerwise reload from a loader thread.

    Args:
        layout: what a sync must carry (names, shapes, dtypes, ties).
        reload: runs vLLM's reload over an iterator of (name, tensor); returns when it ends.
        on_commit: called after a committed reload (re-derive caches, clear the prefix cache).
        set_dirty: told True when live weights start changing, False once a sync commits.
        timeout: seconds `load` waits for queue room and `commit`/`abort` wait for the loader.
    """

    borrows = False
    """The loader thread reads a bucket's tensors after `load` returned: they must be its own."""

    loads_live = True
    """`load` feeds the served model: a sync that fails after one leaves it mixed, and the
    receiver reports itself dirty (what the rollout servers' /health reads)."""

    def __init__(
        self,
        layout: CheckpointLayout,
        reload: Callable[[Iterator[tuple[str, torch.Tensor]]], None],
        on_commit: Callable[[], None],
        set_dirty: Callable[[bool], None],
        timeout: float = 300.0,
    ) -> None:
        self.layout = layout
        self.timeout = timeout
        self.version: int | None = None
        self._reload = reload
        self._on_commit = on_commit
        self._set_dirty = set_dirty
        self._feed: dict[str, str | None] = {}
        self._queue: queue.Queue[_Batch | _End] = queue.Queue(QUEUE_BUCKETS)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def loading(self) -> bool:
        """True from the first `load` of a sync until it commits or aborts."""
        return self._thread is not None

    def begin(self, plan: Plan, version: int) -> None:
        # Only checks: the server pauses its loop after this returns, so vLLM is not touched yet.
        self._feed = check_plan_layout(plan, self.layout)

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        if self._thread is None:
            self._start()
        batch = [(fed, tensor) for name, tensor in named_tensors if (fed := self._feed[name]) is not None]
        self._put(batch)

    def commit(self, version: int) -> None:
        if self._thread is None:
            self._start()  # a plan of only empty tensors: still run one (empty) reload
        self._finish()
        if self._error is not None:
            raise SinkError(f"vLLM failed to load version {version}: {self._error}") from self._error
        self._on_commit()
        self.version = version
        self._set_dirty(False)

    def abort(self, version: int, error: BaseException, *, intact: bool) -> None:
        if self._thread is not None:
            # End the iterator cleanly rather than raising into vLLM: its finalize step then puts
            # back every layer that got nothing, and leaves the model whole for the next sync.
            self._finish()

    # --- the loader thread ----------------------------------------------------------------------

    def _start(self) -> None:
        self._error = None
        self._queue = queue.Queue(QUEUE_BUCKETS)
        self._set_dirty(True)
        self._thread = threading.Thread(target=self._run, name="weightsync-vllm-reload", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._reload(self._tensors())
        except BaseException as exc:  # reported by commit as a SinkError
            log.exception("vLLM weight reload failed")
            self._error = exc
            self._drain()

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            batch = self._queue.get()
            if batch is _END:
                return
            yield from batch

    def _put(self, item: _Batch) -> None:
        thread = self._thread
        for _ in range(max(1, int(self.timeout / 0.1))):
            if self._error is not None or thread is None or not thread.is_alive():
                raise SinkError(f"the vLLM loader stopped: {self._error}") from self._error
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue
        raise SinkError(f"the vLLM loader took no tensors for {self.timeout} s")

    def _finish(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        deadline = time.monotonic() + self.timeout
        while thread.is_alive() and time.monotonic() < deadline:
            try:
                self._queue.put(_END, timeout=0.1)
                break
            except queue.Full:
                continue
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            self._error = self._error or TimeoutError(f"the vLLM loader did not finish within {self.timeout} s")

    def _drain(self) -> None:
        """After a loader failure, take what the receiver still puts so it never blocks."""
        while True:
            try:
                if self._queue.get(timeout=self.timeout) is _END:
                    return
            except queue.Empty:
                return
