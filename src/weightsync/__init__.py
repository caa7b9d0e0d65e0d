"""weightsync: move model weights from an RL trainer to rollout engines, bucket by bucket.

source (named tensors) -> plan (buckets, chunks) -> transport (bytes) -> sink (engine loader)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightsync.errors import (
    AuthError,
    ChecksumError,
    CollectiveError,
    ConfigError,
    ConnectError,
    NegotiationError,
    PeerClosedError,
    PlanError,
    ProtocolError,
    RemoteError,
    ResourceError,
    SinkError,
    SyncFailed,
    TransferTimeout,
    TransportError,
    WeightSyncError,
)
from weightsync.hf_checkpoint import HFCheckpointSource
from weightsync.hf_config import min_bucket_bytes
from weightsync.lora import Adapter, AdapterSink, adapter_from_peft
from weightsync.messages import Plan
from weightsync.module_source import ModuleSource
from weightsync.options import ReceiverOptions, SenderOptions
from weightsync.plan import build_plan
from weightsync.receiver import WeightReceiver
from weightsync.report import ReceiverOutcome, SyncReport
from weightsync.sender import WeightSender
from weightsync.sink import SinkTraits, TensorDictSink, WeightSink
from weightsync.sizing import auto_bucket_bytes
from weightsync.source import StateDictSource, TensorMeta, WeightSource
from weightsync.stream import StreamSink, TensorStream

if TYPE_CHECKING:
    from weightsync.cluster.ray_fleet import RolloutFleet

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """`RolloutFleet` lives in weightsync.cluster.ray_fleet and is imported only when asked for."""
    if name == "RolloutFleet":
        from weightsync.cluster.ray_fleet import RolloutFleet

        return RolloutFleet
    raise AttributeError(f"module 'weightsync' has no attribute {name!r}")


__all__ = [
    "Adapter",
    "AdapterSink",
    "AuthError",
    "ChecksumError",
    "CollectiveError",
    "ConfigError",
    "ConnectError",
    "HFCheckpointSource",
    "ModuleSource",
    "NegotiationError",
    "PeerClosedError",
    "Plan",
    "PlanError",
    "ProtocolError",
    "ReceiverOptions",
    "ReceiverOutcome",
    "RemoteError",
    "ResourceError",
    "RolloutFleet",
    "SenderOptions",
    "SinkError",
    "SinkTraits",
    "StateDictSource",
    "StreamSink",
    "SyncFailed",
    "SyncReport",
    "TensorDictSink",
    "TensorMeta",
    "TensorStream",
    "TransferTimeout",
    "TransportError",
    "WeightReceiver",
    "WeightSender",
    "WeightSink",
    "WeightSource",
    "WeightSyncError",
    "__version__",
    "adapter_from_peft",
    "auto_bucket_bytes",
    "build_plan",
    "min_bucket_bytes",
]
