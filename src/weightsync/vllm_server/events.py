"""What vLLM's worker tells the API process about a sync: a closed set of typed messages.

The worker's sink (worker.py) rings the doorbell (doorbell.py) with one of these; the API process
(control.py) decodes exactly these types and nothing else, and answers with a `Reply`. JSON on
the socket (msgspec tagged structs), so a message is a value with a schema, never a dict.

    Begin   a sync starts; `park`: pause generation first (a staged sync parks at its commit)
    Park    a staged sync's commit: pause now
    Commit  the version is in vLLM's weights: label it and resume
    Abort   the sync failed; `intact`: the served weights are still the previous version
    Status  the receiver's state changed (for /health, /weight_info and the metrics)
"""

from __future__ import annotations

from typing import Literal

import msgspec

from weightsync.receiver import ReceiverState
from weightsync.types import SyncTimes

__all__ = ["Abort", "Begin", "Commit", "Park", "Reply", "Status", "SyncEvent", "event_name"]


class Begin(msgspec.Struct, frozen=True, kw_only=True, tag="begin"):
    version: int
    total_bytes: int = 0
    bucket_bytes: int = 0
    park: bool = False


class Park(msgspec.Struct, frozen=True, kw_only=True, tag="park"):
    version: int


class Commit(msgspec.Struct, frozen=True, kw_only=True, tag="commit"):
    version: int


class Abort(msgspec.Struct, frozen=True, kw_only=True, tag="abort"):
    version: int
    intact: bool
    error: str = ""


class Status(msgspec.Struct, frozen=True, kw_only=True, tag="status"):
    """The worker's `ReceiverStatus`, as the API process keeps it."""

    state: ReceiverState = "empty"
    receiver_version: int | None = None
    content_digest: str = ""
    last_error: str = ""
    times: SyncTimes | None = None
    mode: Literal["full", "delta"] | None = None


SyncEvent = Begin | Park | Commit | Abort | Status
"""Every message the worker may send."""


class Reply(msgspec.Struct, frozen=True, kw_only=True):
    """The API process's answer: `ok`, or why not (the worker fails the sync with `error`)."""

    ok: bool
    error: str = ""


def event_name(event: SyncEvent) -> str:
    """The event's tag ("begin", "commit", ...), for messages."""
    return type(event).__name__.lower()
