"""The sending end: moves a push's deliveries, bucket by bucket, to every receiver, and reports.

    source (named tensors) -> deliveries (deliveries.py) -> control channel + data plane -> receivers

`push` is the one orchestration loop, the mirror of `WeightReceiver`'s; it reads top to bottom:
check, connect, agree on a bucket size, plan the deliveries, deliver, report. What a push sends
to whom (plain, delta or sharded) is decided once, in `DeliveryPlanner.plan_deliveries`; here
every delivery moves the same way (`_deliver`: offer, buckets, commit). `push` holds the state of
the push: each step returns which receivers failed and why, and a failed receiver takes no part
in the steps after.

A `Carrier` is one transport's receivers with the control channel and the data plane(s) that
reach them; deliveries that go out side by side (a sharded push to receivers keeping different
boxes) each take a data plane of their own.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from weightsync.checksum import SyncHashes, Verify
from weightsync.deliveries import Delivery, DeliveryPlanner, Outgoing, Planned, agreed_digest
from weightsync.errors import (
    ConfigError,
    NegotiationError,
    SyncFailed,
    TransferTimeout,
    TransportError,
    WeightSyncError,
    one_line,
)
from weightsync.messages import Abort, Adapter, Committed, Offer, Welcome
from weightsync.options import SenderOptions, build_options
from weightsync.plan import part_buckets
from weightsync.report import ReceiverOutcome, SyncReport
from weightsync.sizing import (
    ALIGN_BYTES,
    LARGEST_AUTO_BUCKET_BYTES,
    align_up,
    auto_bucket_bytes,
    negotiate_bucket_bytes,
)
from weightsync.transports import check_address
from weightsync.transports.base import Failures, PlaneOptions, SendPlane, TransportSpec
from weightsync.transports.control import SenderChannel
from weightsync.transports.links import opener

__all__ = ["WeightSender"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Carrier:
    """The receivers of one transport, with the control channel and data plane that reach them."""

    name: str
    wire: bool
    """Whether its bytes cross a wire, so that buckets carry checksums."""
    addresses: tuple[str, ...]
    channel: SenderChannel
    plane: SendPlane
    largest_auto_bucket_bytes: int
    new_plane: Callable[[], SendPlane]
    """Makes another data plane over `channel`, for deliveries that go out side by side."""
    planes: dict[frozenset[str], SendPlane] = dataclasses.field(default_factory=dict)
    """Those planes, by the receivers they serve (kept across pushes: a ring is reused)."""

    def plane_for(self, delivery: Delivery) -> SendPlane:
        """The data plane `delivery` goes through: the carrier's own, or one of its own."""
        mine = delivery.addresses & frozenset(self.addresses)
        if not delivery.own_plane or not mine:
            return self.plane
        if mine not in self.planes:
            self.planes[mine] = self.new_plane()
        return self.planes[mine]

    def close(self) -> None:
        for plane in [self.plane, *self.planes.values()]:
            plane.close()
        self.channel.close()


