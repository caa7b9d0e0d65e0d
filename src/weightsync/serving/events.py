"""What vLLM's worker tells the API process about a sync: a closed set of typed messages.

Each worker's sink (worker.py) rings the doorbell (doorbell.py) with one of
these, naming its rank; the API process (control.py) decodes exactly these types and nothing
else, and answers with a `Reply`. JSON on the socket (msgspec tagged structs), so a message is a
value with a schema, never a dict.

    Begin   a push reached this worker and its plan fits the model; `park`: open vLLM's update
            window now (a staged sync opens it at its commit, with Park)
    Park    a staged sync's transfer is done: open the window now
    Commit  this worker landed the version; answered once every worker's outcome is in: ok when
            all landed it and vLLM labelled it, else refused (the worker's commit then fails)
    Abort   this worker failed the sync; `intact`: nothing of it reached vLLM's weights here
    Status  this worker's receiver changed state (for /health, /weight_info and the metrics)

    AdapterLanded  this worker holds a LoRA adapter's version in memory, as vLLM's LoRA id
                   `lora_id`; answered once every worker's outcome is in: ok when the server
                   serves it from now on, else refused (the worker drops it)
    AdapterFailed  this worker failed an adapter's sync
"""

from __future__ import annotations

from typing import Literal

import msgspec

from weightsync.messages import Adapter, SyncTimes
from weightsync.receiver import ReceiverState

__all__ = [
    "Abort",
    "AdapterFailed",
    "AdapterLanded",
    "Begin",
    "Commit",
    "Park",
    "Reply",
    "Status",
    "SyncEvent",
    "event_name",
]


class Begin(msgspec.Struct, frozen=True, kw_only=True, tag="begin"):
    version: int
    rank: int = 0
    total_bytes: int = 0
    bucket_bytes: int = 0
    park: bool = False


class Park(msgspec.Struct, frozen=True, kw_only=True, tag="park"):
    version: int
    rank: int = 0


class Commit(msgspec.Struct, frozen=True, kw_only=True, tag="commit"):
    version: int
    rank: int = 0


class Abort(msgspec.Struct, frozen=True, kw_only=True, tag="abort"):
    version: int
    rank: int = 0
    intact: bool
    error: str = ""


class Status(msgspec.Struct, frozen=True, kw_only=True, tag="status"):
    """A worker's `ReceiverStatus`, as the API process keeps it."""

    rank: int = 0
    state: ReceiverState = "empty"
    receiver_version: int | None = None
    content_digest: str = ""
    last_error: str = ""
    times: SyncTimes | None = None
    mode: Literal["full", "delta"] | None = None


class AdapterLanded(msgspec.Struct, frozen=True, kw_only=True, tag="adapter_landed"):
    adapter: Adapter
    version: int
    rank: int = 0
    lora_id: int
    path: str
    """The `lora_path` vLLM's requests for it carry (internals.MEMORY_SCHEME)."""
    content_digest: str = ""


class AdapterFailed(msgspec.Struct, frozen=True, kw_only=True, tag="adapter_failed"):
    name: str
    version: int
    rank: int = 0
    error: str = ""


SyncEvent = Begin | Park | Commit | Abort | Status | AdapterLanded | AdapterFailed
"""Every message the worker may send."""


class Reply(msgspec.Struct, frozen=True, kw_only=True):
    """The API process's answer: `ok`, or why not (the worker fails the sync with `error`)."""

    ok: bool
    error: str = ""
    retired: tuple[int, ...] = ()
    """(to `AdapterLanded`) LoRA ids of adapter versions no request runs on any more, which the
    server no longer serves: a worker drops those it holds."""


def event_name(event: SyncEvent) -> str:
    """The event's tag ("begin", "commit", ...), for messages."""
    return type(event).__name__.lower()
