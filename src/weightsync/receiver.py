"""The receiving end: listens from construction on, lands each sync into a sink, and commits a
version only when every byte of it has arrived.

State machine (one sync at a time)::

    empty --begin--> syncing --commit--> ready --begin--> syncing ...
                        |
                        +--abort--> previous state, when no live byte was touched
                        +--abort--> dirty (version None), when live weights were partly written
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
from typing import Any

from weightsync.auth import check_bind, new_nonce, proof, proof_matches, resolve_token
from weightsync.checksum import VERIFY_MODES, check_verify, content_digest, stricter
from weightsync.errors import AuthError, ChecksumError, ConfigError, NegotiationError, PlanError
from weightsync.plan import check_plan, plan_digest
from weightsync.sink import Landing, WeightSink, as_sink, sink_errors
from weightsync.sizing import DEFAULT_MEMORY_BUDGET_BYTES, align_down, parse_bucket_bytes
from weightsync.transports import RECEIVERS
from weightsync.types import PROTOCOL_VERSION, Auth, Commit, Message, Offer, Welcome

__all__ = ["WeightReceiver"]

log = logging.getLogger(__name__)


class WeightReceiver:
    """Receives weights pushed by a `WeightSender` and hands them to a sink.

    Args:
        sink: a `WeightSink`, a mapping of destination tensors (written in place), or a callable
            taking a list of (name, tensor) pairs.
        transport: "shm", "tcp", "collective", "cudaipc" (both processes on CUDA) or "inproc".
        host: interface to listen on (tcp, collective); loopback by default.
        port: port to listen on (tcp, collective); 0 picks a free one.
        max_bucket_bytes: the largest bucket this side accepts, or "auto" for half the budget.
        memory_budget_bytes: what this side may spend on transfer buffers.
        timeout: seconds any wait inside a sync may last before the sync is aborted.
        verify: the weakest verification this receiver accepts: "off" or "bucket" (each bucket
            checksummed by the sender, checked here before its tensors reach the sink).
        auth_token: a shared secret senders must prove they hold (HMAC challenge; the token is
            never sent). Default: $WEIGHTSYNC_AUTH_TOKEN, else none. Required to listen on a
            non-loopback interface.
    """

    def __init__(
        self,
        sink: Any,
        transport: str = "shm",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_bucket_bytes: int | str = "auto",
        memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
        timeout: float = 60.0,
        verify: str = "off",
        auth_token: str | None = None,
    ) -> None:
        if transport not in RECEIVERS:
            raise ConfigError(f"unknown transport {transport!r}; expected one of {sorted(RECEIVERS)}")
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if not isinstance(memory_budget_bytes, int) or memory_budget_bytes < 128:
            raise ConfigError(f"memory_budget_bytes must be an integer >= 128, got {memory_budget_bytes!r}")
        self._verify = check_verify(verify)
        self._token = resolve_token(auth_token)
        if transport in ("tcp", "collective"):
            check_bind(host, self._token, f"a {transport} weight receiver")
        self._sink: WeightSink = as_sink(sink)
        self._max_bucket_bytes = parse_bucket_bytes(max_bucket_bytes, "max_bucket_bytes") or align_down(
            memory_budget_bytes // 2
        )
        self._id = secrets.token_hex(4)
        self._busy = threading.Lock()
        self._changed = threading.Condition()
        self._version: int | None = None
        self._state = "empty"
        self._state_before_sync = "empty"
        self._last_error = ""
        self._content_digest = ""
        self._transport = RECEIVERS[transport](self, host=host, port=port, timeout=float(timeout))
        self._transport.start()

    @property
    def address(self) -> str:
        """Where a sender connects: "shm://@...", "tcp://127.0.0.1:PORT" or "inproc://..."."""
        return self._transport.address

    @property
    def version(self) -> int | None:
        """The last committed weight version the sink holds intact, or None."""
        return self._version

    @property
    def state(self) -> str:
        """ "empty", "syncing", "ready" or "dirty" (a failed sync partly overwrote live weights)."""
        return self._state

    @property
    def content_digest(self) -> str:
        """The content digest of the committed version when its sync was verified, else ""."""
        return self._content_digest

    @property
    def last_error(self) -> str:
        """Why the last sync failed, or "" if it committed."""
        return self._last_error

    def wait_for_version(self, version: int, timeout: float) -> bool:
        """Block until `version` (or a later one) is committed; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self._version is not None and self._version >= version, timeout)

    # --- driven by the transport ----------------------------------------------------------------

    @property
    def auth_required(self) -> bool:
        """True when senders must prove they hold this receiver's token."""
        return self._token is not None

    def welcome(self, sender_nonce: str = "") -> Welcome:
        """Our Welcome, with a fresh challenge and, if we hold a token, our answer to the sender's."""
        answer = proof(self._token, "receiver", sender_nonce) if self._token and sender_nonce else ""
        return Welcome(
            PROTOCOL_VERSION, self._id, self._max_bucket_bytes, self._version, self._verify, new_nonce(), answer
        )

    def authenticate(self, welcome: Welcome, message: Message) -> bool:
        """Check the sender's first message after `welcome`. True if it was the sender's `Auth`
        (consumed), False if it is an ordinary message; AuthError if we hold a token and the
        sender did not prove it holds it too."""
        if self._token is None:
            return isinstance(message, Auth)
        if not isinstance(message, Auth) or not proof_matches(self._token, "sender", welcome.nonce, message.proof):
            raise AuthError("the sender did not prove it holds this receiver's auth token")
        return True

    def begin(self, offer: Offer) -> Landing:
        if not self._busy.acquire(blocking=False):
            raise NegotiationError(f"receiver is busy with another sync; version {offer.version} refused")
        try:
            check_plan(offer.plan, self._max_bucket_bytes)
            if plan_digest(offer.plan) != offer.digest:
                raise PlanError("plan digest does not match the plan")
            if offer.verify not in VERIFY_MODES or stricter(offer.verify, self._verify) != offer.verify:
                raise NegotiationError(f"receiver requires verify={self._verify!r}; the offer has {offer.verify!r}")
            with sink_errors("begin"):
                self._sink.begin(offer.plan, offer.version)
            try:
                landing = Landing(offer.plan, self._sink, offer.version, offer.digest, offer.verify)
            except BaseException as exc:  # the sink began: it must hear that the sync is off
                with contextlib.suppress(Exception):
                    self._sink.abort(offer.version, exc)
                raise
        except BaseException as exc:
            # A refused plan is a failed sync too: say why (state and version stay as they were).
            self._last_error = f"sync of version {offer.version} failed: {exc}"
            self._busy.release()
            raise
        self._state_before_sync = self._state
        self._set_state("syncing")
        return landing

    def commit(self, landing: Landing, commit: Commit) -> None:
        try:
            if (commit.version, commit.digest) != (landing.version, landing.digest):
                raise PlanError(
                    f"commit of version {commit.version} does not match the sync of version {landing.version}"
                )
            content = ""
            if commit.content:
                if len(landing.checksums) != len(landing.plan.buckets):
                    raise ChecksumError(
                        f"commit of version {commit.version} has a content digest, the buckets had none"
                    )
                content = content_digest(landing.digest, landing.checksums)
                if content != commit.content:
                    raise ChecksumError(f"version {commit.version}: content digest differs from the sender's")
                if landing.verify == "full":
                    landing.check_tensors(commit.tensors)
            with sink_errors("commit"):  # like every other hook: the sink's error fails this sync cleanly
                self._sink.commit(commit.version)
        except BaseException as exc:
            self._finish_abort(landing, exc)
            raise
        self._last_error = ""
        self._content_digest = content
        self._set_state("ready", commit.version)
        self._busy.release()

    def abort(self, landing: Landing, error: BaseException) -> None:
        if self._busy.locked():
            self._finish_abort(landing, error)

    def _finish_abort(self, landing: Landing, error: BaseException) -> None:
        try:
            self._sink.abort(landing.version, error)
        except Exception:  # the sink failing to abort must not hide the original error
            log.exception("sink.abort raised")
        self._last_error = f"sync of version {landing.version} failed: {error}"
        log.warning("%s", self._last_error)
        if landing.touched_live or self._sink.wrote_live:
            self._content_digest = ""
            self._set_state("dirty", None)
        else:
            self._set_state(self._state_before_sync)
        self._busy.release()

    def _set_state(self, state: str, version: int | None | type[Ellipsis] = ...) -> None:
        with self._changed:
            self._state = state
            if version is not ...:
                self._version = version  # type: ignore[assignment]
            self._changed.notify_all()

    # --- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop listening and release buffers. A sync in flight is aborted."""
        self._transport.close()

    def __enter__(self) -> WeightReceiver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"WeightReceiver({self.address!r}, state={self._state!r}, version={self._version})"