@dataclasses.dataclass(frozen=True, slots=True)
class Delivered:
    """How one delivery went: the receivers that committed it (their replies), those that
    failed in it (why), and the content digest committed ("" unverified)."""

    delivery: Delivery
    committed: dict[str, Committed]
    failed: Failures
    digest: str


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
        allow_older_version: receivers take a version at or below the last one they committed,
            which they refuse otherwise (versions only go forward; docs/failure-semantics.md).
    """

    def __init__(self, addresses: Sequence[str] | str, options: SenderOptions | None = None, **kwargs: Any) -> None:
        addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        if not addresses or len(set(addresses)) != len(addresses):
            raise ConfigError(f"need one or more distinct receiver addresses, got {addresses!r}")
        specs = {address: check_address(address) for address in addresses}
        self.options = options = build_options(SenderOptions, options, kwargs)
        self._addresses = addresses
        self._carriers: list[Carrier] = []
        try:
            for spec in dict.fromkeys(specs.values()):
                self._carriers.append(_carrier(spec, tuple(a for a in addresses if specs[a] is spec), options))
        except BaseException:
            self.close()
            raise
        self._planner = DeliveryPlanner(options, specs)

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
        _check_push(version, deadline, adapter)
        started = time.perf_counter()
        ends = started + deadline if deadline is not None else None
        try:  # until the offer, receivers wait for one: a failure tells them it will not come
            outgoing = self._planner.outgoing(tensors, adapter)
            welcomes, failures = self._connect()
            bucket_bytes, unfit = self._agree_bucket_bytes(outgoing, welcomes, failures)
            failures |= unfit
            self._turn_away(version, failures, adapter)
            live = {a: welcomes[a] for a in self._addresses if a in welcomes and a not in failures}
            planned = self._planner.plan_deliveries(outgoing, bucket_bytes, live)
            failures |= planned.refused
            self._turn_away(version, planned.refused, adapter)
        except BaseException as exc:
            self._give_up(version, f"the sender failed: {one_line(exc)}", self._addresses, adapter)
            raise
        delivered = self._deliver_all(planned, version, ends, welcomes, failures, adapter)
        report = self._report(version, outgoing, bucket_bytes, planned, delivered, failures, started)
        log.info("push: %s", report.summary())
        if self.options.raise_on_failure and not report.ok:
            raise SyncFailed(report.failure(), report)
        return report

    def _deliver_all(
        self,
        planned: Planned,
        version: int,
        ends: float | None,
        welcomes: Mapping[str, Welcome],
        failures: Failures,
        adapter: Adapter | None,
    ) -> list[Delivered]:
        """Every delivery of `planned`: side by side, each on a thread of its own (the first error
        any raised, once every one ended), or one after the other, where a delivery that raises
        tells the receivers of the later ones (offered nothing yet) that none will come."""
        deliveries, verify = planned.deliveries, planned.verify
        if planned.side_by_side:
            with ThreadPoolExecutor(len(deliveries), thread_name_prefix="weightsync-delivery") as pool:
                args = (version, verify, ends, welcomes, failures, None)
                running = [pool.submit(self._deliver, delivery, *args) for delivery in deliveries]
                errors = [future.exception() for future in running]
            for error in errors:
                if error is not None:
                    raise error
            return [future.result() for future in running]
        delivered = []
        for index, delivery in enumerate(deliveries):
            try:
                delivered.append(self._deliver(delivery, version, verify, ends, welcomes, failures, adapter))
            except BaseException as exc:
                later = [address for after in deliveries[index + 1 :] for address in after.addresses]
                self._give_up(version, f"the sender failed: {one_line(exc)}", later, adapter)
                raise
        return delivered

    def _deliver(
        self,
        delivery: Delivery,
        version: int,
        verify: Verify,
        ends: float | None,
        welcomes: Mapping[str, Welcome],
        failures: Failures,
        adapter: Adapter | None,
    ) -> Delivered:
        """One plan to its receivers: offer, buckets, commit."""
        plan = delivery.plan
        failures = dict(failures)
        allow_older = self.options.allow_older_version
        offer = Offer(
            version, plan, delivery.identity, verify, delivery.delta_base, adapter, delivery.part, allow_older
        )
        # a delivery beside others goes only through the carriers of its own receivers
        carriers = [c for c in self._carriers if not delivery.own_plane or delivery.addresses & set(c.addresses)]
        planes = {carrier.name: carrier.plane_for(delivery) for carrier in carriers}

        def live(carrier: Carrier) -> list[str]:
            return [a for a in carrier.addresses if a in welcomes and a not in failures and a in delivery.addresses]

        hashes = {c.name: SyncHashes(plan) if verify != "off" and c.wire else None for c in carriers}
        try:
            # only a plane that reads tensors in place (cudaipc) makes the source yield them early
            held = delivery.held() if plan.buckets and any(plane.reads_held for plane in planes.values()) else []
            for carrier in carriers:
                plane = planes[carrier.name]
                failures |= _at(version, None, plane.prepare(plan, live(carrier), held))
                failures |= _at(version, None, carrier.channel.offer(offer, live(carrier)))
                if part_buckets(plan, delivery.part) and live(carrier):
                    failures |= _at(version, None, plane.begin(plan, live(carrier)))
            for index, items in delivery.items():
                if not any(live(carrier) for carrier in carriers):
                    continue  # every receiver failed; walk on: the source may be a collective others are in
                _check_deadline(ends, version, index)
                for carrier in carriers:
                    sent = planes[carrier.name].send(index, items, live(carrier), hashes[carrier.name])
                    failures |= _at(version, index, sent)
            for carrier in carriers:
                failures |= _at(version, None, planes[carrier.name].finish(live(carrier)))
        except BaseException as exc:
            for carrier in carriers:
                planes[carrier.name].abort()
                carrier.channel.abort(Abort(version, f"sender failed: {exc}"), live(carrier))
            raise
        committed: dict[str, Committed] = {}
        digests = []
        for carrier in carriers:
            commit, digest = delivery.commit(version, verify, hashes[carrier.name])
            replies, failed = carrier.channel.commit(commit, live(carrier))
            _at(version, None, failed)
            for address, reply in replies.items():
                carrier.channel.record(address, reply.delta_base)
            committed |= replies
            failures |= failed
            digests.append(digest or agreed_digest(version, replies))
        failed_here = {a: e for a, e in failures.items() if a in delivery.addresses}
        return Delivered(delivery, committed, failed_here, next((digest for digest in digests if digest), ""))

    def _report(
        self,
        version: int,
        outgoing: Outgoing,
        bucket_bytes: int,
        planned: Planned,
        delivered: list[Delivered],
        failures: Failures,
        started: float,
    ) -> SyncReport:
        """What the push did, from what each delivery returned."""
        failures = failures | {a: e for done in delivered for a, e in done.failed.items()}
        committed = {a: reply for done in delivered for a, reply in done.committed.items()}
        by_address = {a: done.delivery for done in delivered for a in done.delivery.addresses}
        fraction = planned.changed_fraction
        return SyncReport(
            version=version,
            total_bytes=outgoing.full_bytes,
            num_tensors=len(outgoing.specs),
            num_buckets=sum(len(delivery.plan.buckets) for delivery in planned.deliveries),
            bucket_bytes=bucket_bytes,
            seconds=time.perf_counter() - started,
            outcomes=tuple(
                _outcome(a, failures.get(a), committed.get(a), by_address.get(a), fraction) for a in self._addresses
            ),
            content_digest=next((done.digest for done in delivered if done.digest), ""),
            wire_bytes=sum(delivery.sent_bytes for delivery in planned.deliveries if delivery.addresses),
            changed_fraction=fraction,
            whole_tensors=planned.whole_tensors,
        )

    def _turn_away(self, version: int, failures: Mapping[str, WeightSyncError], adapter: Adapter | None) -> None:
        """Receivers connected and failed before any offer (a bucket size they cannot afford,
        wants refused): they hear why at once, rather than wait for an offer."""
        for address, error in failures.items():
            self._give_up(version, one_line(error), [address], adapter)

    def _give_up(self, version: int, reason: str, addresses: Sequence[str], adapter: Adapter | None) -> None:
        """Tell the connected receivers among `addresses` that `version` will not be offered to
        them (`reason`): they stop waiting for it, and the links end."""
        for carrier in self._carriers:
            abort = Abort(version, reason, adapter.name if adapter is not None else "")
            carrier.channel.abort(abort, [a for a in carrier.addresses if a in addresses])

    def _connect(self) -> tuple[dict[str, Welcome], Failures]:
        welcomes: dict[str, Welcome] = {}
        failures: Failures = {}
        for carrier in self._carriers:
            reached, failed = carrier.channel.connect(carrier.addresses)
            welcomes |= reached
            failures |= failed
        return welcomes, failures

    def _agree_bucket_bytes(
        self, outgoing: Outgoing, welcomes: Mapping[str, Welcome], failures: Failures
    ) -> tuple[int, Failures]:
        """Negotiate one bucket size; returns it, and the receivers that cannot afford the
        minimum (why)."""
        options = self.options
        proposed = options.proposed_bucket_bytes or auto_bucket_bytes(
            outgoing.largest_tensor_bytes,
            outgoing.full_bytes,
            memory_budget_bytes=options.memory_budget_bytes,
            num_slots=options.num_slots,
            largest_bytes=min(
                (carrier.largest_auto_bucket_bytes for carrier in self._carriers), default=LARGEST_AUTO_BUCKET_BYTES
            ),
        )
        # The sender's own minimum bounds its proposal too: "auto" sized from small tensors
        # must not propose less than it then requires.
        proposed = max(proposed, ALIGN_BYTES, align_up(options.min_bucket_bytes))
        unfit: Failures = {
            address: NegotiationError(
                f"receiver {address} accepts buckets of at most {welcome.max_bucket_bytes} bytes, "
                f"the sender requires at least {options.min_bucket_bytes}"
            )
            for address, welcome in welcomes.items()
            if address not in failures and welcome.max_bucket_bytes < options.min_bucket_bytes
        }
        limits = {a: w.max_bucket_bytes for a, w in welcomes.items() if a not in failures and a not in unfit}
        if not limits:
            return proposed, unfit
        return negotiate_bucket_bytes(proposed, limits, options.min_bucket_bytes), unfit

    def close(self) -> None:
        """Close connections and release transfer buffers (shared-memory rings)."""
        for carrier in self._carriers:
            carrier.close()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _check_push(version: int, deadline: float | None, adapter: Adapter | None) -> None:
    """Raises ConfigError for bad arguments to `push`."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ConfigError(f"version must be a non-negative integer, got {version!r}")
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or deadline <= 0):
        raise ConfigError(f"deadline must be a positive number of seconds or None, got {deadline!r}")
    if adapter is not None and not isinstance(adapter, Adapter):
        raise ConfigError(f"adapter must be a weightsync.Adapter or None, got {type(adapter).__name__}")


