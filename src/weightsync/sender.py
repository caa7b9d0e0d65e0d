"""The sending end: plans a sync, moves it bucket by bucket to every receiver, and reports.

    source (named tensors) -> plan (buckets, chunks) -> control channel + data plane -> receivers

`push` is the one orchestration loop, the mirror of `WeightReceiver`'s; it reads top to bottom:
connect, agree on a bucket size, plan, offer, send buckets, commit, report. It holds the state of
the push: each step returns which receivers failed and why, and a failed receiver takes no part
in the steps after.

A sharded push (a `ShardedSource` with a layout, or receivers that keep boxes of tensors: their
`Welcome.wants`) sends each group of receivers that keep the same boxes its own plan
(`regions.part_plan`), and this rank only its part of it; the groups go out side by side, each
through a data plane of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

from weightsync.checksum import SyncHashes, Verify, check_verify, stricter
from weightsync.delta import Baseline, Diff, Step, settled
from weightsync.digest import held_shares, source_digest
from weightsync.errors import (
    ConfigError,
    NegotiationError,
    RemoteError,
    SyncFailed,
    TransferTimeout,
    TransportError,
    WeightSyncError,
    one_line,
)
from weightsync.messages import Abort, Adapter, Commit, Committed, Offer, Plan, TensorShare, TensorSpec, Welcome
from weightsync.options import SenderOptions, build_options
from weightsync.pack import BucketItem, bucket_items, part_items
from weightsync.plan import PlanCache, build_plan, dense_nbytes, part_buckets, plan_id, tensor_nbytes, wire_specs
from weightsync.regions import cuts, part_plan, sent_whole
from weightsync.report import ReceiverOutcome, SyncReport
from weightsync.sizing import (
    ALIGN_BYTES,
    LARGEST_AUTO_BUCKET_BYTES,
    align_up,
    auto_bucket_bytes,
    negotiate_bucket_bytes,
)
from weightsync.source import ShardedSource, SourceLayout, TensorMeta, WeightSource, as_source, held_tensors
from weightsync.transports import check_address, get_transport
from weightsync.transports import names as transport_names
from weightsync.transports.base import Failures, PlaneOptions, SendPlane
from weightsync.transports.control import SenderChannel
from weightsync.transports.links import opener

__all__ = ["WeightSender"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Delivery:
    """One plan and the receivers it goes to: everyone ("full"), or those a patch applies to."""

    mode: Literal["full", "delta"]
    plan: Plan
    metas: Sequence[TensorMeta]
    source: WeightSource
    """What `plan`'s pieces are cut from, in plan order."""
    addresses: frozenset[str]
    base: str = ""
    """For a patch: the content digest of the version it applies to (`Offer.base`)."""
    content: str | Future[str] = ""
    """The version's content digest where the sender computes it whole (a delta push), possibly
    still being computed: the commit waits for it."""
    layout: SourceLayout | None = None
    """A sharded plan (its tensors boxes, or in parts): which rows this rank holds, so that it
    sends its part, cut from `source`'s held tensors; None: the whole plan, from `source`."""
    shares: tuple[TensorShare, ...] | Future[tuple[TensorShare, ...]] = ()
    """A verified push from several senders: this rank's shares of every tensor's hash
    (digest.held_shares), possibly still being computed: the commit waits for them."""
    identity: str = ""
    """The plan's id where it was computed already."""
    own_plane: bool = False
    """Goes out beside other deliveries, through a data plane of its own."""

    @property
    def cut(self) -> bool:
        """Whether the plan carries boxes of tensors or parts: no receiver gets a whole tensor
        to hash, so its commit carries only the digest `content` gives (a sender's own)."""
        return self.layout is not None

    @property
    def sent_bytes(self) -> int:
        """The payload bytes this sender sends each of its receivers (its part of the plan)."""
        if not self.plan.parts or self.layout is None:
            return self.plan.total_bytes
        buckets = part_buckets(self.plan, self.layout.rank)
        return sum(piece.nbytes for index in buckets for piece in self.plan.buckets[index])

    def items(self) -> Iterator[tuple[int, list[BucketItem]]]:
        """Each bucket this sender sends, with the source tensors its pieces are cut from."""
        if self.layout is None:
            return bucket_items(self.plan, self.metas, self.source.tensors())
        held = self.source.held() if isinstance(self.source, ShardedSource) else self.source.tensors()
        return part_items(self.plan, self.layout, held)


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    """The receivers of one transport, with the control channel and data plane that reach them."""

    name: str
    wire: bool
    """Whether its bytes cross a wire, so that buckets carry checksums."""
    addresses: tuple[str, ...]
    channel: SenderChannel
    plane: SendPlane
    largest_auto_bucket_bytes: int = LARGEST_AUTO_BUCKET_BYTES
    patches: bool = False
    """Whether its receivers that hold the previous push get only what changed (`delta`)."""
    takes_parts: bool = False
    """Whether its transport carries a sharded plan from several senders (`TransportSpec`)."""
    new_plane: Callable[[], SendPlane] | None = None
    """Makes another data plane over `channel`, for deliveries that go out side by side."""
    planes: dict[frozenset[str], SendPlane] = dataclasses.field(default_factory=dict)
    """Those planes, by the receivers they serve (kept across pushes: a ring is reused)."""

    def live(self, failures: Mapping[str, WeightSyncError], welcomes: Mapping[str, Welcome]) -> list[str]:
        return [address for address in self.addresses if address in welcomes and address not in failures]

    def plane_for(self, delivery: Delivery) -> SendPlane:
        """The data plane `delivery` goes through: the route's own, or one of its own."""
        if not delivery.own_plane or self.new_plane is None:
            return self.plane
        mine = delivery.addresses & frozenset(self.addresses)
        if not mine:
            return self.plane
        if mine not in self.planes:
            self.planes[mine] = self.new_plane()
        return self.planes[mine]

    def close(self) -> None:
        for plane in [self.plane, *self.planes.values()]:
            plane.close()
        self.channel.close()


