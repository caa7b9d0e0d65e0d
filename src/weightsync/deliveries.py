"""What one push sends to whom, decided once: its deliveries.

    DeliveryPlanner.outgoing(tensors)         the push's tensors, read and checked (`Outgoing`)
    DeliveryPlanner.plan_deliveries(...)      the one decision: `Planned`, its deliveries in order

A delivery is one plan and the receivers it goes to; `WeightSender._deliver` moves every kind the
same way (offer, buckets, commit), asking a delivery only for its buckets (`items`) and its
commit (`commit`). A push is one of three kinds, and only `plan_deliveries` tells them apart:

    plain    one `Whole` plan of every tensor, to every receiver
    delta    (`delta=`, delta.py) the full version to the receivers that do not hold the baseline,
             then a patch to those that do: two `Whole`s, modes "full" and "delta"
    sharded  (a `ShardedSource`, or receivers that keep boxes of tensors: `Welcome.wants`) one
             `Part` per group of receivers that keep the same boxes, its plan cut by
             `regions.part_plan`, this rank carrying its part; several go out side by side, each
             through a data plane of its own

A hash the commit carries that the buckets do not give (a delta push's digest of the whole new
version; the whole version's digest where no receiver gets a whole tensor; a rank's shares of a
push from several) is a `digest.Pending`, computed while the buckets go out.

The planner keeps what its decision reuses from push to push: the plans and their ids, the delta
baseline, and which tensors it said last were sent whole; it says once why a transport is sent
every push whole (`delta=True` over shared memory) or a source's tensors whole.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar, Literal, TypeAlias

import torch

from weightsync.checksum import SyncHashes, Verify, check_verify, stricter
from weightsync.delta import Baseline, Diff, Step, patch_plan, rank_diff
from weightsync.digest import Pending, held_shares, rank_tensors, source_digest
from weightsync.dtypes import dtype_from_name
from weightsync.errors import ConfigError, PlanError
from weightsync.messages import Adapter, Commit, Committed, Piece, Plan, TensorShare, TensorSpec, Welcome
from weightsync.options import SenderOptions
from weightsync.pack import BucketItem, bucket_items, part_items
from weightsync.plan import (
    INDEX_BYTES,
    PlanCache,
    build_plan,
    dense_nbytes,
    part_buckets,
    plan_id,
    tensor_nbytes,
    wire_specs,
)
from weightsync.regions import cuts, part_plan, sent_whole
from weightsync.source import (
    Exchanges,
    ShardedSource,
    SourceLayout,
    TensorMeta,
    WeightSource,
    as_source,
    held_tensors,
)
from weightsync.transports import get_transport
from weightsync.transports import names as transport_names
from weightsync.transports.base import TransportSpec

__all__ = [
    "Delivery",
    "DeliveryPlanner",
    "Outgoing",
    "Part",
    "PatchPart",
    "Planned",
    "Whole",
    "agreed_digest",
    "patch_plan",
]

log = logging.getLogger(__name__)

Mode = Literal["full", "delta"]

NO_DIGEST: Pending[str] = Pending.now("")
"""No digest known beside the buckets: the commit takes the buckets' own (if they were hashed)."""

NO_SHARES: Pending[tuple[TensorShare, ...]] = Pending.now(())

