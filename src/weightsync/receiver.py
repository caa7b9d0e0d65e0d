"""The receiving end: listens from construction on, lands each sync into a sink, and commits a
version only when every byte of it has arrived.

The receive loop is the mirror of `WeightSender.push`, one per connected sender::

    handshake   Hello -> Welcome (+ the sender's Auth)
    setup       the data plane takes what the sender sets up between syncs (a ring to map)
    sync        Offer -> begin (check the plan, sink.begin) -> Accept
                (an Offer of a LoRA adapter lands in `sink.adapter_sink(adapter)` instead;
                a refused Offer -> sink.refused -> Failed, and the sync never began;
                an Abort instead of the Offer -> sink.refused, and the sender leaves)
                for each bucket k: data_plane.receive(k, landing)
                data_plane.finish(landing); Commit -> commit (verify, sink.commit) -> Committed
                any failure -> abort (sink.abort, told whether the served weights are intact)

A sharded sync (a plan in parts, one per sender) is one sync fed by several connections: the
first part's offer begins it, each other part's offer of the same plan joins it (`_Parts`), each
connection lands the buckets of its own part, and the sync commits once every part sent its
Commit; a failure on any part aborts it for all.

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
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeAlias

import msgspec

from weightsync.auth import TOKEN_ENV, check_bind, new_nonce, proof, proof_matches
from weightsync.checksum import VERIFY_MODES, Verify, check_verify, combine_shares, stricter
from weightsync.errors import (
    AuthError,
    ChecksumError,
    ConfigError,
    NegotiationError,
    PeerClosedError,
    PlanError,
    ProtocolError,
    RemoteError,
    SinkError,
    TransferTimeout,
    TransportError,
    WeightSyncError,
)
from weightsync.landing import Landing, Staging
from weightsync.messages import (
    PROTOCOL_VERSION,
    Abort,
    Accept,
    Auth,
    Commit,
    Committed,
    Failed,
    Hello,
    Message,
    Offer,
    SyncTimes,
    TensorShare,
    Welcome,
)
from weightsync.options import ReceiverOptions, build_options
from weightsync.plan import check_plan, part_buckets, plan_id
from weightsync.sink import WeightSink, as_sink, sink_errors
from weightsync.transports import get_transport
from weightsync.transports.base import Link, Listener, PlaneOptions, ReceivePlane
from weightsync.transports.control import expect_on
from weightsync.transports.links import listener_for
from weightsync.wire import HANDSHAKE_FRAME_BYTES, MAX_FRAME_BYTES

__all__ = ["ReceiverState", "ReceiverStatus", "WeightReceiver"]

log = logging.getLogger(__name__)

ReceiverState: TypeAlias = Literal["empty", "syncing", "ready", "dirty"]


@dataclasses.dataclass(eq=False, slots=True)
class _Parts:
    """A sync fed by several senders, one part of its plan each: which parts joined, which
    committed, and how it ended (guarded by the receiver's `_joining` condition)."""

    offer: Offer
    landing: Landing
    joined: set[int]
    committed: set[int] = dataclasses.field(default_factory=set)
    shares: dict[int, tuple[TensorShare, ...]] = dataclasses.field(default_factory=dict)
    """Each committed part's shares of the tensors' hashes (a verified sync)."""
    content: str = ""
    """The content digest the sync commits, combined from `shares` by the last part."""
    ended: bool = False
    error: BaseException | None = None

    def takes(self, offer: Offer) -> bool:
        """Whether `offer` is another part of this sync."""
        first = self.offer
        return (offer.version, offer.plan_id, offer.adapter) == (first.version, first.plan_id, first.adapter)

    @property
    def complete(self) -> bool:
        return len(self.committed) == len(self.offer.plan.parts)


def _combined(shares: Mapping[int, tuple[TensorShare, ...]], version: int) -> str:
    """The content digest of a sharded sync from every part's shares (checksum.combine_shares);
    "" where no part carried any (the sync was not verified)."""
    carried = [shares[part] for part in sorted(shares) if shares[part]]
    if not carried:
        return ""
    if len(carried) < len(shares):
        missing = sorted(part for part, held in shares.items() if not held)
        raise ChecksumError(f"version {version}: the commits of parts {missing} carry no hashes, the others do")
    return combine_shares(carried)


@dataclasses.dataclass(frozen=True, slots=True)
class ReceiverStatus:
    """What a receiver holds, as one value: replaced whole on every change, never edited."""

    state: ReceiverState = "empty"
    version: int | None = None
    """The last committed version the sink holds intact, or None."""
    content_digest: str = ""
    """The content digest of `version` when its sync was verified, else ""."""
    last_error: str = ""
    """Why the last sync failed, or "" if it committed."""
    times: SyncTimes | None = None
    """Where the last committed sync's time went."""
    mode: Literal["full", "delta"] | None = None
    """How the last committed sync travelled: the full version, or a patch onto the previous one."""


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
        self._base = ""
        """The content digest a patch may be applied to here: the last committed version's, when
        it was verified and every tensor of it sits in a destination; "" once a sync begins."""
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
        self._parts: _Parts | None = None
        """The sharded sync in progress, which the other parts' offers join."""
        self._joining = threading.Condition()
        """Guards `_parts` and `_parts_gone`; the parts waiting for the others to commit wait on it."""
        self._parts_gone: set[int] = set()
        """Parts whose sender closed its connection between syncs, no sender having connected since."""
        self._senders_met = 0
        """Handshakes so far: a sender that closes after another one connected may have been replaced."""
        self._senders_connected = 0
        """Senders connected now (past their handshake): each part of a sharded sync comes over one."""
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
        part: int | None = None  # the part of a sharded sync this sender last offered
        met = -1  # handshakes as of this sender's last sync
        welcome = None
        try:
            welcome = self._greet(link)
            if welcome is None:
                return
            message = self._first_message(link, welcome)
            if message is None:
                return
            with self._joining:  # a sender came: any part may come again
                self._parts_gone.clear()
                self._senders_met += 1
                met = self._senders_met
            plane = self._new_plane(link, self._plane_options)
            while not self._closed.is_set():
                if isinstance(message, Offer):
                    part = message.part if message.plan.parts else None
                    self._sync(link, plane, message)
                    met = self._senders_met  # as of this sender's last sync
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
            if welcome is not None:
                self._sender_left(part, link.transport, met)
            if plane is not None:
                plane.close()

    def _greet(self, link: Link) -> Welcome | None:
        """Hello -> Welcome (None when the sender is refused); from then on the sender counts as
        connected (`_sender_left` when its connection ends)."""
        hello = link.recv(self._timeout, HANDSHAKE_FRAME_BYTES)
        if not isinstance(hello, Hello) or hello.protocol != PROTOCOL_VERSION:
            detail = f"expected Hello with protocol {PROTOCOL_VERSION}, got {hello!r}"[:500]
            link.send(Failed(-1, "ProtocolError", detail), self._timeout)
            return None
        welcome = self.welcome(hello.nonce)
        link.send(welcome, self._timeout)
        with self._joining:
            self._senders_connected += 1
        return welcome

    def _first_message(self, link: Link, welcome: Welcome) -> Message | None:
        """The sender's Auth where a token is required; returns the first message after the
        handshake (None when the sender is refused)."""
        # The sender goes on at once. Where a token is required, its next frame must be its
        # small Auth: bound it until it is checked.
        message = link.recv(self._timeout, HANDSHAKE_FRAME_BYTES if self.auth_required else MAX_FRAME_BYTES)
        if isinstance(message, Abort) and message.version < 0:  # the sender refused our proof, and left
            log.warning("closing connection from sender: %s", message.reason)
            return None
        try:
            if self.authenticate(welcome, message):
                message = link.recv(None)  # that was the sender's Auth frame
        except AuthError as exc:
            link.send(Failed(-1, "AuthError", str(exc)), self._timeout)
            raise
        return message

    def _sync(self, link: Link, plane: ReceivePlane, offer: Offer) -> None:
        started = time.perf_counter()
        try:
            landing = self.begin(offer)
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
            if offer.plan.parts:
                content = self._commit_part(landing, commit, offer.part)
            else:
                content = self.commit(landing, commit)
            times = _times(landing, landing.sink, started, committing)
            self._set(times=times)
            base = self._base
            if landing.arena_unused:  # its tensors are lent from the ring now: no need to keep it
                self._staging.release_arena()
        except BaseException as exc:
            if isinstance(exc, TransportError):
                exc.at(version=offer.version, bucket=bucket)
            self.abort(landing, exc)
            if isinstance(exc, WeightSyncError) and not isinstance(exc, (PeerClosedError, RemoteError)):
                with contextlib.suppress(WeightSyncError):
                    link.send(Failed(offer.version, type(exc).__name__, str(exc)), self._timeout)
            raise
        link.send(Committed(offer.version, times, base, content), self._timeout)

    # --- the steps of a sync --------------------------------------------------------------------

    @property
    def auth_required(self) -> bool:
        """True when senders must prove they hold this receiver's token."""
        return self._token is not None

    def welcome(self, sender_nonce: str = "") -> Welcome:
        """Our Welcome, with a fresh challenge and, if we hold a token, our answer to the sender's."""
        answer = proof(self._token, "receiver", sender_nonce) if self._token and sender_nonce else ""
        base = self._base if self.state == "ready" else ""
        wants = self._sink.wants()
        return Welcome(
            PROTOCOL_VERSION,
            self._id,
            self._max_bucket_bytes,
            self.version,
            self._verify,
            new_nonce(),
            answer,
            base,
            wants,
        )

    def authenticate(self, welcome: Welcome, message: Message) -> bool:
        """Check the sender's first message after `welcome`. True if it was the sender's `Auth`
        (consumed), False if it is an ordinary message; AuthError if we hold a token and the
        sender did not prove it holds it too."""
        if self._token is None:
            return isinstance(message, Auth)
        if not isinstance(message, Auth) or not proof_matches(self._token, "sender", welcome.nonce, message.proof):
            raise AuthError(
                "auth token refused: the sender did not prove it holds this receiver's auth token (it has none); "
                f"give the sender the receiver's token (auth_token=, or ${TOKEN_ENV})"
            )
        return True

    def begin(self, offer: Offer) -> Landing:
        """Check an offered plan and start its sync; the landing site it will go to. A refused
        offer raises why, once the sink heard it (`WeightSink.refused`). The offer of a part of
        the sharded sync in progress joins it."""
        if not offer.plan.parts:
            return self._begin_sync(offer)
        with self._joining:
            parts = self._parts
            gone = sorted(self._parts_gone - {offer.part})
            self._parts_gone.discard(offer.part)
            if (parts is None or not parts.takes(offer)) and gone:
                left = PeerClosedError(
                    f"the sender of part {gone[0]} closed its connection; version {offer.version} refused"
                )
                log.warning("push of version %d refused: %s", offer.version, left)
                self._refuse(offer, left)
                raise left
            if parts is None or not parts.takes(offer):
                landing = self._begin_sync(offer)
                self._parts = _Parts(offer, landing, {offer.part})
                return landing
            if offer.part in parts.joined:
                raise NegotiationError(f"part {offer.part} of version {offer.version} was offered twice")
            parts.joined.add(offer.part)
            return parts.landing

    def _begin_sync(self, offer: Offer) -> Landing:
        if not self._busy.acquire(blocking=False):
            log.warning("push of version %d refused: busy with another sync", offer.version)
            busy = NegotiationError(f"receiver is busy with another sync; version {offer.version} refused")
            self._refuse(offer, busy)
            raise busy
        try:
            landing = self._begin(offer)
        except BaseException as exc:
            # A refused plan is a failed sync too: say why (state and version stay as they were),
            # once: this is the receiving side's only line for it (a server adds none).
            plan = offer.plan
            log.warning(
                "push of version %d refused (%d bytes, %d tensors): %s",
                offer.version,
                plan.total_bytes,
                len(plan.tensors),
                exc,
            )
            self._set(last_error=f"sync of version {offer.version} failed: {exc}")
            self._refuse(offer, exc)
            self._busy.release()
            raise
        self._landing = landing
        if offer.adapter is None:  # an adapter sync leaves the base weights, and so the state, as they are
            self._before_sync = self._status.state
            self._base = ""  # every sync writes destinations: nothing to patch until it commits
            self._set(state="syncing")
        return landing

    def _given_up(self, abort: Abort) -> None:
        """The sender will not offer `abort.version` here (its push failed before its offer, or it
        turned this receiver away): the sink hears it as a refusal, so that a consumer waiting
        for that version stops waiting (an adapter's version was never the base weights' sync).
        The sender leaves; so does this connection."""
        which = f"adapter {abort.adapter!r} version {abort.version}" if abort.adapter else f"version {abort.version}"
        log.warning("the sender gave up on %s before offering it: %s", which, abort.reason)
        self._set(last_error=f"sync of {which} failed: the sender gave up: {abort.reason}")
        if abort.adapter:
            return
        try:
            self._sink.refused(
                abort.version, RemoteError(f"the sender gave up on version {abort.version}: {abort.reason}")
            )
        except Exception:  # the sink failing here must not hide the sender's reason
            log.exception("sink.refused raised")

    def _refuse(self, offer: Offer, error: BaseException) -> None:
        """Tell the sink that `offer` was refused before its sync began (a consumer waiting for
        its version stops waiting). An adapter's offer was never the base weights' sync."""
        if offer.adapter is not None:
            return
        try:
            self._sink.refused(offer.version, error)
        except Exception:  # the sink failing here must not hide the refusal
            log.exception("sink.refused raised")

    def _begin(self, offer: Offer) -> Landing:
        if plan_id(offer.plan) != offer.plan_id:
            raise PlanError("the offer's plan_id does not match its plan")
        if offer.plan_id != self._checked_plan:  # a trainer offers the same plan every step
            check_plan(offer.plan, self._max_bucket_bytes)
            self._checked_plan = offer.plan_id
        if not 0 <= offer.part < max(1, len(offer.plan.parts)):
            raise PlanError(f"the offer carries part {offer.part} of a plan in {len(offer.plan.parts)} parts")
        if offer.plan.parts and (offer.delta_base or offer.adapter is not None):
            raise PlanError("a plan in parts carries neither a patch nor an adapter")
        if offer.verify not in VERIFY_MODES or stricter(check_verify(offer.verify), self._verify) != offer.verify:
            raise NegotiationError(f"receiver requires verify={self._verify!r}; the offer has {offer.verify!r}")
        if offer.delta_base and offer.delta_base != self._base:
            raise NegotiationError(
                f"version {offer.version} is a patch onto content {offer.delta_base}; this receiver holds "
                f"{self._base or 'no version a patch can be applied to'}"
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

    def commit(self, landing: Landing, commit: Commit) -> str:
        """Check what landed against the sender's commit, then commit it to the sink; the
        content digest committed ("" unverified)."""
        try:
            content = self._verified_content(landing, commit)
            with sink_errors("commit"):  # like every other hook: the sink's error fails this sync cleanly
                landing.sink.commit(commit.version)
        except BaseException as exc:
            self._finish_abort(landing, exc)
            raise
        if self._adapter(landing):
            self._set(last_error="")
            self._release()
            return content
        self._base = content if landing.patchable else ""
        mode = "delta" if landing.delta else "full"
        self._set(state="ready", version=commit.version, content_digest=content, last_error="", mode=mode)
        self._release()
        return content

    def _commit_part(self, landing: Landing, commit: Commit, part: int) -> str:
        """Part `part` of a sharded sync landed and its sender asked to commit: the last part to
        get here commits the sync (`commit`); the others wait for it (bounded), and fail if it
        did not commit. Returns the content digest committed ("" unverified)."""
        with self._joining:
            parts = self._parts
            if parts is None or parts.landing is not landing:
                raise SinkError(f"version {commit.version}: the sync of this part ended already")
            parts.committed.add(part)
            parts.shares[part] = commit.shares
            last = parts.complete
            if not last and not self._joining.wait_for(lambda: parts.ended, self._timeout):
                missing = sorted(set(range(len(parts.offer.plan.parts))) - parts.committed)
                raise TransferTimeout(f"version {commit.version}: parts {missing} did not land in time")
        if not last:
            if parts.error is not None:
                raise SinkError(f"version {commit.version} did not commit: {parts.error}") from parts.error
            return parts.content
        parts.content = _combined(parts.shares, commit.version)  # read by the other parts once it ended
        return self.commit(
            landing, msgspec.structs.replace(commit, content_digest=parts.content)
        )  # a failure ends the parts too

    def _sender_left(self, part: int | None, transport: str, met: int) -> None:
        """A sender's connection ended between its syncs (its process died, say); `part`: the
        part of a sharded sync it offered last, if any. Each part comes over a connection of its
        own, so a sharded sync in progress that this departure leaves missing more parts than
        there are connected senders yet to offer one cannot complete: it aborts now, not at its
        timeout. With none
        in progress, the next one is refused if the sender of a part of the last one left, unless
        a sender connected after this one's last sync (`met`: the handshakes then), which may
        send that part now, or connects first."""
        with self._joining:
            self._senders_connected -= 1
            parts = self._parts
            if parts is None:
                if part is not None and met == self._senders_met:  # no sender came since: it would wait in vain
                    self._parts_gone.add(part)
                return
            missing = sorted(set(range(len(parts.offer.plan.parts))) - parts.joined)
            free = self._senders_connected - len(parts.joined)  # connected, and yet to offer a part of it
            if not free < len(missing) <= free + 1:  # enough senders are left, or were short already
                return  # (the senders missing then may still connect: only this departure decides)
            landing, version = parts.landing, parts.offer.version
        if part in missing:
            why = f"the sender of part {part} closed its connection before it offered its part"
        else:
            why = f"a sender closed its connection: parts {missing} of the sync cannot come from {free} other senders"
        self.abort(landing, PeerClosedError(why, transport=transport).at(version=version))

    def _verified_content(self, landing: Landing, commit: Commit) -> str:
        if (commit.version, commit.plan_id) != (landing.version, landing.plan_id):
            raise PlanError(f"commit of version {commit.version} does not match the sync of version {landing.version}")
        if not commit.content_digest:
            return ""
        if landing.cut:
            # boxes of tensors, or parts of them from several senders: no whole tensor lands
            # here to hash. Every bucket that crossed a wire was checked against its sender's
            # checksum; the digest is the sender's, of the whole version it pushed.
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

    def abort(self, landing: Landing, error: BaseException) -> None:
        """The sync of `landing` failed with `error` (nothing happens if it ended already)."""
        if landing is self._landing:
            self._finish_abort(landing, error)

    def _release(self, error: BaseException | None = None) -> None:
        """The sync in progress ended (with `error`, if it failed): the parts waiting for it
        hear how, and another sync may begin."""
        with self._joining:
            parts, self._parts = self._parts, None
            if parts is not None:
                parts.ended, parts.error = True, error
            if error is not None and self._landing is not None:
                self._landing.fail(error)  # the other parts' threads stop landing
            self._landing = None
            self._joining.notify_all()
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