class WeightSender:
    """Pushes named tensors to one or more `WeightReceiver` addresses.

    Args:
        addresses: receiver addresses ("shm://@...", "tcp://HOST:PORT", "collective://HOST:PORT",
            "inproc://..."); several transports may be mixed.
        bucket_bytes: bucket size to propose, or "auto" (from the tensors and the budget). The
            size used is the smallest of this and every receiver's limit.
        min_bucket_bytes: refuse receivers that cannot afford buckets this large (e.g.
            `weightsync.min_bucket_bytes(config)` to keep the embedding unchunked).
        memory_budget_bytes: what this side may spend on transfer buffers (all ring slots).
        cast: send floating-point tensors as this dtype (e.g. torch.bfloat16), or a mapping of
            name to dtype; declared in the plan.
        timeout: seconds any single wait may last; a receiver that exceeds it is failed, not
            waited on (`push(deadline=...)` bounds a whole push).
        num_slots: shared-memory ring slots (2 lets packing overlap unpacking).
        raise_on_failure: True (the default): `push` raises `SyncFailed` (carrying the report)
            when any receiver did not commit. False: `push` returns the report whatever
            happened, for a caller that handles each receiver's outcome (`report.failed`).
        verify: "off", "bucket" (checksum every bucket, xxh3-64, for the receivers to check) or
            "full" (also every tensor where it finally sits).
            A receiver may require "bucket"; the strictest side wins.
        auth_token: the shared secret of receivers that require one (default:
            $WEIGHTSYNC_AUTH_TOKEN). Proven by HMAC, never sent; with a token, the sender also
            requires each receiver to prove it holds the same one.
        delta: True: each receiver reached over a network transport (tcp, collective, nixl)
            that holds the previous push (verified, in destinations it can patch) gets only the
            elements whose wire bits changed; every other receiver gets the full version, in the
            same push (docs/delta.md). "all": the same over every transport. Keeps one copy of
            the model in the wire dtype in host memory. A push that some receiver may take as a
            patch is verified at least as "bucket" (a patch onto the wrong bytes must not
            commit); one with no such receiver (delta=True, shared memory only) is verified as
            `verify` says, like a push without delta. The report's `mode` says what each
            receiver got.
    """

    def __init__(self, addresses: Sequence[str] | str, options: SenderOptions | None = None, **kwargs: Any) -> None:
        addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        if not addresses or len(set(addresses)) != len(addresses):
            raise ConfigError(f"need one or more distinct receiver addresses, got {addresses!r}")
        specs = {address: check_address(address) for address in addresses}
        self.options = options = build_options(SenderOptions, options, kwargs)
        self._timeout = options.timeout
        self._addresses = addresses
        self._routes: list[Route] = []
        self._plans = PlanCache()
        self._baseline = Baseline() if options.delta else None
        """With delta: the last push, as sent; a receiver holding it gets only what changed."""
        self._cut_plans: dict[tuple[Any, ...], tuple[Plan, str]] = {}
        """Sharded pushes' plans and their ids, by what they were built from."""
        self._whole: tuple[str, ...] = ()
        """The tensors the last push sent whole to a receiver keeping boxes of others."""
        self._said_whole: tuple[str, ...] = ()
        self._hasher: ThreadPoolExecutor | None = None
        """Hashes a sharded push's whole tensors while its buckets go out (one sender)."""
        plane_options = PlaneOptions(timeout=self._timeout, num_slots=options.num_slots)
        try:
            for spec in dict.fromkeys(specs.values()):
                spec.check("sender")
                channel = SenderChannel(
                    spec.name,
                    opener(spec.link, spec.name, spec.messages),
                    timeout=self._timeout,
                    auth_token=options.auth_token if spec.across_processes else None,
                )
                plane = spec.send_plane(channel, plane_options)
                mine = tuple(address for address in addresses if specs[address] is spec)
                patches = options.delta == "all" or (options.delta is True and spec.networked)
                if options.delta is True and not patches:
                    _say_whole_once(spec.name)
                self._routes.append(
                    Route(
                        spec.name,
                        spec.has_wire,
                        mine,
                        channel,
                        plane,
                        spec.largest_auto_bucket_bytes,
                        patches,
                        spec.takes_parts,
                        functools.partial(spec.send_plane, channel, plane_options),
                    )
                )
        except BaseException:
            self.close()
            raise

    @property
    def addresses(self) -> list[str]:
        return list(self._addresses)

    def connect(self) -> dict[str, WeightSyncError]:
        """Connect every receiver not connected yet (the handshake and, with a token, the proof
        both ways), pushing nothing; returns those that refused this sender, or that it refused
        (their token differs from its own, or only one side holds one), or could not be reached,
        with why ({} when every one takes it). `push` connects by itself: this tells a caller
        before it starts anything a push would fill (the vLLM backend, before it opens vLLM's
        update window)."""
        return self._connect()[1]

    def push(
        self, tensors: Any, version: int, *, deadline: float | None = None, adapter: Adapter | None = None
    ) -> SyncReport:
        """Send `tensors` to every receiver as weight version `version`.

        Args:
            tensors: a mapping name -> tensor, an iterable of (name, tensor) pairs, or a
                `WeightSource` (for tensors produced one at a time).
            version: the weight version receivers will report once committed.
            deadline: seconds the whole push may take, or None for no bound beyond `timeout` on
                every single wait. A push past its deadline aborts on every receiver.
            adapter: `tensors` are a LoRA adapter's (PEFT's names; `lora.adapter_from_peft`),
                and `version` is a version of this adapter, served by its name on top of the
                base weights, which stay as they are. Always sent whole (never as a delta).

        Returns:
            A SyncReport. Every receiver committed, unless `raise_on_failure=False`: then
            `report.ok` says whether they did, and `report.failed` which did not and why.

        Raises:
            ConfigError: bad arguments (nothing was sent).
            PlanError: the source yielded a tensor that does not match its metadata (the sync
                is aborted on every receiver).
            TransferTimeout: the push ran past `deadline` (aborted on every receiver).
            SyncFailed: some receiver did not commit (unless `raise_on_failure=False`); its
                message names them and the first cause on one line, `.report` has every outcome.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ConfigError(f"version must be a non-negative integer, got {version!r}")
        if deadline is not None and (
            isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or deadline <= 0
        ):
            raise ConfigError(f"deadline must be a positive number of seconds or None, got {deadline!r}")
        if adapter is not None and not isinstance(adapter, Adapter):
            raise ConfigError(f"adapter must be a weightsync.Adapter or None, got {type(adapter).__name__}")
        started = time.perf_counter()
        ends = started + deadline if deadline is not None else None
        try:  # until the offer, receivers wait for one: a failure tells them it will not come
            source = as_source(tensors)
            metas = source.metas()
            layout = source.layout() if isinstance(source, ShardedSource) else None  # every rank, in step
            if layout is not None and (self._baseline is not None or adapter is not None):
                raise ConfigError("a sharded push carries neither a delta nor a LoRA adapter")
            specs = wire_specs(metas, self.options.cast)
            welcomes, failures = self._connect()
            largest = max((tensor_nbytes(spec) for spec in specs), default=0)
            full_bytes = sum(dense_nbytes(spec) for spec in specs)
            bucket_bytes = self._agree_bucket_bytes(largest, full_bytes, welcomes, failures)
            sharded, self._whole = None, ()
            if adapter is None and self._baseline is None:
                sharded = self._sharded(specs, source, layout, bucket_bytes, welcomes, failures)
            self._turn_away(version, failures, adapter)
            reachable = [address for address in self._addresses if address in welcomes and address not in failures]
            takers = [a for route in self._routes if route.patches for a in route.addresses if a in reachable]
            step = self._next_step(takers, welcomes) if adapter is None else "plain"
            diff = None
            if self._baseline is not None and step == "diff":
                diff = self._baseline.diff(specs, source)
            elif self._baseline is not None and step == "refresh":
                diff = self._baseline.refresh(specs, source)
        except BaseException as exc:
            self._give_up(version, f"the sender failed: {one_line(exc)}", self._addresses, adapter)
            raise
        # the strictest verification any receiver asks for, or ours if stricter; a delta push
        # (a diff or a refresh) always verifies: a patch onto the wrong bytes must not commit
        verify = stricter(
            self.options.verify,
            "off" if diff is None else "bucket",
            *(check_verify(w.verify) for a, w in welcomes.items() if a not in failures),
        )
        if sharded is not None:
            deliveries, changed_fraction = self._with_content(sharded, source, verify), 1.0
        elif diff is None:
            deliveries = [Delivery("full", self._plans.build(specs, bucket_bytes), metas, source, frozenset(reachable))]
            changed_fraction = 1.0
        else:
            assert self._baseline is not None
            deliveries = _deliveries(self._baseline, diff, specs, bucket_bytes, reachable, takers, welcomes)
            changed_fraction = diff.changed_fraction if diff.base else 1.0

        by_address: dict[str, Delivery] = {}
        committed: dict[str, Committed] = {}
        contents = []
        if len(deliveries) > 1 and all(delivery.own_plane for delivery in deliveries):
            results = self._deliver_side_by_side(deliveries, version, verify, ends, welcomes, failures)
        else:
            results = []
            for index, delivery in enumerate(deliveries):
                try:
                    results.append(self._deliver(delivery, version, verify, ends, welcomes, failures, adapter))
                except BaseException as exc:  # the next deliveries' receivers were offered nothing yet
                    later = [address for after in deliveries[index + 1 :] for address in after.addresses]
                    self._give_up(version, f"the sender failed: {one_line(exc)}", later, adapter)
                    raise
        for delivery, (replies, failed, content) in zip(deliveries, results, strict=True):
            failures |= failed
            committed |= replies
            contents.append(content)
            by_address |= dict.fromkeys(delivery.addresses, delivery)

        report = SyncReport(
            version=version,
            total_bytes=full_bytes,
            num_tensors=len(specs),
            num_buckets=sum(len(delivery.plan.buckets) for delivery in deliveries),
            bucket_bytes=bucket_bytes,
            seconds=time.perf_counter() - started,
            outcomes=tuple(
                _outcome(address, failures, committed.get(address), by_address.get(address), changed_fraction)
                for address in self._addresses
            ),
            content_digest=next((content for content in contents if content), ""),
            wire_bytes=sum(delivery.sent_bytes for delivery in deliveries if delivery.addresses),
            changed_fraction=changed_fraction,
            whole_tensors=self._whole,
        )
        log.info("push: %s", report.summary())
        if self.options.raise_on_failure and not report.ok:
            raise SyncFailed(report.failure(), report)
        return report

    def _next_step(self, takers: list[str], welcomes: Mapping[str, Welcome]) -> Step:
        """What a push does (docs/delta.md): without delta, or with no receiver it may patch,
        plain; a diff where one of `takers` (receivers it may patch) holds the baseline; else a
        refresh, so that they hold a base for the next push."""
        baseline = self._baseline
        if baseline is None or not takers:
            return "plain"
        if baseline.content and any(welcomes[a].content == baseline.content for a in takers):
            return "diff"
        return "refresh"

    def _deliver(
        self,
        delivery: Delivery,
        version: int,
        verify: Verify,
        ends: float | None,
        welcomes: Mapping[str, Welcome],
        failures: Failures,
        adapter: Adapter | None,
    ) -> tuple[dict[str, Committed], Failures, str]:
        """One plan to its receivers: offer, buckets, commit. Returns the receivers that
        committed (their replies), those that failed in it, and the content digest committed
        ("" unverified)."""
        plan = delivery.plan
        identity = delivery.identity or self._plans.plan_id(plan)
        failures = dict(failures)
        part = delivery.layout.rank if delivery.layout is not None and plan.parts else 0
        offer = Offer(version, plan, identity, verify, delivery.base, adapter, part)
        # a delivery beside others goes only through the routes of its own receivers
        routes = [r for r in self._routes if not delivery.own_plane or delivery.addresses & set(r.addresses)]
        planes = {route.name: route.plane_for(delivery) for route in routes}

        def live(route: Route) -> list[str]:
            return [a for a in route.live(failures, welcomes) if a in delivery.addresses]

        hashes = {route.name: SyncHashes(plan) if verify != "off" and route.wire else None for route in routes}
        try:
            # only a plane that reads tensors in place (cudaipc) makes the source yield them early
            wanted = plan.buckets and not delivery.cut and any(planes[route.name].reads_held for route in routes)
            held = held_tensors(delivery.source) if wanted else []
            for route in routes:
                plane = planes[route.name]
                failures |= _at(version, None, plane.prepare(plan, live(route), held))
                failures |= _at(version, None, route.channel.offer(offer, live(route)))
                if part_buckets(plan, part) and live(route):
                    failures |= _at(version, None, plane.begin(plan, live(route)))
            for index, items in delivery.items():
                if not any(live(route) for route in routes):
                    continue  # every receiver failed; walk on: the source may be a collective others are in
                _check_deadline(ends, version, index)
                for route in routes:
                    sent = planes[route.name].send(index, items, live(route), hashes[route.name])
                    failures |= _at(version, index, sent)
            for route in routes:
                failures |= _at(version, None, planes[route.name].finish(live(route)))
        except BaseException as exc:
            for route in routes:
                planes[route.name].abort()
                route.channel.abort(Abort(version, f"sender failed: {exc}"), live(route))
            raise
        committed: dict[str, Committed] = {}
        contents = []
        for route in routes:
            hashed = None if delivery.cut else hashes[route.name]  # no process hashes a whole tensor
            commit, content = _commit_message(version, identity, verify, hashed, delivery.content, delivery.shares)
            replies, failed = route.channel.commit(commit, live(route))
            _at(version, None, failed)
            for address, reply in replies.items():
                route.channel.record(address, reply.content)
            committed |= replies
            failures |= failed
            contents.append(content or _agreed(version, replies))
        failed_here = {a: e for a, e in failures.items() if a in delivery.addresses}
        return committed, failed_here, next((content for content in contents if content), "")

    def _sharded(
        self,
        specs: list[TensorSpec],
        source: WeightSource,
        layout: SourceLayout | None,
        bucket_bytes: int,
        welcomes: Mapping[str, Welcome],
        failures: Failures,
    ) -> list[Delivery] | None:
        """The deliveries of a sharded push (docs/architecture.md): one per group of receivers
        that keep the same boxes of tensors, its plan in this rank's part; None for a push of
        whole tensors from one sender. Receivers whose wants are refused join `failures`."""
        if layout is not None and layout.world > 1:
            unfit = sorted({route.name for route in self._routes if not route.takes_parts})
            if unfit:
                fit = [spec.name for spec in map(get_transport, transport_names()) if spec.takes_parts]
                raise ConfigError(f"a push from {layout.world} ranks runs over {', '.join(fit)}, not {unfit}")
        reachable = [address for address in self._addresses if address in welcomes and address not in failures]
        wants = {address: welcomes[address].wants for address in reachable}
        groups, refused = cuts(specs, wants)
        failures |= refused
        self._whole = sent_whole(specs, {a: w for a, w in wants.items() if a not in refused})
        if self._whole and self._whole != self._said_whole:
            self._said_whole = self._whole
            log.warning("these tensors are sent whole, their receivers' loaders could not be traced: %s", self._whole)
        if layout is None and all(all(s.region is None for s in group_specs) for _, group_specs in groups):
            return None
        if layout is None and len(groups) > 1 and getattr(source, "holds_tensors", False) is not True:
            _say_walked_once()
            return None
        layout = layout or SourceLayout.whole(len(specs))
        deliveries = []
        for addresses, group_specs in groups:
            plan, identity = self._cut_plan(group_specs, layout, bucket_bytes)
            own = len(groups) > 1
            deliveries.append(
                Delivery("full", plan, [], source, addresses, layout=layout, identity=identity, own_plane=own)
            )
        return deliveries

    def _with_content(self, deliveries: list[Delivery], source: WeightSource, verify: Verify) -> list[Delivery]:
        """A verified sharded push: from one sender, the whole version's content digest, hashed
        from the whole tensors it holds (no receiver gets them whole to hash); from several,
        this rank's shares of every tensor's hash (no process holds every tensor whole), which
        the receivers combine into the same digest. Hashed beside the buckets' sending."""
        layout = deliveries[0].layout
        if verify == "off" or layout is None:
            return deliveries
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(1, thread_name_prefix="weightsync-digest")
        if layout.world > 1:
            assert isinstance(source, ShardedSource)  # only a sharded source gives a layout of several ranks
            shares = self._hasher.submit(held_shares, source, layout, self.options.cast)
            return [dataclasses.replace(delivery, shares=shares) for delivery in deliveries]
        content = self._hasher.submit(source_digest, source, self.options.cast)
        return [dataclasses.replace(delivery, content=content) for delivery in deliveries]

    def _cut_plan(self, specs: list[TensorSpec], layout: SourceLayout, bucket_bytes: int) -> tuple[Plan, str]:
        """`regions.part_plan` and its id, the same as last time for the same arguments."""
        key = (tuple(specs), layout.world, layout.rows, bucket_bytes)
        found = self._cut_plans.get(key)
        if found is None:
            plan = part_plan(specs, layout, bucket_bytes)
            found = self._cut_plans[key] = (plan, plan_id(plan))
            while len(self._cut_plans) > MAX_CUT_PLANS:
                self._cut_plans.pop(next(iter(self._cut_plans)))
        return found

    def _deliver_side_by_side(
        self,
        deliveries: list[Delivery],
        version: int,
        verify: Verify,
        ends: float | None,
        welcomes: Mapping[str, Welcome],
        failures: Failures,
    ) -> list[tuple[dict[str, Committed], Failures, str]]:
        """`_deliver` each of `deliveries` on a thread of its own (each through its own data
        plane); the first error any raised, once every one ended."""
        with ThreadPoolExecutor(len(deliveries), thread_name_prefix="weightsync-delivery") as pool:
            running = [
                pool.submit(self._deliver, delivery, version, verify, ends, welcomes, failures, None)
                for delivery in deliveries
            ]
            errors = [future.exception() for future in running]
        for error in errors:
            if error is not None:
                raise error
        return [future.result() for future in running]

    def _turn_away(self, version: int, failures: Failures, adapter: Adapter | None) -> None:
        """Receivers connected and failed before any offer (a bucket size they cannot afford):
        they hear why at once, rather than wait for an offer."""
        for address, error in failures.items():
            self._give_up(version, one_line(error), [address], adapter)

    def _give_up(self, version: int, reason: str, addresses: Sequence[str], adapter: Adapter | None) -> None:
        """Tell the connected receivers among `addresses` that `version` will not be offered to
        them (`reason`): they stop waiting for it, and the links end."""
        for route in self._routes:
            abort = Abort(version, reason, adapter.name if adapter is not None else "")
            route.channel.abort(abort, [a for a in route.addresses if a in addresses])

    def _connect(self) -> tuple[dict[str, Welcome], Failures]:
        welcomes: dict[str, Welcome] = {}
        failures: Failures = {}
        for route in self._routes:
            reached, failed = route.channel.connect(route.addresses)
            welcomes |= reached
            failures |= failed
        return welcomes, failures

    def _agree_bucket_bytes(
        self, largest_tensor_bytes: int, total_bytes: int, welcomes: Mapping[str, Welcome], failures: Failures
    ) -> int:
        """Negotiate one bucket size; receivers that cannot afford the minimum are failed."""
        options = self.options
        proposed = options.proposed_bucket_bytes or auto_bucket_bytes(
            largest_tensor_bytes,
            total_bytes,
            memory_budget_bytes=options.memory_budget_bytes,
            num_slots=options.num_slots,
            largest_bytes=min(
                (route.largest_auto_bucket_bytes for route in self._routes), default=LARGEST_AUTO_BUCKET_BYTES
            ),
        )
        # The sender's own minimum bounds its proposal too: "auto" sized from small tensors
        # must not propose less than it then requires.
        proposed = max(proposed, ALIGN_BYTES, align_up(options.min_bucket_bytes))
        for address, welcome in welcomes.items():
            if address not in failures and welcome.max_bucket_bytes < options.min_bucket_bytes:
                failures[address] = NegotiationError(
                    f"receiver {address} accepts buckets of at most {welcome.max_bucket_bytes} bytes, "
                    f"the sender requires at least {options.min_bucket_bytes}"
                )
        limits = {a: w.max_bucket_bytes for a, w in welcomes.items() if a not in failures}
        return negotiate_bucket_bytes(proposed, limits, options.min_bucket_bytes) if limits else proposed

    def close(self) -> None:
        """Close connections and release transfer buffers (shared-memory rings)."""
        for route in self._routes:
            route.close()
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
            self._hasher = None

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _deliveries(
    baseline: Baseline,
    diff: Diff,
    specs: list[TensorSpec],
    bucket_bytes: int,
    reachable: list[str],
    takers: list[str],
    welcomes: Mapping[str, Welcome],
) -> list[Delivery]:
    """Who gets the patch (those of `takers` holding exactly the baseline it applies to) and who
    the full version, full first; both from the baseline, which now holds the new version."""
    patched = frozenset(a for a in takers if diff.worth_it and welcomes[a].content == diff.base)
    full = frozenset(reachable) - patched
    deliveries = []
    if full:
        whole = baseline.source()
        plan = build_plan(specs, bucket_bytes)
        deliveries.append(Delivery("full", plan, whole.metas(), whole, full, content=diff.pending_content))
    if patched:
        patches = diff.patch_source()
        plan = build_plan(diff.specs, bucket_bytes)
        deliveries.append(
            Delivery("delta", plan, patches.metas(), patches, patched, base=diff.base, content=diff.pending_content)
        )
    return deliveries


