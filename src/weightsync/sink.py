"""Where received weights go: the engine's side of a sync.

A `WeightSink` may expose destination tensors by name (`destination`), in which case every chunk
is copied straight into place; otherwise whole tensors are handed to `load` as they complete
(`landing.py` decides which, once per tensor when the sync begins).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

from weightsync.dtypes import dtype_from_name
from weightsync.errors import ConfigError, PlanError, SinkError, WeightSyncError
from weightsync.messages import Adapter, Plan, Want
from weightsync.plan import tensor_nbytes
from weightsync.regions import region_view, whole_shape

__all__ = [
    "CallableSink",
    "SinkTraits",
    "StagedSink",
    "TensorDictSink",
    "WeightSink",
    "WrappingSink",
    "as_sink",
    "sink_errors",
]

LoadFn = Callable[[list[tuple[str, torch.Tensor]]], None]


@dataclasses.dataclass(frozen=True, slots=True)
class SinkTraits:
    """How a sink lands a sync, declared once: what the receiver may hand it, and what a sync
    that fails part way leaves of the weights being served (the receiver's "dirty")."""

    live_destinations: bool = True
    """`destination` hands out the tensors being served: a failed sync that wrote into any of
    them leaves them mixed. False: a standby copy that only `commit` makes live."""
    live_loads: bool = False
    """`load` writes into the weights being served (an engine's loader): a sync that fails after
    any `load` leaves them mixed."""
    borrows: bool = True
    """`load` is done with its tensors once it returns (it copies what it keeps): it is handed
    read-only views of the transport's buffers, with no copy. False: it holds on to them (queues
    them for another thread) and gets tensors of its own."""

    @property
    def staged(self) -> bool:
        """Nothing served changes before the commit: an engine may keep serving during the
        transfer and park only for the commit."""
        return not (self.live_destinations or self.live_loads)


class WeightSink:
    """Base class for what receives weights. Override the hooks your engine needs.

    Order of calls for one sync: `begin` (may reject the plan before any byte moves), then
    `destination` per tensor, then `load` per bucket for tensors without a destination, then
    exactly one of `commit` or `abort`. An offer refused before its sync began (by `begin`, or
    by the receiver: busy, a plan it cannot take) gets `refused` instead, and nothing after.
    """

    traits = SinkTraits()
    """How this sink lands a sync (a class declares it, or an instance sets its own)."""

    paused_s: float = 0.0
    """Seconds the engine was parked for the current sync (a rollout server's sink sets it)."""

    def wrote_live(self) -> bool:
        """Whether this sync's `commit` has started to feed the served weights (a staged sink):
        a commit that fails after that leaves them mixed, and the receiver says dirty."""
        return False

    def begin(self, plan: Plan, version: int) -> None:
        """Check the plan against the engine; raise PlanError to refuse it."""

    def destination(self, name: str) -> torch.Tensor | None:
        """The live tensor `name` should be written into, or None to receive it via `load`. For
        a tensor the sink keeps a box of (`wants`), the whole tensor (its box is written) or a
        tensor of the box's shape."""
        return None

    def wants(self) -> tuple[Want, ...]:
        """The box of each tensor this sink keeps, where it keeps less than whole tensors (an
        engine's tensor-parallel worker): each sync then carries only those boxes (a `TensorSpec`
        with a `region`), and `load` gets tensors of the box's shape. A tensor it does not name
        comes whole; () (the default): every tensor whole."""
        return ()

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Take complete tensors. With `traits.borrows` (the default) they are read-only views into
        transfer buffers, valid until this returns: copy what you keep."""
        raise SinkError(f"sink {type(self).__name__} has no destination for {[n for n, _ in named_tensors][:5]}")

    def commit(self, version: int) -> None:
        """Every byte of `version` has arrived; start serving it."""

    def abort(self, version: int, error: BaseException, *, intact: bool) -> None:
        """The sync of `version` failed; `error` says why. `intact`: the weights being served
        are still the previous version, untouched; False when the sync partly overwrote them
        (the receiver now reports itself dirty until the next good sync)."""

    def refused(self, version: int, error: BaseException) -> None:
        """The receiver refused an offer of `version` before its sync began (`error` says why);
        the weights being served are untouched. For a sink whose consumer may be waiting for that
        version (`StreamSink`): it need not wait out its timeout."""

    def adapter_sink(self, adapter: Adapter) -> WeightSink:
        """The sink a sync of LoRA adapter `adapter` lands in (lora.AdapterSink), for an engine
        that serves adapters; PlanError to refuse it."""
        raise PlanError(f"this receiver serves no LoRA adapters; adapter {adapter.name!r} refused")


class WrappingSink(WeightSink):
    """A sink around another that pauses or reports around it (a rollout server's): it lands
    exactly as `inner` does, so its traits are `inner`'s.

    Subclasses set `paused_s` to the seconds the engine was parked for the current sync.
    """

    def __init__(self, inner: WeightSink) -> None:
        self.inner = inner
        self.traits = inner.traits

    def wrote_live(self) -> bool:
        return self.inner.wrote_live()

    def destination(self, name: str) -> torch.Tensor | None:
        return self.inner.destination(name)

    def wants(self) -> tuple[Want, ...]:
        return self.inner.wants()

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.inner.load(named_tensors)

    def refused(self, version: int, error: BaseException) -> None:
        self.inner.refused(version, error)

    def adapter_sink(self, adapter: Adapter) -> WeightSink:
        return self.inner.adapter_sink(adapter)


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
        whole: hand `inner` every tensor at each commit, those a patch left unchanged too (an
            engine that reloads whole layers: vLLM's layerwise reload would process a layer fed
            only some of its tensors with the rest unset). False: only what changed.
    """

    traits = SinkTraits(live_destinations=False)

    def __init__(self, inner: WeightSink, batch_bytes: int = 64 << 20, *, whole: bool = False) -> None:
        self.inner = inner
        self.whole = whole
        self._wrote_live = False
        self.batch_bytes = batch_bytes
        self._standby: dict[str, torch.Tensor] = {}
        self._plan: Plan | None = None

    def wrote_live(self) -> bool:
        return self._wrote_live

    def begin(self, plan: Plan, version: int) -> None:
        self._wrote_live = False
        self.inner.begin(plan, version)
        for spec in plan.tensors:
            shape, dtype = spec.shape, dtype_from_name(spec.dtype)
            standby = self._standby.get(spec.name)
            if standby is None or tuple(standby.shape) != shape or standby.dtype != dtype:
                self._standby[spec.name] = torch.empty(shape, dtype=dtype)
        self._plan = plan

    def destination(self, name: str) -> torch.Tensor | None:
        return self._standby[name]

    def wants(self) -> tuple[Want, ...]:
        return self.inner.wants()

    def commit(self, version: int) -> None:
        if self._plan is None:
            raise SinkError(f"commit of version {version} without a sync begun")
        self._wrote_live = True
        batch: list[tuple[str, torch.Tensor]] = []
        size = 0
        for spec in self._plan.tensors:
            if spec.encoding != "dense" and spec.count == 0 and not self.whole:
                continue  # a delta sync left it unchanged: the engine holds it already
            tensor = self._standby[spec.name]
            dest = self.inner.destination(spec.name)
            if dest is not None:
                whole = tuple(dest.shape) == whole_shape(spec)
                (region_view(dest, spec) if whole else dest).copy_(tensor)
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

    def refused(self, version: int, error: BaseException) -> None:
        self.inner.refused(version, error)


def check_against(
    plan: Plan, tensors: Mapping[str, torch.Tensor], *, strict: bool, groups: Sequence[Sequence[str]] = ()
) -> None:
    """Raise PlanError (`mismatch`) naming every tensor of `plan` that `tensors` lacks or
    disagrees with. `strict`: the plan must carry every tensor of `tensors`; `groups`: at least
    one name of each group (names that share one tensor, such as tied embeddings)."""
    problems: list[str] = []
    kinds: set[tuple[str, str] | None] = set()
    for spec in plan.tensors:
        target = tensors.get(spec.name)
        if target is None:
            problems.append(f"unknown tensor {spec.name!r}")
            kinds.add(None)
            continue
        expected = str(target.dtype).removeprefix("torch.")
        shape = whole_shape(spec)
        if tuple(target.shape) != shape or target.dtype != dtype_from_name(spec.dtype):
            problems.append(f"{spec.name!r}: sent {spec.dtype}{list(shape)}, expected {expected}{list(target.shape)}")
            kinds.add((spec.dtype, expected) if tuple(target.shape) == shape else None)
    planned = {spec.name for spec in plan.tensors}
    missing = [repr(name) for name in sorted(set(tensors) - planned)] if strict else []
    missing += [" / ".join(repr(name) for name in group) for group in groups if not planned.intersection(group)]
    problems += [f"plan lacks {names}" for names in missing]
    kinds.update([None] if missing else [])
    if problems:
        raise mismatch(problems, kinds, "the receiver's tensors")


def mismatch(problems: Sequence[str], kinds: set[tuple[str, str] | None], what: str) -> PlanError:
    """The error for a plan that disagrees with `what` a receiver holds, `problems` one per tensor.
    `kinds` holds (sent, expected) for each dtype-only disagreement and None for any other: when
    every disagreement is the same dtype for another, the error leads with the fix."""
    (only,) = kinds if len(kinds) == 1 else (None,)
    if only is not None:
        sent, expected = only
        return PlanError(
            f"the push sends {sent} where this receiver holds {expected} ({len(problems)} tensors, e.g. "
            f"{problems[0]}): push {expected} (cast=torch.{expected}, or no cast) or serve a {sent} model"
        )
    more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
    return PlanError(f"plan does not match {what}: " + "; ".join(problems[:8]) + more)


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
