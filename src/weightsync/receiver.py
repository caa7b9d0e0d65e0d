"""The receiving end: once started, listens for senders, lands each sync into a sink, and
commits a version only when every byte of it has arrived.

One receive loop per connected sender; its `_sync` is the mirror of the sender's `_deliver`::

    handshake   Hello -> Welcome (+ the sender's Auth)        (control.welcome_sender, first_message)
    setup       the data plane takes what the sender sets up between syncs (a ring to map)
    sync        Offer -> begin (check the plan, sink.begin) -> Accept
                (an Offer of a LoRA adapter lands in `sink.adapter_sink(adapter)` instead;
                a refused Offer (one at or below the last version committed, unless it says
                `allow_older`) -> sink.refused -> Failed, and the sync never began;
                an Abort instead of the Offer -> sink.refused, and the sender leaves)
                data_plane.begin(landing); for each bucket k: data_plane.receive(k, landing)
                data_plane.finish(landing); Commit -> commit (verify, sink.commit) -> Committed
                any failure -> abort (sink.abort, told whether the served weights are intact)

A sharded sync (a plan in parts, one per sender) is one sync fed by several connections: the
first part's offer begins it, each other part's offer of the same plan joins it, each
connection lands the buckets of its own part, and the sync commits once every part sent its
Commit; a failure on any part aborts it for all. `parts.Parts` decides all of that (and when a
departed sender makes a sync impossible); the receiver acts on its answers.

State machine (one sync at a time; `WeightReceiver` is its only owner)::

    empty --begin--> syncing --commit--> ready --begin--> syncing ...
                        |
                        +--abort--> previous state, when no live byte was touched
                        +--abort--> dirty (version None), when live weights were partly written
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, TypeAlias

import msgspec

from weightsync.auth import check_bind
from weightsync.checksum import VERIFY_MODES, Verify, check_verify, stricter
from weightsync.errors import (
    ChecksumError,
    ConfigError,
    NegotiationError,
    PeerClosedError,
    PlanError,
    ProtocolError,
    RemoteError,
    TransportError,
    WeightSyncError,
)
from weightsync.landing import Landing, Staging
from weightsync.messages import (
    PROTOCOL_VERSION,
    Abort,
    Accept,
    Commit,
    Committed,
    Failed,
    Offer,
    SyncTimes,
    Welcome,
)
from weightsync.options import ReceiverOptions, build_options
from weightsync.parts import Parts, Refused, Sender, Wait
from weightsync.plan import check_plan, part_buckets, plan_id
from weightsync.sink import WeightSink, as_sink, sink_errors
from weightsync.transports import get_transport
from weightsync.transports.base import Link, Listener, PlaneOptions, ReceivePlane
from weightsync.transports.control import expect_on, first_message, welcome_sender
from weightsync.transports.links import listener_for

__all__ = ["ReceiverState", "ReceiverStatus", "WeightReceiver"]

log = logging.getLogger(__name__)

ReceiverState: TypeAlias = Literal["empty", "syncing", "ready", "dirty"]


@dataclasses.dataclass(frozen=True, slots=True)
class ReceiverStatus:
    """What a receiver holds, as one value: replaced whole on every change, never edited."""

    state: ReceiverState = "empty"
    version: int | None = None
    """The last committed version the sink holds intact, or None."""
    last_committed: int | None = None
    """The last version committed here, kept while dirty: an offer at or below it is refused
    unless it says `allow_older` (versions only go forward)."""
    content_digest: str = ""
    """The content digest of `version` when its sync was verified, else ""."""
    last_error: str = ""
    """Why the last sync failed, or "" if it committed."""
    times: SyncTimes | None = None
    """Where the last committed sync's time went."""
    mode: Literal["full", "delta"] | None = None
    """How the last committed sync travelled: the full version, or a patch onto the previous one."""
    delta_base: str = ""
    """The content digest a patch may be applied to here: the last committed version's, when its
    sync was verified and every tensor of it sits in a destination; "" once a sync begins."""