MAX_CUT_PLANS = 16
"""Sharded plans a planner keeps (one per distinct group of receivers and bucket size)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Whole:
    """A plan of whole tensors (or patches of them), cut from `source`, to `addresses`.

    Both kinds of delivery answer the same: `mode` (what the receivers get: "full", every tensor
    or their boxes, or "delta", a patch), `plan` and its id `identity`, `addresses`, `delta_base`
    and `part` (as the `Offer` names them), `own_plane` (goes out beside other deliveries,
    through a data plane of its own), `sent_bytes` (the payload bytes each receiver is sent),
    `items` (each bucket this sender sends, with the source tensors its pieces are cut from),
    `held` (the source's tensors, for a data plane that reads them in place, where the source
    holds them for the whole push; else []) and `commit` (the Commit for the receivers of one
    transport, whose buckets' hashes are `hashes`, None where not hashed, and the content digest
    it carries, "" unverified or unknown here).
    """

    mode: Mode
    plan: Plan
    identity: str
    metas: Sequence[TensorMeta]
    source: WeightSource
    """What the plan's pieces are cut from, in plan order."""
    addresses: frozenset[str]
    delta_base: str = ""
    digest: Pending[str] = NO_DIGEST
    """The version's content digest where the sender computes it whole (a delta push: what
    travelled is not the version), whatever the buckets' hashes say."""
    part: ClassVar[int] = 0
    own_plane: ClassVar[bool] = False

    @property
    def sent_bytes(self) -> int:
        return self.plan.total_bytes

    def items(self) -> Iterator[tuple[int, list[BucketItem]]]:
        return bucket_items(self.plan, self.metas, self.source.tensors())

    def held(self) -> list[torch.Tensor]:
        return held_tensors(self.source)

    def commit(self, version: int, verify: Verify, hashes: SyncHashes | None) -> tuple[Commit, str]:
        complete = hashes is not None and hashes.complete
        digest = self.digest.get() or (hashes.content_digest() if hashes is not None and complete else "")
        if not digest:
            return Commit(version, self.identity), ""
        tensors = hashes.tensor_hashes() if verify == "full" and hashes is not None and complete else ()
        return Commit(version, self.identity, digest, tensors), digest


@dataclasses.dataclass(frozen=True, slots=True)
class Part:
    """This rank's part of a sharded plan (boxes of tensors, in parts from several ranks) to a
    group of receivers that keep the same boxes. No receiver gets a whole tensor to hash, so its
    commit carries a digest the sender gives: the whole version's (one sender) or this rank's
    shares of every tensor's hash (several), which the receivers combine."""

    plan: Plan
    identity: str
    source: WeightSource
    """What this rank holds of each tensor (`digest.rank_tensors`), in plan order."""
    layout: SourceLayout
    addresses: frozenset[str]
    own_plane: bool
    digest: Pending[str] = NO_DIGEST
    shares: Pending[tuple[TensorShare, ...]] = NO_SHARES
    mode: ClassVar[Mode] = "full"
    delta_base: ClassVar[str] = ""

    @property
    def part(self) -> int:
        return self.layout.rank if self.plan.parts else 0

    @property
    def sent_bytes(self) -> int:
        if not self.plan.parts:
            return self.plan.total_bytes
        return sum(piece.nbytes for index in part_buckets(self.plan, self.part) for piece in self.plan.buckets[index])

    def items(self) -> Iterator[tuple[int, list[BucketItem]]]:
        boxes = getattr(self.source, "boxes", None)  # a checkpoint reads each box as a slice
        if boxes is not None and self.layout.world == 1:
            return part_items(self.plan, self.layout, boxes(self.plan.tensors), boxed=True)
        return part_items(self.plan, self.layout, rank_tensors(self.source))

    def held(self) -> list[torch.Tensor]:
        return []  # its pieces are cut from views of what the rank holds, never read in place

    def commit(self, version: int, verify: Verify, hashes: SyncHashes | None) -> tuple[Commit, str]:
        shares = self.shares.get()
        if shares:
            return Commit(version, self.identity, shares=shares), ""
        digest = self.digest.get()
        return Commit(version, self.identity, digest), digest


