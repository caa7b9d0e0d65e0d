"""The one exception tree of weightsync.

::

    WeightSyncError
      ConfigError(WeightSyncError, ValueError)  bad configuration or arguments, raised at build time
      NegotiationError                          sender and receivers cannot agree (bucket size, protocol)
      PlanError                                 a plan is malformed or does not match the receiving side
      TransportError                            moving bytes failed; carries transport, version, bucket
        ConnectError                            could not reach a peer
        TransferTimeout                         a wait ran past its timeout
        PeerClosedError                         the peer closed the connection or died
        ProtocolError                           malformed frame, unexpected message or wire-version skew
        CollectiveError                         a process group broke (a member died or stalled)
      SinkError                                 the sink (engine) refused or failed to load weights
      RemoteError                               failure reported by the peer, with its message
      SyncFailed                                a push did not commit on every receiver
"""

from __future__ import annotations

__all__ = [
    "CollectiveError",
    "ConfigError",
    "ConnectError",
    "NegotiationError",
    "PeerClosedError",
    "PlanError",
    "ProtocolError",
    "RemoteError",
    "SinkError",
    "SyncFailed",
    "TransferTimeout",
    "TransportError",
    "WeightSyncError",
]


class WeightSyncError(Exception):
    """Root of every error weightsync raises."""


class ConfigError(WeightSyncError, ValueError):
    """A configuration value or argument is invalid."""


class NegotiationError(WeightSyncError):
    """Sender and receivers could not agree on the terms of a sync."""


class PlanError(WeightSyncError):
    """A transfer plan is malformed or does not fit the receiving side."""


class TransportError(WeightSyncError):
    """Moving bytes between peers failed.

    Attributes:
        transport: name of the transport ("shm", "tcp", ...), or "" if unknown.
        version: weight version being synced, or None outside a sync.
        bucket: index of the bucket in flight, or None outside the bucket loop.
    """

    def __init__(
        self,
        message: str,
        *,
        transport: str = "",
        version: int | None = None,
        bucket: int | None = None,
    ) -> None:
        where = []
        if transport:
            where.append(f"transport={transport}")
        if version is not None:
            where.append(f"version={version}")
        if bucket is not None:
            where.append(f"bucket={bucket}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.transport = transport
        self.version = version
        self.bucket = bucket


class ConnectError(TransportError):
    """A peer could not be reached."""


class TransferTimeout(TransportError):
    """A wait on a peer ran past its timeout."""


class PeerClosedError(TransportError):
    """The peer closed the connection, or its process died."""


class ProtocolError(TransportError):
    """A frame was malformed, unexpected, or from another wire version."""


class CollectiveError(TransportError):
    """A collective (a bucket down the chain, group set-up) failed: a member of the process group died,
    stalled past the timeout, or could not join. The group is rebuilt on the next sync."""


class ChecksumError(TransportError):
    """A bucket's bytes, as landed, do not match the checksum the sender computed (verify="bucket")."""


class AuthError(WeightSyncError):
    """A peer could not prove it holds the shared auth token (or we hold none and it asked)."""


class SinkError(WeightSyncError):
    """The sink refused or failed to load the weights."""


class RemoteError(WeightSyncError):
    """The peer reported a failure; the message is the peer's.

    Attributes:
        kind: the class name of the error the peer raised (e.g. "PlanError"), or "" if unknown.
    """

    def __init__(self, message: str, *, kind: str = "") -> None:
        super().__init__(message)
        self.kind = kind


class SyncFailed(WeightSyncError):
    """A push did not commit on every receiver; `report` says which failed and why."""

    def __init__(self, message: str, report: object) -> None:
        super().__init__(message)
        self.report = report