class WeightReceiver:
    """Receives weights pushed by a `WeightSender` and hands them to a sink. It listens once
    started (`start()`, or entering its context) until closed::

        with WeightReceiver(model.state_dict(), transport="shm") as receiver:
            publish(receiver.address)  # to the trainer
            ...

    Args:
        sink: a `WeightSink`, a mapping of destination tensors (written in place), or a callable
            taking a list of (name, tensor) pairs.
        transport: "shm", "tcp", "collective", "cudaipc" (both processes on CUDA) or "inproc".
        host: interface to listen on (tcp, collective); loopback by default.
        port: port to listen on (tcp, collective); 0 picks a free one.
        max_bucket_bytes: the largest bucket this side accepts, or "auto" for half the budget.
        memory_budget_bytes: what this side may spend on transfer buffers.
        timeout: seconds any single wait inside a sync may last before the sync is aborted.
        verify: the weakest verification this receiver accepts: "off", "bucket" (each bucket
            checksummed by the sender, checked here before its tensors reach the sink) or "full".
        auth_token: a shared secret senders must prove they hold (HMAC challenge; the token is
            never sent). Default: $WEIGHTSYNC_AUTH_TOKEN, else none. Required to listen on a
            non-loopback interface.
    """

    def __init__(
        self, sink: Any, transport: str = "shm", options: ReceiverOptions | None = None, **kwargs: Any
    ) -> None:
        spec = get_transport(transport)
        self.options = options = build_options(ReceiverOptions, options, kwargs)
        self._verify: Verify = options.verify
        self._token = options.auth_token
        spec.check("receiver")
        if spec.networked:
            check_bind(options.host, self._token, f"a {transport} weight receiver")
        self._sink: WeightSink = as_sink(sink)
        self._max_bucket_bytes = options.bucket_limit
        self._timeout = options.timeout
        self._new_plane = spec.receive_plane
        self._wire = spec.has_wire
        self._plane_options = PlaneOptions(timeout=self._timeout, max_bucket_bytes=self._max_bucket_bytes)
        self._id = secrets.token_hex(4)
        self._busy = threading.Lock()
        self._changed = threading.Condition()
        self._status = ReceiverStatus()
        self._staging = Staging()
        """Reused by every sync: where tensors without a destination are assembled."""
        self._checked_plan = ""
        """The id of the last plan `check_plan` passed (the same id is the same plan)."""
        self._before_sync: ReceiverState = "empty"
        self._landing: Landing | None = None
        """The sync in progress (from `begin` to its commit or abort)."""
        self._parts: Parts[Landing] = Parts(self._timeout)
        """The sharded sync in progress, which the other parts' offers join, and its senders."""
        self._observers: list[Callable[[ReceiverStatus, ReceiverStatus], None]] = []
        self._closed = threading.Event()
        self._spec = spec
        self._listener: Listener | None = None

    def start(self) -> WeightReceiver:
        """Listen for senders (the constructor does no I/O); returns the receiver, so that
        `receiver = WeightReceiver(...).start()` reads as one step. Entering its context starts it.

        Raises:
            ResourceError: the address cannot be listened on.
            ConfigError: the receiver was closed, or started already.
        """
        if self._listener is not None or self._closed.is_set():
            raise ConfigError("a WeightReceiver starts once, and not after close()")
        spec, options = self._spec, self.options
        self._listener = listener_for(
            spec.link, spec.name, host=options.host, port=options.port, timeout=self._timeout, messages=spec.messages
        )
        self._listener.start(self._serve)
        return self

    # --- what it holds --------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """Where a sender connects: "shm://@...", "tcp://127.0.0.1:PORT" or "inproc://..." (once
        started)."""
        if self._listener is None:
            raise ConfigError("the receiver has no address before it starts: call start() or enter its context")
        return self._listener.address

    @property
    def status(self) -> ReceiverStatus:
        """Everything below, as one consistent value."""
        return self._status

    @property
    def version(self) -> int | None:
        """The last committed weight version the sink holds intact, or None."""
        return self._status.version

    @property
    def state(self) -> ReceiverState:
        """ "empty", "syncing", "ready" or "dirty" (a failed sync partly overwrote live weights)."""
        return self._status.state

    @property
    def content_digest(self) -> str:
        """The content digest of the committed version when its sync was verified, else ""."""
        return self._status.content_digest

    @property
    def last_error(self) -> str:
        """Why the last sync failed, or "" if it committed."""
        return self._status.last_error

    @property
    def buffer_bytes(self) -> int:
        """Host memory this receiver keeps between syncs for tensors without a destination, in
        bytes: the arena where tensors larger than a bucket are assembled, and the buffer a socket
        transport receives a bucket into for a sink that borrows (0 while no sync needed either)."""
        return self._staging.nbytes

    def wait_for_version(self, version: int, timeout: float) -> bool:
        """Block until `version` (or a later one) is committed; False on timeout."""
        with self._changed:
            return self._changed.wait_for(
                lambda: self._status.version is not None and self._status.version >= version, timeout
            )

    def watch(self, observer: Callable[[ReceiverStatus, ReceiverStatus], None]) -> None:
        """Call `observer(before, after)` on every change of the status, on the thread that made
        it (a sync's), after the change. An observer must be quick and must not raise."""
        self._observers.append(observer)

    def _set(self, **changes: Any) -> None:
        with self._changed:
            before = self._status
            self._status = after = dataclasses.replace(before, **changes)
            self._changed.notify_all()
        for observer in self._observers:
            try:
                observer(before, after)
            except Exception:  # an observer's bug must not break a sync
                log.exception("a receiver status observer raised")

    # --- the receive loop: one per connected sender ---------------------------------------------

    def _serve(self, link: Link) -> None:
        plane: ReceivePlane | None = None
        sender: Sender | None = None  # as the joining of sharded syncs knows it, once welcomed
        try:
            welcome = welcome_sender(link, self._holds, self._token, self._timeout)
            if welcome is None:
                return
            sender = self._parts.connect()
            message = first_message(link, welcome, self._token, self._timeout)
            if isinstance(message, Abort) and message.version < 0:  # the sender refused our proof, and left
                log.warning("closing connection from sender: %s", message.reason)
                return
            sender = self._parts.arrive(sender)
            plane = self._new_plane(link, self._plane_options)
            while not self._closed.is_set():
                if isinstance(message, Offer):
                    sender = sender.offering(message)
                    self._sync(link, plane, message)
                    sender = self._parts.synced(sender)
                elif isinstance(message, Abort):  # the sender gave up on a version before offering it
                    self._given_up(message)
                    return
                elif not plane.on_setup(message):
                    raise ProtocolError(f"unexpected {type(message).__name__} between syncs", transport=link.transport)
                message = link.recv(None)
        except WeightSyncError as exc:
            if not self._closed.is_set() and not isinstance(exc, PeerClosedError):
                log.warning("closing connection from sender: %s", exc)
        finally:
            if sender is not None:
                self._left(sender, link.transport)
            if plane is not None:
                plane.close()

    def _sync(self, link: Link, plane: ReceivePlane, offer: Offer) -> None:
        """One plan from its sender, the mirror of `WeightSender._deliver`: offer, buckets, commit."""
        started = time.perf_counter()
        try:
            landing = self._begin(offer)
        except WeightSyncError as exc:
            link.send(Failed(offer.version, type(exc).__name__, str(exc)), self._timeout)
            return
        bucket: int | None = None  # the bucket in flight: where an error that stops the sync happened
        try:
            link.send(Accept(offer.version, landing.lends_chunked), self._timeout)
            buckets = part_buckets(offer.plan, offer.part)
            if buckets:
                plane.begin(landing)
            for bucket in buckets:
                plane.receive(bucket, landing)
            plane.finish(landing)
            bucket = None
            commit = expect_on(link, Commit, self._timeout)
            committing = time.perf_counter()
            content = self._commit(landing, commit, offer)
            times = _times(landing, landing.sink, started, committing)
            self._set(times=times)
            base = self._status.delta_base
            if landing.arena_unused:  # its tensors are lent from the ring now: no need to keep it
                self._staging.release_arena()
        except BaseException as exc:
            if isinstance(exc, TransportError):
                exc.at(version=offer.version, bucket=bucket)
            self._abort(landing, exc)
            if isinstance(exc, WeightSyncError) and not isinstance(exc, (PeerClosedError, RemoteError)):
                with contextlib.suppress(WeightSyncError):
                    link.send(Failed(offer.version, type(exc).__name__, str(exc)), self._timeout)
            raise
        link.send(Committed(offer.version, times, base, content), self._timeout)

    # --- the steps of a sync --------------------------------------------------------------------

    def _holds(self) -> Welcome:
        """What this receiver holds, as its Welcome says it (the handshake adds its challenge)."""
        status = self._status
        base = status.delta_base if status.state == "ready" else ""
        return Welcome(
            PROTOCOL_VERSION,
            self._id,
            self._max_bucket_bytes,
            status.version,
            self._verify,
            "",
            "",
            base,
            self._sink.wants(),
        )

    def _begin(self, offer: Offer) -> Landing:
        """Check an offered plan and start its sync; the landing site it will go to. A refused
        offer raises why, once the sink heard it (`WeightSink.refused`). The offer of a part of
        the sharded sync in progress joins it (`Parts.join`)."""
        if not offer.plan.parts:
            return self._start(offer)
        joined = self._parts.join(offer, lambda: self._start(offer))
        if isinstance(joined, Refused):
            log.warning("push of version %d refused: %s", offer.version, joined.error)
            self._refuse(offer, joined.error)
            raise joined.error
        return joined

    def _start(self, offer: Offer) -> Landing:
        """Begin the sync of `offer`, if no other is in progress."""
        if not self._busy.acquire(blocking=False):
            log.warning("push of version %d refused: busy with another sync", offer.version)
            busy = NegotiationError(f"receiver is busy with another sync; version {offer.version} refused")
            self._refuse(offer, busy)
            raise busy
        try:
            landing = self._landing_for(offer)
        except BaseException as exc:
            # A refused plan is a failed sync too: say why (state and version stay as they were),
            # once: this is the receiving side's only line for it (a server adds none).
            size = (offer.plan.total_bytes, len(offer.plan.tensors))
            log.warning("push of version %d refused (%d bytes, %d tensors): %s", offer.version, *size, exc)
            self._set(last_error=f"sync of version {offer.version} failed: {exc}")
            self._refuse(offer, exc)
            self._busy.release()
            raise
        self._landing = landing
        if offer.adapter is None:  # an adapter sync leaves the base weights, and so the state, as they are
            self._before_sync = self._status.state
            # every sync writes destinations: nothing to patch until it commits
            self._set(state="syncing", delta_base="")
        return landing

    def _given_up(self, abort: Abort) -> None:
        """The sender will not offer `abort.version` here (its push failed before its offer, or it
        turned this receiver away): the sink hears it as a refusal, so that a consumer waiting
        for that version stops waiting (an adapter's version was never the base weights' sync).
        The sender leaves; so does this connection."""
        which = f"adapter {abort.adapter!r} version {abort.version}" if abort.adapter else f"version {abort.version}"
        log.warning("the sender gave up on %s before offering it: %s", which, abort.reason)
        self._set(last_error=f"sync of {which} failed: the sender gave up: {abort.reason}")
        if not abort.adapter:
            self._refused(abort.version, RemoteError(f"the sender gave up on version {abort.version}: {abort.reason}"))

    def _refuse(self, offer: Offer, error: BaseException) -> None:
        """Tell the sink that `offer` was refused before its sync began (a consumer waiting for
        its version stops waiting). An adapter's offer was never the base weights' sync."""
        if offer.adapter is None:
            self._refused(offer.version, error)

    def _refused(self, version: int, error: BaseException) -> None:
        try:
            self._sink.refused(version, error)
        except Exception:  # the sink failing here must not hide why
            log.exception("sink.refused raised")

    def _landing_for(self, offer: Offer) -> Landing:
        """The landing site of `offer`, once its plan passed every check and the sink began."""
        if plan_id(offer.plan) != offer.plan_id:
            raise PlanError("the offer's plan_id does not match its plan")
        if offer.plan_id != self._checked_plan:  # a trainer offers the same plan every step
            check_plan(offer.plan, self._max_bucket_bytes)
            self._checked_plan = offer.plan_id
        if not 0 <= offer.part < max(1, len(offer.plan.parts)):
            raise PlanError(f"the offer carries part {offer.part} of a plan in {len(offer.plan.parts)} parts")
        if offer.plan.parts and offer.adapter is not None:
            raise PlanError("a plan in parts carries no adapter")
        if offer.verify not in VERIFY_MODES or stricter(check_verify(offer.verify), self._verify) != offer.verify:
            raise NegotiationError(f"receiver requires verify={self._verify!r}; the offer has {offer.verify!r}")
        last = self._status.last_committed
        if offer.adapter is None and not offer.allow_older and last is not None and offer.version <= last:
            raise NegotiationError(
                f"version {offer.version} is not above version {last}, committed here last: versions only go "
                "forward (push a higher one, or allow_older_version=True to move it back)"
            )
        if offer.delta_base and offer.delta_base != self._status.delta_base:
            raise NegotiationError(
                f"version {offer.version} is a patch onto content {offer.delta_base}; this receiver holds "
                f"{self._status.delta_base or 'no version a patch can be applied to'}"
            )
        sink = self._sink
        if offer.adapter is not None:
            if offer.delta_base:
                raise PlanError(f"adapter {offer.adapter.name!r} version {offer.version} cannot travel as a patch")
            with sink_errors("adapter_sink"):
                sink = self._sink.adapter_sink(offer.adapter)
        with sink_errors("begin"):
            sink.begin(offer.plan, offer.version)
        try:
            verify = check_verify(offer.verify)
            return Landing(
                offer.plan, sink, offer.version, offer.plan_id, verify, self._staging, delta=bool(offer.delta_base)
            )
        except BaseException as exc:  # the sink began: it must hear that the sync is off
            with contextlib.suppress(Exception):
                sink.abort(offer.version, exc, intact=True)
            raise

    def _commit(self, landing: Landing, commit: Commit, offer: Offer) -> str:
        """Check what landed against the sender's commit, then commit it to the sink; the
        content digest committed ("" unverified). A part of a sharded sync commits once every
        part did: the last part commits the sync for all, the others wait for it (`Parts.commit`)."""
        if offer.plan.parts:
            answer = self._parts.commit(landing, offer.part, commit.shares, commit.version)
            if isinstance(answer, Wait):
                return self._parts.wait(answer)
            commit = msgspec.structs.replace(commit, content_digest=answer.digest)
        try:
            content = self._verified_content(landing, commit)
            with sink_errors("commit"):  # like every other hook: the sink's error fails this sync cleanly
                landing.sink.commit(commit.version)
        except BaseException as exc:
            self._finish_abort(landing, exc)
            raise
        if self._adapter(landing):
            self._set(last_error="")
        else:
            mode = "delta" if landing.delta else "full"
            base = content if landing.patchable else ""
            self._set(
                state="ready",
                version=commit.version,
                last_committed=commit.version,
                content_digest=content,
                last_error="",
                mode=mode,
                delta_base=base,
            )
        self._release()
        return content

    def _left(self, sender: Sender, transport: str) -> None:
        """A sender's connection ended between its syncs (its process died, say): a sharded sync
        that this leaves too few senders to complete aborts now, not at its timeout (`Parts.leave`)."""
        impossible = self._parts.leave(sender)
        if impossible is not None:
            error = PeerClosedError(impossible.reason, transport=transport).at(version=impossible.version)
            self._abort(impossible.sync, error)

    def _verified_content(self, landing: Landing, commit: Commit) -> str:
        if (commit.version, commit.plan_id) != (landing.version, landing.plan_id):
            raise PlanError(f"commit of version {commit.version} does not match the sync of version {landing.version}")
        if not commit.content_digest:
            return ""
        if landing.cut and not landing.delta:
            # boxes of tensors, or parts of them from several senders: no whole tensor lands
            # here to hash. Every bucket that crossed a wire was checked against its sender's
            # checksum; the digest is the senders', of the whole version they pushed. (The
            # parts of a patch leave whole tensors here, which are hashed below.)
            if self._wire and not landing.hashes.complete:
                raise ChecksumError(f"commit of version {commit.version} has a content digest, the buckets had none")
            return commit.content_digest
        if landing.hashes.complete and not landing.delta:
            content = landing.hashes.content_digest()
        else:
            # A patch: what travelled is not the version, so hash the version where it now sits,
            # whole. In process (no wire, no checksums) likewise, where there are destinations.
            found = landing.destination_digest()
            if found is None and (landing.delta or self._wire):
                raise ChecksumError(f"commit of version {commit.version} has a content digest, the buckets had none")
            if found is None:
                return ""  # in process, into a loader: nothing crossed a wire, nothing to hash
            content = found
        if content != commit.content_digest:
            raise ChecksumError(f"version {commit.version}: content digest differs from the sender's")
        if landing.verify == "full" and not landing.delta:  # a patch was checked whole, above
            landing.check_tensors(commit.tensors)
        return content

    def _abort(self, landing: Landing, error: BaseException) -> None:
        """The sync of `landing` failed with `error` (nothing happens if it ended already)."""
        if landing is self._landing:
            self._finish_abort(landing, error)

    def _release(self, error: BaseException | None = None) -> None:
        """The sync in progress ended (with `error`, if it failed): the parts waiting for it
        hear how, and another sync may begin."""
        landing, self._landing = self._landing, None
        if landing is not None:
            if error is not None:
                landing.fail(error)  # the other parts' threads stop landing
            self._parts.end(landing, error)
        self._busy.release()

    def _finish_abort(self, landing: Landing, error: BaseException) -> None:
        intact = not (landing.touched_live or landing.sink.wrote_live())
        try:
            landing.sink.abort(landing.version, error, intact=intact)
        except Exception:  # the sink failing to abort must not hide the original error
            log.exception("sink.abort raised")
        last_error = f"sync of version {landing.version} failed: {error}"
        log.warning("%s", last_error)
        if self._adapter(landing):
            self._set(last_error=last_error)
        elif intact:
            self._set(state=self._before_sync, last_error=last_error)
        else:
            self._set(state="dirty", version=None, content_digest="", last_error=last_error)
        self._release(error)

    def _adapter(self, landing: Landing) -> bool:
        """Whether `landing` is an adapter's sync (it lands in the sink `adapter_sink` gave)."""
        return landing.sink is not self._sink

    # --- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop listening and release buffers. A sync in flight is aborted."""
        self._closed.set()
        if self._listener is not None:
            self._listener.close()

    def __enter__(self) -> WeightReceiver:
        return self if self._listener is not None else self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = self._listener.address if self._listener is not None else "not started"
        return f"WeightReceiver({where!r}, state={self.state!r}, version={self.version})"


def _times(landing: Landing, sink: WeightSink, started: float, committing: float) -> SyncTimes:
    """Where a committed sync's time went, from its offer to its commit returning."""
    ended = time.perf_counter()
    load_s = landing.load_s + (ended - committing)  # the sink's commit: the engine's reload
    pause_s = sink.paused_s
    total_s = ended - started
    transfer_s = max(0.0, total_s - landing.landing_s - load_s - pause_s)
    return SyncTimes(total_s, transfer_s, landing.landing_s, load_s, pause_s)