@dataclasses.dataclass(frozen=True, slots=True)
class PatchPart:
    """This rank's part of a sharded push's patches (`patch_plan`) to the receivers holding the
    version they apply to: its changes to every tensor, as its `payloads` (sparse patches in the
    whole tensors' indices); its commit carries this rank's shares of the new version's hash,
    which the receivers combine and check against the weights the patches leave."""

    plan: Plan
    identity: str
    payloads: Sequence[torch.Tensor]
    counts: Sequence[Sequence[int]]
    """Every rank's number of changes to each tensor (`patch_plan`)."""
    part: int
    addresses: frozenset[str]
    delta_base: str
    shares: Pending[tuple[TensorShare, ...]] = NO_SHARES
    mode: ClassVar[Mode] = "delta"
    own_plane: ClassVar[bool] = False

    @property
    def sent_bytes(self) -> int:
        return sum(piece.nbytes for index in part_buckets(self.plan, self.part) for piece in self.plan.buckets[index])

    def items(self) -> Iterator[tuple[int, list[BucketItem]]]:
        """Each bucket of this rank's part, its pieces cut from this rank's payloads: a piece's
        offset in the tensor's joined patch made relative to this rank's own patch of it."""
        for index in part_buckets(self.plan, self.part):
            items = []
            for piece in self.plan.buckets[index]:
                spec, mine = self.plan.tensors[piece.tensor], self.counts[self.part][piece.tensor]
                before = sum(row[piece.tensor] for row in self.counts[: self.part])
                size = dtype_from_name(spec.dtype).itemsize
                indices = spec.count * INDEX_BYTES
                if piece.tensor_offset < indices:
                    local = piece.tensor_offset - before * INDEX_BYTES
                else:
                    local = mine * INDEX_BYTES + piece.tensor_offset - indices - before * size
                cut = Piece(piece.tensor, local, piece.bucket_offset, piece.nbytes)
                items.append(BucketItem(cut, self.payloads[piece.tensor], torch.uint8))
            yield index, items

    def held(self) -> list[torch.Tensor]:
        return []

    def commit(self, version: int, verify: Verify, hashes: SyncHashes | None) -> tuple[Commit, str]:
        return Commit(version, self.identity, shares=self.shares.get()), ""


Delivery: TypeAlias = Whole | Part | PatchPart
"""One plan and the receivers it goes to, as `WeightSender._deliver` moves it."""


def agreed_digest(version: int, replies: Mapping[str, Committed]) -> str:
    """The content digest the receivers committed, where the sender could not compute it (a part
    of a sharded push from several senders): "" where none said one or they disagree (logged)."""
    digests = {reply.content_digest for reply in replies.values()} - {""}
    if len(digests) > 1:
        log.error(
            "version %d: the receivers committed %d different content digests: %s", version, len(digests), digests
        )
    return digests.pop() if len(digests) == 1 else ""


@dataclasses.dataclass(frozen=True, slots=True)
class Outgoing:
    """One push's tensors, read and checked before anything is sent."""

    source: WeightSource
    metas: list[TensorMeta]
    specs: list[TensorSpec]
    """Every tensor as it travels (wire dtypes, after any cast)."""
    layout: SourceLayout | None
    """A sharded source's: which box of each tensor each rank holds; None: one sender holds every tensor."""
    adapter: Adapter | None

    @property
    def largest_tensor_bytes(self) -> int:
        return max((tensor_nbytes(spec) for spec in self.specs), default=0)

    @property
    def full_bytes(self) -> int:
        return sum(dense_nbytes(spec) for spec in self.specs)


@dataclasses.dataclass(frozen=True, slots=True)
class Planned:
    """What a push sends: its deliveries, in order, and what the decision found."""

    deliveries: tuple[Delivery, ...]
    verify: Verify
    """The strictest verification of the sender's, its receivers' and the push's own (a delta
    push verifies at least "bucket": a patch onto the wrong bytes must not commit)."""
    changed_fraction: float = 1.0
    whole_tensors: tuple[str, ...] = ()
    """The tensors sent whole to a receiver that keeps boxes of others (`SyncReport`)."""
    refused: Mapping[str, PlanError] = dataclasses.field(default_factory=dict)
    """Receivers whose wants were refused (why): they get nothing."""

    @property
    def side_by_side(self) -> bool:
        """Whether the deliveries go out at once, each through its own data plane."""
        return len(self.deliveries) > 1 and all(delivery.own_plane for delivery in self.deliveries)