def _at(version: int, bucket: int | None, failures: Failures) -> Failures:
    """`failures`, each transport error saying where it happened (unless its raiser did)."""
    for error in failures.values():
        if isinstance(error, TransportError):
            error.at(version=version, bucket=bucket)
    return failures


def _check_deadline(ends: float | None, version: int, index: int) -> None:
    if ends is not None and time.perf_counter() > ends:
        raise TransferTimeout(f"the push ran past its deadline before bucket {index}", version=version, bucket=index)


def _commit_message(
    version: int,
    identity: str,
    verify: Verify,
    hashes: SyncHashes | None,
    pending: str | Future[str],
    shares: tuple[TensorShare, ...] | Future[tuple[TensorShare, ...]] = (),
) -> tuple[Commit, str]:
    """The Commit for one transport's receivers, and the content digest it carries ("" unverified
    or unknown here).

    `pending`: the version's content digest where the sender knows it whole (a delta push's
    diff), whatever travelled; else it comes from the buckets' hashes, when they were hashed.
    `shares`: a part's shares of the tensors' hashes, for its receivers to combine."""
    held = settled(shares)
    if held:
        return Commit(version, identity, shares=held), ""
    content = settled(pending)
    if content:
        tensors = hashes.tensor_hashes() if verify == "full" and hashes is not None and hashes.complete else ()
        return Commit(version, identity, content, tensors), content
    if hashes is None or not hashes.complete:
        return Commit(version, identity), ""
    content = hashes.content_digest()
    return Commit(version, identity, content, hashes.tensor_hashes() if verify == "full" else ()), content


