"""Where received weights go: the engine's side of a sync.

A `WeightSink` may expose destination tensors by name (`destination`), in which case every chunk
is copied straight into place; otherwise whole tensors are handed to `load` as they complete
(`landing.py` decides which, piece by piece).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch

from weightsync.dtypes import dtype_from_name
from weightsync.errors import ConfigError, PlanError, SinkError, WeightSyncError
from weightsync.plan import tensor_nbytes
from weightsync.types import Plan

__all__ = ["CallableSink", "StagedSink", "TensorDictSink", "WeightSink", "WrappingSink", "as_sink", "sink_errors"]

LoadFn = Callable[[list[tuple[str, torch.Tensor]]], None]


class WeightSink:
    """Base class for what receives weights. Override the hooks your engine needs.

    Order of calls for one sync: `begin` (may reject the plan before any byte moves), then
    `destination` per tensor, then `load` per bucket for tensors without a destination, then
    exactly one of `commit` or `abort`.
    """

    loads_live: bool = False
    """True when `load` writes into the weights being served (an engine's loader), so a sync that
    fails after any `load` leaves them mixed; the receiver then reports itself dirty."""

    destinations_live: bool = True
    """False when `destination` hands out a standby copy (staged mode) that only `commit` makes
    live: then a failed sync leaves the served weights untouched."""

    wrote_live: bool = False
    """Set by a staged sink whose `commit` feeds the served weights (StagedSink), once it has
    started to: a commit that fails after that leaves them mixed, and the receiver says dirty."""

    paused_s: float = 0.0
    """Seconds the engine was parked for the current sync (a rollout server's sink sets it)."""

    borrows: bool = True
    """True when `load` is done with its tensors once it returns (it copies what it keeps): it is
    then handed read-only views of the transport's buffers, with no copy. A sink that holds on to
    them (queues them for another thread) sets False and gets tensors of its own."""

    def begin(self, plan: Plan, version: int) -> None:
        """Check the plan against the engine; raise PlanError to refuse it."""

    def destination(self, name: str) -> torch.Tensor | None:
        """The live tensor `name` should be written into, or None to receive it via `load`."""
        return None

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Take complete tensors. With `borrows` (the default) they are read-only views into
        transfer buffers, valid until this returns: copy what you keep."""
        raise SinkError(f"sink {type(self).__name__} has no destination for {[n for n, _ in named_tensors][:5]}")

    def commit(self, version: int) -> None:
        """Every byte of `version` has arrived; start serving it."""

    def abort(self, version: int, error: BaseException, *, intact: bool) -> None:
        """The sync of `version` failed; `error` says why. `intact`: the weights being served
        are still the previous version, untouched; False when the sync partly overwrote them
        (the receiver now reports itself dirty until the next good sync)."""


class WrappingSink(WeightSink):
    """A sink around another that pauses or reports around it (a rollout server's): it lands
    exactly as `inner` does, so it says what `inner` says about live weights and borrowing.

    Subclasses set `_paused_s` to the seconds the engine was parked for the current sync.
    """

    def __init__(self, inner: WeightSink) -> None:
        self.inner = inner
        self._paused_s = 0.0

    @property
    def loads_live(self) -> bool:  # type: ignore[override]
        return self.inner.loads_live

    @property
    def destinations_live(self) -> bool:  # type: ignore[override]
        return self.inner.destinations_live

    @property
    def wrote_live(self) -> bool:  # type: ignore[override]
        return self.inner.wrote_live

    @property
    def borrows(self) -> bool:  # type: ignore[override]
        return self.inner.borrows

    @property
    def paused_s(self) -> float:  # type: ignore[override]
        return self._paused_s

    @property
    def staged(self) -> bool:
        """True when nothing served changes before the commit (`inner` stages the sync): the
        engine then keeps serving during the transfer and parks only for the commit."""
        return not (self.inner.destinations_live or self.inner.loads_live)

    def destination(self, name: str) -> torch.Tensor | None:
        return self.inner.destination(name)

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.inner.load(named_tensors)


class CallableSink(WeightSink):
    """A sink that hands every completed tensor to a function."""

    def __init__(self, load: LoadFn) -> None:
        self._load = load

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self._load(named_tensors)


class TensorDictSink(WeightSink):
    """A sink that writes into existing tensors, in place, by name.

    Args:
        tensors: destination tensors by name (e.g. `dict(model.named_parameters())`).
        strict: also refuse plans that leave some of `tensors` out.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
        self.tensors = dict(tensors)
        self.strict = strict
        self.version: int | None = None

    def begin(self, plan: Plan, version: int) -> None:
        check_against(plan, self.tensors, strict=self.strict)

    def destination(self, name: str) -> torch.Tensor | None:
        return self.tensors[name].data

    def commit(self, version: int) -> None:
        self.version = version


class StagedSink(WeightSink):
    """Land every sync in a standby copy, and hand it to `inner` only at commit.

    For an engine whose loader cannot swap weights atomically (vLLM's layerwise reload): a sync
    that fails in transfer (a dead sender, a timeout, a bad checksum) never reaches the engine,
    and a rollout server keeps serving during the transfer, pausing only for the local load.
    The standby copy (one more copy of the weights, in host memory) is kept across syncs.

    Args:
        inner: the engine's sink; `begin` must only check the plan (it runs while serving).
        batch_bytes: how much `commit` hands to `inner.load` at a time.
    """

    destinations_live = False
    loads_live = False

    def __init__(self, inner: WeightSink, batch_bytes: int = 64 << 20) -> None:
        self.inner = inner
        self.batch_bytes = batch_bytes
        self._standby: dict[str, torch.Tensor] = {}
        self._plan: Plan | None = None

    def begin(self, plan: Plan, version: int) -> None:
        self.wrote_live = False
        self.inner.begin(plan, version)
        for spec in plan.tensors:
            shape, dtype = spec.shape, dtype_from_name(spec.dtype)
            standby = self._standby.get(spec.name)
            if standby is None or tuple(standby.shape) != shape or standby.dtype != dtype:
                self._standby[spec.name] = torch.empty(shape, dtype=dtype)
        self._plan = plan

    def destination(self, name: str) -> torch.Tensor | None:
        return self._standby[name]

    def commit(self, version: int) -> None:
        if self._plan is None:
            raise SinkError(f"commit of version {version} without a sync begun")
        self.wrote_live = True
        batch: list[tuple[str, torch.Tensor]] = []
        size = 0
        for spec in self._plan.tensors:
            if spec.encoding != "dense" and spec.count == 0:
                continue  # a delta sync left it unchanged: the engine holds it already
            tensor = self._standby[spec.name]
            dest = self.inner.destination(spec.name)
            if dest is not None:
                dest.copy_(tensor)
                continue
            batch.append((spec.name, tensor))
            size += tensor_nbytes(spec)
            if size >= self.batch_bytes:
                self.inner.load(batch)
                batch, size = [], 0
        if batch:
            self.inner.load(batch)
        self.inner.commit(version)

    def abort(self, version: int, error: BaseException, *, intact: bool) -> None:
        self.inner.abort(version, error, intact=intact)


def check_against(plan: Plan, tensors: Mapping[str, torch.Tensor], *, strict: bool) -> None:
    """Raise PlanError naming every tensor of `plan` that `tensors` lacks or disagrees with."""
    problems = []
    for spec in plan.tensors:
        target = tensors.get(spec.name)
        if target is None:
            problems.append(f"unknown tensor {spec.name!r}")
        elif tuple(target.shape) != spec.shape or target.dtype != dtype_from_name(spec.dtype):
            problems.append(
                f"{spec.name!r}: sent {spec.dtype}{list(spec.shape)}, expected {str(target.dtype).removeprefix('torch.')}{list(target.shape)}"
            )
    if strict:
        missing = set(tensors) - {spec.name for spec in plan.tensors}
        problems += [f"plan lacks {name!r}" for name in sorted(missing)]
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise PlanError("plan does not match the receiver's tensors: " + "; ".join(problems[:8]) + more)


def as_sink(sink: WeightSink | LoadFn | Mapping[str, torch.Tensor]) -> WeightSink:
    """Accept a WeightSink; wrap a mapping of destination tensors or a load function."""
    if isinstance(sink, WeightSink):
        return sink
    if isinstance(sink, Mapping):
        return TensorDictSink(sink)
    if callable(sink):
        return CallableSink(sink)
    raise ConfigError(f"a sink must be a WeightSink, a mapping of tensors or a callable, got {type(sink).__name__}")


@contextmanager
def sink_errors(hook: str) -> Iterator[None]:
    """Report an exception from a sink hook as a SinkError naming the hook (weightsync's own
    errors pass through), so a buggy sink fails the sync cleanly instead of the thread."""
    try:
        yield
    except WeightSyncError:
        raise
    except Exception as exc:
        raise SinkError(f"sink.{hook} raised {type(exc).__name__}: {exc}") from exc
