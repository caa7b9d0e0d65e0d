"""What a worker tells its server's sync control about a sync: a closed set of typed messages,
the same for every engine.

Each worker's `ControlledSink` (sink.py) rings the control with one of these, naming its rank: in
process (the transformers engine), or through the doorbell (doorbell.py: the workers of vLLM and
SGLang, JSON on a Unix socket, msgspec tagged structs, so a message is a value with a schema,
never a dict). The
control (serving/control.py) takes exactly these types and nothing else, and answers with a `Reply`. They
are not the wire's messages (messages.py), which a sender and a receiver exchange.

    PushArrived      a push reached this worker and its plan fits the model; `park`: open the
                     engine's update window now (a staged sync opens it at its commit, with
                     TransferDone)
    TransferDone     a staged sync's transfer is done: open the window now
    VersionLanded    this worker landed the version; answered once every worker's outcome is in:
                     ok when all landed it and the engine labelled it, else refused (the worker's
                     commit then fails)
    VersionFailed    this worker failed the sync; `intact`: nothing of it reached the served
                     weights here
    ReceiverChanged  this worker's receiver changed state (for /health, /weight_info and the metrics)

    AdapterLanded    this worker holds a LoRA adapter's version in memory, as the engine's LoRA id
                     `lora_id`; answered once every worker's outcome is in: ok when the server
                     serves it from now on, else refused (the worker drops it)
    AdapterFailed    this worker failed an adapter's sync
"""

from __future__ import annotations

from typing import Literal

import msgspec

from weightsync.messages import Adapter, SyncTimes
from weightsync.receiver import ReceiverState

__all__ = [
    "VersionFailed",
    "AdapterFailed",
    "AdapterLanded",
    "PushArrived",
    "VersionLanded",
    "TransferDone",
    "Reply",
    "ReceiverChanged",
    "SyncEvent",
    "event_name",
]


class PushArrived(msgspec.Struct, frozen=True, kw_only=True, tag="push_arrived"):
    version: int
    rank: int = 0
    total_bytes: int = 0
    bucket_bytes: int = 0
    park: bool = False


class TransferDone(msgspec.Struct, frozen=True, kw_only=True, tag="transfer_done"):
    version: int
    rank: int = 0


class VersionLanded(msgspec.Struct, frozen=True, kw_only=True, tag="version_landed"):
    version: int
    rank: int = 0


class VersionFailed(msgspec.Struct, frozen=True, kw_only=True, tag="version_failed"):
    version: int
    rank: int = 0
    intact: bool
    error: str = ""


class ReceiverChanged(msgspec.Struct, frozen=True, kw_only=True, tag="receiver_changed"):
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


SyncEvent = PushArrived | TransferDone | VersionLanded | VersionFailed | ReceiverChanged | AdapterLanded | AdapterFailed
"""Every message the worker may send."""


class Reply(msgspec.Struct, frozen=True, kw_only=True):
    """The API process's answer: `ok`, or why not (the worker fails the sync with `error`)."""

    ok: bool
    error: str = ""
    retired: tuple[int, ...] = ()
    """(to `AdapterLanded`) LoRA ids of adapter versions no request runs on any more, which the
    server no longer serves: a worker drops those it holds."""


def event_name(event: SyncEvent) -> str:
    """The event's tag ("push_arrived", "version_landed", ...), for messages."""
    return str(type(event).__struct_config__.tag)