class DeliveryPlanner:
    """Decides each push's deliveries, and keeps what that decision reuses across pushes.

    Args:
        options: the sender's (cast, verify, delta).
        transports: the transport of each receiver, by address.
    """

    def __init__(self, options: SenderOptions, transports: Mapping[str, TransportSpec]) -> None:
        self._cast = options.cast
        self._verify = options.verify
        patching = {spec.name for spec in transports.values() if _patches(spec, options)}
        self._patchable = frozenset(address for address, spec in transports.items() if spec.name in patching)
        """The receivers whose transport takes patches (`delta`)."""
        self._unfit_for_parts = sorted({spec.name for spec in transports.values() if not spec.takes_parts})
        """The transports that cannot carry a plan from several ranks."""
        self._plans = PlanCache()
        self._cut_plans: dict[tuple[Any, ...], tuple[Plan, str]] = {}
        """Sharded plans and their ids, by what they were built from."""
        self._said_whole: tuple[str, ...] = ()
        self._timeout = options.timeout
        self._baseline = Baseline() if options.delta else None
        """With delta: the last push, as sent; a receiver holding it gets only what changed."""

    def outgoing(self, tensors: Any, adapter: Adapter | None) -> Outgoing:
        """The push of `tensors`, read: its source, metas and wire specs, and its layout (which
        every rank of a sharded source reads at the same point).

        Raises:
            ConfigError: a sharded push with an adapter, or with delta from a source whose ranks
                cannot exchange their patch sizes (`source.Exchanges`).
        """
        source = as_source(tensors)
        metas = source.metas()
        layout = source.layout() if isinstance(source, ShardedSource) else None  # every rank, in step
        if layout is not None and adapter is not None:
            raise ConfigError("a sharded push carries no LoRA adapter")
        if layout is not None and layout.world > 1 and self._baseline is not None and not isinstance(source, Exchanges):
            raise ConfigError(
                f"a sharded push with delta needs a source whose ranks exchange their patch sizes; "
                f"{type(source).__name__} has no `exchange` (ModuleSource and MegatronSource do)"
            )
        return Outgoing(source, metas, wire_specs(metas, self._cast), layout, adapter)

    def plan_deliveries(self, outgoing: Outgoing, bucket_bytes: int, live: Mapping[str, Welcome]) -> Planned:
        """The deliveries of `outgoing` to the receivers `live` (each with its Welcome), in
        buckets of `bucket_bytes`: sharded where receivers keep boxes of tensors or the source is
        sharded, a delta where a receiver it may patch holds the baseline, else plain.

        Raises:
            ConfigError: a push from several ranks over a transport that cannot carry one.
        """
        baseline = self._baseline
        if outgoing.adapter is None and baseline is None:
            return self._by_wants(outgoing, bucket_bytes, live)
        if baseline is not None and outgoing.layout is not None and outgoing.layout.world > 1:
            return self._sharded_delta(baseline, outgoing, bucket_bytes, live)
        takers = [address for address in live if address in self._patchable]
        step = _next_step(baseline, takers, live) if outgoing.adapter is None else "plain"
        if baseline is None or step == "plain":
            return Planned((self._whole(outgoing, bucket_bytes, live),), self._verify_for(live, "off"))
        diff = (baseline.diff if step == "diff" else baseline.refresh)(outgoing.specs, outgoing.source)
        deliveries = self._delta(baseline, diff, outgoing, bucket_bytes, live, takers)
        return Planned(deliveries, self._verify_for(live, "bucket"), diff.changed_fraction if diff.base else 1.0)

    def _verify_for(self, live: Mapping[str, Welcome], floor: Verify) -> Verify:
        """The strictest verification any receiver asks for, the push's own `floor`, or ours."""
        return stricter(self._verify, floor, *(check_verify(welcome.verify) for welcome in live.values()))

    def _whole(self, outgoing: Outgoing, bucket_bytes: int, live: Mapping[str, Welcome]) -> Whole:
        plan = self._plans.build(outgoing.specs, bucket_bytes)
        ids = self._plans.plan_id(plan)
        return Whole("full", plan, ids, outgoing.metas, outgoing.source, frozenset(live))

    def _delta(
        self,
        baseline: Baseline,
        diff: Diff,
        outgoing: Outgoing,
        bucket_bytes: int,
        live: Mapping[str, Welcome],
        takers: list[str],
    ) -> tuple[Whole, ...]:
        """Who gets the patch (those of `takers` holding exactly the baseline it applies to) and who
        the full version, full first; both from the baseline, which now holds the new version."""
        patched = frozenset(a for a in takers if diff.worth_it and live[a].delta_base == diff.base)
        full = frozenset(live) - patched
        deliveries = []
        if full:
            whole = baseline.source()
            plan = self._plans.build(outgoing.specs, bucket_bytes)
            ids = self._plans.plan_id(plan)
            deliveries.append(Whole("full", plan, ids, whole.metas(), whole, full, digest=diff.pending_content))
        if patched:
            patches = diff.patch_source()
            plan = build_plan(diff.specs, bucket_bytes)
            deliveries.append(
                Whole("delta", plan, plan_id(plan), patches.metas(), patches, patched, diff.base, diff.pending_content)
            )
        return tuple(deliveries)

    def _sharded_delta(
        self, baseline: Baseline, outgoing: Outgoing, bucket_bytes: int, live: Mapping[str, Welcome]
    ) -> Planned:
        """A push from several ranks with delta (docs/delta.md, `delta.rank_diff`): the receivers
        it may patch that hold the baseline get every rank's patch, as the parts of one plan;
        the others every rank's boxes of the full version, whole tensors."""
        layout, source = outgoing.layout, outgoing.source
        assert layout is not None and isinstance(source, Exchanges)  # noqa: S101  # checked in `outgoing`
        takers = [address for address in live if address in self._patchable]
        step = _next_step(baseline, takers, live)
        if step == "plain":  # no receiver it may patch (their transports: the same on every rank)
            return self._by_wants(outgoing, bucket_bytes, live)
        diff = rank_diff(baseline, outgoing.specs, layout, source, step == "diff", self._timeout)
        patched = frozenset(a for a in takers if diff.worth_it and live[a].delta_base == diff.base)
        verify = self._verify_for(live, "bucket")
        shares = Pending.now(diff.shares if verify != "off" else ())
        deliveries: list[Delivery] = []
        if full := frozenset(live) - patched:
            plan, identity = self._cut_plan(outgoing.specs, layout, bucket_bytes)
            deliveries.append(Part(plan, identity, source, layout, full, False, shares=shares))
        if patched:
            plan = patch_plan(outgoing.specs, diff.counts, bucket_bytes)
            rank = layout.rank
            deliveries.append(
                PatchPart(plan, plan_id(plan), diff.payloads, diff.counts, rank, patched, diff.base, shares)
            )
        return Planned(tuple(deliveries), verify, diff.changed_fraction if diff.worth_it else 1.0)

    def _by_wants(self, outgoing: Outgoing, bucket_bytes: int, live: Mapping[str, Welcome]) -> Planned:
        """A push without delta or adapter (docs/architecture.md): one `Part` per group of
        receivers that keep the same boxes of tensors, each a plan in this rank's part; plain
        where no receiver keeps boxes and one sender pushes. Receivers whose wants are refused
        get nothing (`Planned.refused`)."""
        layout = outgoing.layout
        if layout is not None and layout.world > 1 and self._unfit_for_parts:
            raise ConfigError(
                f"a push from {layout.world} ranks runs over {', '.join(_fit_for_parts())}, not {self._unfit_for_parts}"
            )
        groups, refused = cuts(outgoing.specs, {address: welcome.wants for address, welcome in live.items()})
        kept = {address: welcome for address, welcome in live.items() if address not in refused}
        whole = self._say_whole(sent_whole(outgoing.specs, {a: w.wants for a, w in kept.items()}))
        verify = self._verify_for(kept, "off")
        if not _cut(layout, groups, outgoing.source):
            return Planned((self._whole(outgoing, bucket_bytes, kept),), verify, whole_tensors=whole, refused=refused)
        layout = layout or SourceLayout.whole(len(outgoing.specs))
        digest, shares = self._part_hashes(outgoing.source, layout, verify)
        parts = []
        for addresses, specs in groups:
            plan, identity = self._cut_plan(specs, layout, bucket_bytes)
            own = len(groups) > 1
            parts.append(Part(plan, identity, outgoing.source, layout, addresses, own, digest, shares))
        return Planned(tuple(parts), verify, whole_tensors=whole, refused=refused)

    def _part_hashes(
        self, source: WeightSource, layout: SourceLayout, verify: Verify
    ) -> tuple[Pending[str], Pending[tuple[TensorShare, ...]]]:
        """A verified sharded push: from one sender, the whole version's content digest, hashed
        from the whole tensors it holds (no receiver gets them whole to hash); from several,
        this rank's shares of every tensor's hash (no process holds every tensor whole), which
        the receivers combine into the same digest. Hashed beside the buckets' sending."""
        if verify == "off":
            return NO_DIGEST, NO_SHARES
        if layout.world > 1:
            return NO_DIGEST, Pending.later(functools.partial(held_shares, source, layout, self._cast))
        return Pending.later(functools.partial(source_digest, source, self._cast)), NO_SHARES

    def _cut_plan(self, specs: list[TensorSpec], layout: SourceLayout, bucket_bytes: int) -> tuple[Plan, str]:
        """`regions.part_plan` and its id, the same as last time for the same arguments."""
        key = (tuple(specs), layout.world, layout.held, bucket_bytes)
        found = self._cut_plans.get(key)
        if found is None:
            plan = part_plan(specs, layout, bucket_bytes)
            found = self._cut_plans[key] = (plan, plan_id(plan))
            while len(self._cut_plans) > MAX_CUT_PLANS:
                self._cut_plans.pop(next(iter(self._cut_plans)))
        return found

    def _say_whole(self, whole: tuple[str, ...]) -> tuple[str, ...]:
        """`whole`, the tensors sent whole to receivers keeping boxes of others; said in the log
        when they differ from the last push's that had some."""
        if whole and whole != self._said_whole:
            self._said_whole = whole
            log.warning("these tensors are sent whole, their receivers' loaders could not be traced: %s", whole)
        return whole