def _agreed(version: int, replies: Mapping[str, Committed]) -> str:
    """The content digest the receivers committed, where the sender could not compute it (a part
    of a sharded push from several senders): "" where none said one or they disagree (logged)."""
    digests = {reply.content_digest for reply in replies.values()} - {""}
    if len(digests) > 1:
        log.error(
            "version %d: the receivers committed %d different content digests: %s", version, len(digests), digests
        )
    return digests.pop() if len(digests) == 1 else ""


def _outcome(
    address: str, failures: Failures, reply: Committed | None, delivery: Delivery | None, changed_fraction: float
) -> ReceiverOutcome:
    mode, wire_bytes = (delivery.mode, delivery.sent_bytes) if delivery is not None else ("full", 0)
    error: WeightSyncError | None = failures.get(address)
    if error is None and reply is not None:
        return ReceiverOutcome(
            address, True, times=reply.times, mode=mode, wire_bytes=wire_bytes, changed_fraction=changed_fraction
        )
    if error is None:
        error = WeightSyncError("the receiver neither committed nor failed")
    kind = error.kind if isinstance(error, RemoteError) and error.kind else type(error).__name__
    return ReceiverOutcome(
        address, False, kind, str(error), mode=mode, wire_bytes=wire_bytes, changed_fraction=changed_fraction
    )


MAX_CUT_PLANS = 16
"""Sharded plans a sender keeps (one per distinct group of receivers and bucket size)."""


def _say_walked_once() -> None:
    """Receivers keep different boxes, and the source may be walked only once (its tensors are
    made on demand): every receiver is sent whole tensors. Said once per process."""
    if "walked once" in _SAID_WHOLE:
        return
    _SAID_WHOLE.add("walked once")
    log.warning(
        "receivers keep different boxes of the tensors, and the source makes its tensors on demand: "
        "every receiver is sent whole tensors (a sharded source, or one that holds its tensors, is cut per receiver)"
    )


_SAID_WHOLE: set[str] = set()
"""Transports `_say_whole_once` has named in this process."""


def _say_whole_once(transport: str) -> None:
    """delta=True to a receiver it does not patch: say why, once per transport and process (a
    group of servers rebuilds its sender whenever a server joins)."""
    if transport in _SAID_WHOLE:
        return
    _SAID_WHOLE.add(transport)
    log.warning(
        "delta=True sends every push whole to %s receivers: a diff pays only over a network transport "
        '(tcp, collective, nixl); delta="all" diffs over every transport (docs/delta.md)',
        transport,
    )