def _carrier(spec: TransportSpec, addresses: tuple[str, ...], options: SenderOptions) -> Carrier:
    """The control channel and data plane of transport `spec` to `addresses`."""
    spec.check("sender")
    channel = SenderChannel(
        spec.name,
        opener(spec.link, spec.name, spec.messages),
        timeout=options.timeout,
        auth_token=options.auth_token if spec.across_processes else None,
    )
    plane_options = PlaneOptions(timeout=options.timeout, num_slots=options.num_slots)
    new_plane = functools.partial(spec.send_plane, channel, plane_options)
    return Carrier(spec.name, spec.has_wire, addresses, channel, new_plane(), spec.largest_auto_bucket_bytes, new_plane)


def _at(version: int, bucket: int | None, failures: Failures) -> Failures:
    """`failures`, each transport error saying where it happened (unless its raiser did)."""
    for error in failures.values():
        if isinstance(error, TransportError):
            error.at(version=version, bucket=bucket)
    return failures


def _check_deadline(ends: float | None, version: int, index: int) -> None:
    if ends is not None and time.perf_counter() > ends:
        raise TransferTimeout(f"the push ran past its deadline before bucket {index}", version=version, bucket=index)


def _outcome(
    address: str, error: WeightSyncError | None, reply: Committed | None, delivery: Delivery | None, fraction: float
) -> ReceiverOutcome:
    mode, wire_bytes = (delivery.mode, delivery.sent_bytes) if delivery is not None else ("full", 0)
    if error is None and reply is not None:
        return ReceiverOutcome(
            address, True, times=reply.times, mode=mode, wire_bytes=wire_bytes, changed_fraction=fraction
        )
    error = error or WeightSyncError("the receiver neither committed nor failed")
    return ReceiverOutcome.failed_with(address, error, mode=mode, wire_bytes=wire_bytes, changed_fraction=fraction)
