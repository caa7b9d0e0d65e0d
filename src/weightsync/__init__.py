"""weightsync: move model weights from an RL trainer to rollout engines, bucket by bucket.

source (named tensors) -> plan (buckets, chunks) -> transport (bytes) -> sink (engine loader)
"""

from __future__ import annotations

from weightsync.engines.hf_config import min_bucket_bytes
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
    SinkError,
    SyncFailed,
    TransferTimeout,
    TransportError,
    WeightSyncError,
)
from weightsync.fleet import RolloutFleet
from weightsync.module_source import ModuleSource
from weightsync.plan import build_plan
from weightsync.receiver import WeightReceiver
from weightsync.sender import WeightSender
from weightsync.sink import TensorDictSink, WeightSink
from weightsync.sizing import auto_bucket_bytes
from weightsync.source import StateDictSource, TensorMeta, WeightSource
from weightsync.types import Plan, ReceiverOutcome, SyncReport

__version__ = "0.1.0"

__all__ = [
    "AuthError",
    "ChecksumError",
    "CollectiveError",
    "ConfigError",
    "ConnectError",
    "ModuleSource",
    "NegotiationError",
    "PeerClosedError",
    "Plan",
    "PlanError",
    "ProtocolError",
    "ReceiverOutcome",
    "RemoteError",
    "RolloutFleet",
    "SinkError",
    "StateDictSource",
    "SyncFailed",
    "SyncReport",
    "TensorDictSink",
    "TensorMeta",
    "TransferTimeout",
    "TransportError",
    "WeightReceiver",
    "WeightSender",
    "WeightSink",
    "WeightSource",
    "WeightSyncError",
    "__version__",
    "auto_bucket_bytes",
    "build_plan",
    "min_bucket_bytes",
]
