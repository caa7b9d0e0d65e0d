"""The one exception tree of weightsync: every class weightsync defines lives here.

::

    WeightSyncError                             root: every error weightsync raises derives from it
      ConfigError(WeightSyncError, ValueError)  bad configuration or arguments, raised at build time
      ResourceError                             a runtime resource cannot be had: a port, shared memory, a process
      RequestError(WeightSyncError, ValueError) a rollout server refuses a request as invalid (HTTP 400)
      NegotiationError                          sender and receivers cannot agree (bucket size, protocol)
      PlanError                                 a plan is malformed or does not match the receiving side
      TransportError                            moving bytes failed; .transport, .version, .bucket
        ConnectError                            could not reach a peer
        TransferTimeout                         a wait ran past its timeout
        PeerClosedError                         the peer closed the connection or died
        ProtocolError                           malformed frame, unexpected message or wire-version skew
        CollectiveError                         a process group broke (a member died, stalled or never joined)
        ChecksumError                           a bucket's landed bytes do not match the sender's checksum
      AuthError                                 a peer could not prove it holds the shared auth token
      SinkError                                 the sink (engine) refused or failed to load weights
      RemoteError                               failure reported by the peer; .kind is the peer's error class
      SyncFailed                                a push did not commit on every receiver; .report
      ServerError                               a rollout server answered an error status or was unreachable; .status
      BenchError(WeightSyncError, RuntimeError) a benchmark's receiver process failed or stopped answering

docs/errors.md draws the same tree, and tests/unit/test_errors.py checks that the two drawings,
`__all__` and the classes agree. `one_line`, the one way an error is put on one line (a report's
summary, `SyncFailed`'s message, the command's stderr), lives here too, outside `__all__`.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AuthError",
    "BenchError",
    "ChecksumError",
    "CollectiveError",
    "ConfigError",
    "ConnectError",
    "NegotiationError",
    "PeerClosedError",
    "PlanError",
    "ProtocolError",
    "RemoteError",
    "RequestError",
    "ResourceError",
    "ServerError",
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


class ResourceError(WeightSyncError):
    """A runtime resource cannot be had: a port to listen on, shared memory to reserve, memory for
    a run, a process or server that should have started. The arguments were valid; the machine
    could not honour them now."""


class RequestError(WeightSyncError, ValueError):
    """A rollout server refuses a request as invalid (answered with HTTP 400): an empty prompt,
    token ids outside the vocabulary, a prompt longer than the model's context, a duplicate id."""


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

    Where it happened travels on the error: whoever raises it says what it knows, and the sync
    loop it passes through fills in the version and bucket (`at`).
    """

    def __init__(
        self,
        message: str,
        *,
        transport: str = "",
        version: int | None = None,
        bucket: int | None = None,
    ) -> None:
        super().__init__(message)
        self.detail = message
        self.transport = transport
        self.version = version
        self.bucket = bucket

    def at(self, *, version: int | None = None, bucket: int | None = None) -> TransportError:
        """Say where it happened, as the loop that catches it knows, unless the raiser did."""
        self.version = self.version if self.version is not None else version
        self.bucket = self.bucket if self.bucket is not None else bucket
        return self

    def __str__(self) -> str:
        where = [f"{key}={value}" for key, value in self._where() if value not in ("", None)]
        return f"{self.detail} ({', '.join(where)})" if where else self.detail

    def _where(self) -> tuple[tuple[str, object], ...]:
        return ("transport", self.transport), ("version", self.version), ("bucket", self.bucket)

    def __reduce__(self) -> tuple[Any, ...]:  # picklable with where it happened
        return type(self), (self.detail,), dict(self._where())


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

    def __reduce__(self) -> tuple[Any, ...]:  # picklable: Ray and multiprocessing carry it to the caller
        return type(self), (self.args[0], self.report)


class ServerError(WeightSyncError):
    """A rollout server answered with an error status, or no weightsync server answered (`status` 0).

    Attributes:
        status: the HTTP status, or 0 when no weightsync answer came (connection refused, a
            timeout, a body that is not a JSON object).
        body: the server's answer (parsed JSON, or text), or what went wrong when none came.
    """

    def __init__(self, status: int, body: Any) -> None:
        message = body.get("error", {}).get("message") if isinstance(body, dict) and "error" in body else body
        super().__init__(f"HTTP {status}: {message}" if status else str(message))
        self.status = status
        self.body = body

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.status, self.body)


class BenchError(WeightSyncError, RuntimeError):
    """A benchmark's receiver process failed, died or stopped answering."""


def one_line(error: BaseException | str) -> str:
    """An error's message on one line: a message of several lines (a peer's traceback) keeps its
    first and last (where the peer's error is named); an empty one is the error's class name."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__ if isinstance(error, BaseException) else ""
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