def _next_step(baseline: Baseline | None, takers: list[str], live: Mapping[str, Welcome]) -> Step:
    """What a push with a baseline does (docs/delta.md): with no receiver it may patch, plain; a
    diff where one of `takers` (receivers it may patch) holds the baseline; else a refresh, so
    that they hold a base for the next push."""
    if baseline is None or not takers:
        return "plain"
    if baseline.content and any(live[address].delta_base == baseline.content for address in takers):
        return "diff"
    return "refresh"


def _cut(
    layout: SourceLayout | None, groups: list[tuple[frozenset[str], list[TensorSpec]]], source: WeightSource
) -> bool:
    """Whether a push is cut per group of receivers: a sharded source always; else where some
    receiver keeps boxes, unless receivers keep different ones and the source makes its tensors
    on demand and cannot read boxes (it is walked once: every receiver is sent whole tensors,
    said once)."""
    if layout is not None:
        return True
    if all(spec.region is None for _, specs in groups for spec in specs):
        return False
    if len(groups) > 1 and getattr(source, "holds_tensors", False) is not True and not hasattr(source, "boxes"):
        _say_walked_once()
        return False
    return True


def _fit_for_parts() -> list[str]:
    return [spec.name for spec in map(get_transport, transport_names()) if spec.takes_parts]


def _patches(spec: TransportSpec, options: SenderOptions) -> bool:
    """Whether the receivers of `spec` that hold the previous push get only what changed; with
    delta=True and a transport it does not patch, said why, once per transport and process (a
    group of servers rebuilds its sender whenever a server joins)."""
    patches = options.delta == "all" or (options.delta is True and spec.networked)
    if options.delta is True and not patches and spec.name not in _SAID:
        _SAID.add(spec.name)
        log.warning(
            "delta=True sends every push whole to %s receivers: a diff pays only over a network transport "
            '(tcp, collective, nixl); delta="all" diffs over every transport (docs/delta.md)',
            spec.name,
        )
    return patches


_SAID: set[str] = set()
"""What this process said once already: the transports `_patches` named, "walked once"."""


def _say_walked_once() -> None:
    """Receivers keep different boxes, and the source may be walked only once: said once per
    process."""
    if "walked once" in _SAID:
        return
    _SAID.add("walked once")
    log.warning(
        "receivers keep different boxes of the tensors, and the source makes its tensors on demand: "
        "every receiver is sent whole tensors (a sharded source, or one that holds its tensors, is cut per receiver)"
    )
