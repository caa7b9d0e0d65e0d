"""The sending end: plans a sync, moves it bucket by bucket to every receiver, and reports.

    source (named tensors) -> plan (buckets, chunks) -> transport (bytes) -> sink (engine loader)

`push` is the one orchestration loop; it reads top to bottom: connect, agree on a bucket size,
plan, offer, send buckets, commit, report.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from weightsync.auth import resolve_token
from weightsync.checksum import check_verify, content_digest, stricter
from weightsync.dtypes import dtype_from_name
from weightsync.errors import ConfigError, NegotiationError, PlanError, RemoteError, SyncFailed
from weightsync.plan import build_plan, plan_digest, tensor_nbytes, wire_specs
from weightsync.sizing import (
    ALIGN_BYTES,
    DEFAULT_MEMORY_BUDGET_BYTES,
    align_up,
    auto_bucket_bytes,
    negotiate_bucket_bytes,
    parse_bucket_bytes,
)
from weightsync.source import TensorMeta, as_source
from weightsync.transports import SENDERS, BucketItem, Peer, SenderTransport, check_address, scheme_of
from weightsync.types import Abort, Commit, Offer, Plan, ReceiverOutcome, SyncReport

__all__ = ["WeightSender", "bucket_items"]

log = logging.getLogger(__name__)


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
        timeout: seconds any wait may last; a receiver that exceeds it is failed, not waited on.
        num_slots: shared-memory ring slots (2 lets packing overlap unpacking).
        raise_on_failure: raise `SyncFailed` from `push` if any receiver did not commit.
        verify: "off" or "bucket": checksum every bucket (xxh3-64) for the receivers to check.
            A receiver may require "bucket"; the strictest side wins.
        auth_token: the shared secret of receivers that require one (default:
            $WEIGHTSYNC_AUTH_TOKEN). Proven by HMAC, never sent; with a token, the sender also
            requires each receiver to prove it holds the same one.
    """

    def __init__(
        self,
        addresses: Sequence[str] | str,
        *,
        bucket_bytes: int | str = "auto",
        min_bucket_bytes: int = ALIGN_BYTES,
        memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
        cast: torch.dtype | Mapping[str, torch.dtype] | None = None,
        timeout: float = 60.0,
        num_slots: int = 2,
        raise_on_failure: bool = False,
        verify: str = "off",
        auth_token: str | None = None,
    ) -> None:
        addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        if not addresses or len(set(addresses)) != len(addresses):
            raise ConfigError(f"need one or more distinct receiver addresses, got {addresses!r}")
        for address in addresses:
            check_address(address)
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if not isinstance(min_bucket_bytes, int) or min_bucket_bytes < 1:
            raise ConfigError(f"min_bucket_bytes must be a positive integer, got {min_bucket_bytes!r}")
        if not isinstance(memory_budget_bytes, int) or memory_budget_bytes < 128:
            raise ConfigError(f"memory_budget_bytes must be an integer >= 128, got {memory_budget_bytes!r}")
        self._bucket_bytes = parse_bucket_bytes(bucket_bytes)
        self._min_bucket_bytes = min_bucket_bytes
        self._memory_budget_bytes = memory_budget_bytes
        self._num_slots = num_slots
        self._cast = cast
        self._raise_on_failure = raise_on_failure
        self._verify = check_verify(verify)
        token = resolve_token(auth_token)
        self._peers = [Peer(address) for address in addresses]
        self._transports: list[SenderTransport] = []
        for scheme in dict.fromkeys(scheme_of(address) for address in addresses):
            peers = [peer for peer in self._peers if scheme_of(peer.address) == scheme]
            options: dict[str, Any] = {"num_slots": num_slots} if scheme in ("shm", "cudaipc") else {}
            if scheme != "inproc":
                options["auth_token"] = token
            self._transports.append(SENDERS[scheme](peers, float(timeout), **options))

    @property
    def addresses(self) -> list[str]:
        return [peer.address for peer in self._peers]

    def push(self, tensors: Any, version: int) -> SyncReport:
        """Send `tensors` to every receiver as weight version `version`.

        Args:
            tensors: a mapping name -> tensor, an iterable of (name, tensor) pairs, or a
                `WeightSource` (for tensors produced one at a time).
            version: the weight version receivers will report once committed.

        Returns:
            A SyncReport; `report.ok` is True when every receiver committed.

        Raises:
            ConfigError: bad arguments (nothing was sent).
            PlanError: the source yielded a tensor that does not match its metadata (the sync
                is aborted on every receiver).
            SyncFailed: some receiver did not commit and `raise_on_failure` is set.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ConfigError(f"version must be a non-negative integer, got {version!r}")
        source = as_source(tensors)
        metas = source.metas()
        specs = wire_specs(metas, self._cast)
        started = time.perf_counter()
        for peer in self._peers:
            peer.committed = False
        for transport in self._transports:
            transport.connect()

        plan = build_plan(specs, self._agree_bucket_bytes(max((tensor_nbytes(s) for s in specs), default=0)))
        digest = plan_digest(plan)
        # the strictest verification any receiver asks for, or ours if stricter
        verify = stricter(self._verify, *(p.welcome.verify for p in self._peers if p.alive and p.welcome))
        for transport in self._transports:
            transport.offer(Offer(version, plan, digest, verify))
        try:
            self._send_buckets(plan, metas, source.tensors())
        except BaseException as exc:
            for transport in self._transports:
                transport.abort(Abort(version, f"sender failed: {exc}"))
            raise
        contents = [
            content_digest(digest, t.checksums) if len(t.checksums) == len(plan.buckets) else ""
            for t in self._transports
        ]
        for transport, content in zip(self._transports, contents, strict=True):
            transport.commit(Commit(version, digest, content, transport.tensor_digests if content else ()))

        report = SyncReport(
            version=version,
            total_bytes=plan.total_bytes,
            num_tensors=len(plan.tensors),
            num_buckets=len(plan.buckets),
            bucket_bytes=plan.bucket_bytes,
            seconds=time.perf_counter() - started,
            outcomes=tuple(_outcome(peer) for peer in self._peers),
            content_digest=next((content for content in contents if content), ""),
        )
        log.info(
            "pushed version %d: %d bytes in %.3f s (%.2f GB/s), %d/%d receivers committed",
            version,
            report.total_bytes,
            report.seconds,
            report.gbps,
            len(report.outcomes) - len(report.failed),
            len(report.outcomes),
        )
        if self._raise_on_failure and not report.ok:
            raise SyncFailed("; ".join(f"{o.address}: {o.kind}: {o.error}" for o in report.failed), report)
        return report

    def _agree_bucket_bytes(self, largest_tensor_bytes: int) -> int:
        """Negotiate one bucket size; receivers that cannot afford the minimum are failed."""
        proposed = self._bucket_bytes or auto_bucket_bytes(
            largest_tensor_bytes, memory_budget_bytes=self._memory_budget_bytes, num_slots=self._num_slots
        )
        # The sender's own minimum bounds its proposal too: "auto" sized from small tensors
        # must not propose less than it then requires.
        proposed = max(proposed, ALIGN_BYTES, align_up(self._min_bucket_bytes))
        for peer in self._peers:
            if peer.alive and peer.welcome is not None and peer.welcome.max_bucket_bytes < self._min_bucket_bytes:
                peer.error = NegotiationError(
                    f"receiver {peer.address} accepts buckets of at most {peer.welcome.max_bucket_bytes} bytes, the sender requires at least {self._min_bucket_bytes}"
                )
        limits = {p.address: p.welcome.max_bucket_bytes for p in self._peers if p.alive and p.welcome is not None}
        return negotiate_bucket_bytes(proposed, limits, self._min_bucket_bytes) if limits else proposed

    def _send_buckets(self, plan: Plan, metas: list[TensorMeta], tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        for index, items in bucket_items(plan, metas, tensors):
            if not any(transport.live() for transport in self._transports):
                return  # every receiver failed: nothing left to send to
            for transport in self._transports:
                if transport.live():
                    transport.send_bucket(index, items)

    def close(self) -> None:
        """Close connections and release shared-memory buckets."""
        for transport in self._transports:
            transport.close()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def bucket_items(
    plan: Plan, metas: list[TensorMeta], tensors: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[int, list[BucketItem]]]:
    """Each bucket's pieces with the source tensors they are cut from, consuming the source
    lazily and in plan order (a tensor is taken from it when its first piece is due)."""
    current: tuple[int, torch.Tensor] | None = None
    num_pieces = Counter(piece.tensor for bucket in plan.buckets for piece in bucket)
    for index, bucket in enumerate(plan.buckets):
        items = []
        for piece in bucket:
            if current is None or current[0] != piece.tensor:
                tensor = _next_tensor(tensors, metas[piece.tensor])
                if num_pieces[piece.tensor] > 1 and not tensor.is_contiguous():
                    tensor = tensor.contiguous()  # once per tensor, not once per chunk
                current = (piece.tensor, tensor)
            items.append(BucketItem(piece, current[1], dtype_from_name(plan.tensors[piece.tensor].dtype)))
        yield index, items


def _next_tensor(tensors: Iterator[tuple[str, torch.Tensor]], meta: TensorMeta) -> torch.Tensor:
    try:
        name, tensor = next(tensors)
    except StopIteration:
        raise PlanError(f"source ended before yielding {meta.name!r}") from None
    if name != meta.name or tuple(tensor.shape) != meta.shape or tensor.dtype != meta.dtype:
        raise PlanError(
            f"source yielded {name!r} {tensor.dtype}{list(tensor.shape)} where its metadata promised {meta.name!r} {meta.dtype}{list(meta.shape)}"
        )
    return tensor


def _outcome(peer: Peer) -> ReceiverOutcome:
    if peer.committed:
        return ReceiverOutcome(peer.address, True)
    error = peer.error
    if error is None:
        return ReceiverOutcome(peer.address, False, "WeightSyncError", "the sync ended before this receiver committed")
    kind = error.kind if isinstance(error, RemoteError) and error.kind else type(error).__name__
    return ReceiverOutcome(peer.address, False, kind, str(error))
