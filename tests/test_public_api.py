"""The public surface: exactly these names, importable without any engine or server stack, and
every argument checked at construction (ConfigError, before any I/O)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import weightsync
from weightsync import ConfigError, ResourceError, WeightReceiver, WeightSender

EXPECTED = [
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


def test_all_is_exactly_the_sorted_public_names():
    assert weightsync.__all__ == EXPECTED
    assert weightsync.__all__ == sorted(weightsync.__all__)
    for name in weightsync.__all__:
        assert hasattr(weightsync, name), name


def test_every_error_derives_from_the_root():
    for name in EXPECTED:
        value = getattr(weightsync, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, weightsync.WeightSyncError), name
    assert issubclass(ConfigError, ValueError)
    for leaf in ("ConnectError", "TransferTimeout", "PeerClosedError", "ProtocolError", "CollectiveError"):
        assert issubclass(getattr(weightsync, leaf), weightsync.TransportError)


def test_import_pulls_in_no_engine_or_server_stack():
    code = (
        "import sys, weightsync\n"
        "heavy = ('vllm', 'ray', 'fastapi', 'uvicorn', 'transformers', 'safetensors')\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & set(heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_version():
    assert isinstance(weightsync.__version__, str) and weightsync.__version__.count(".") == 2


# --- arguments are checked at construction --------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bucket_bytes": 0},
        {"bucket_bytes": 63},
        {"bucket_bytes": "lots"},
        {"bucket_bytes": True},
        {"bucket_bytes": None},
        {"timeout": 0},
        {"timeout": -1.0},
        {"timeout": "60"},
        {"min_bucket_bytes": 0},
        {"min_bucket_bytes": "auto"},
        {"memory_budget_bytes": 64},
        {"num_slots": 0},
        {"num_slots": 17},
    ],
    ids=repr,
)
def test_sender_rejects_bad_arguments(kwargs):
    with pytest.raises(ConfigError):
        WeightSender(["shm://@weightsync-nobody"], **kwargs)


@pytest.mark.parametrize(
    "addresses",
    [[], ["tcp://a:1", "tcp://a:1"], ["http://host:1"], ["nowhere"], ["inproc//x"]],
    ids=repr,
)
def test_sender_rejects_bad_addresses(addresses):
    with pytest.raises(ConfigError):
        WeightSender(addresses)


@pytest.mark.parametrize(
    "bad", ["tcp://host", "tcp://host:0", "tcp://host:99999", "tcp://:5", "shm://x", "shm://@", "inproc://"]
)
def test_malformed_address_of_a_known_transport_is_a_config_error(bad):
    """Raised at construction, before any I/O, naming the address."""
    with pytest.raises(ConfigError, match=re.escape(repr(bad))):
        WeightSender(["inproc://ok", bad])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"transport": "udp"},
        {"transport": "pigeon"},
        {"timeout": 0},
        {"max_bucket_bytes": 10},
        {"max_bucket_bytes": "big"},
        {"memory_budget_bytes": 1},
    ],
    ids=repr,
)
def test_receiver_rejects_bad_arguments(kwargs):
    with pytest.raises(ConfigError):
        WeightReceiver({}, **kwargs).start()


@pytest.mark.parametrize("sink", [42, "weights", None], ids=repr)
def test_receiver_rejects_what_is_no_sink(sink):
    with pytest.raises(ConfigError, match="sink"):
        WeightReceiver(sink, transport="inproc").start()


def test_tcp_port_in_use_is_a_resource_error():
    with WeightReceiver({}, transport="tcp") as first:
        port = int(first.address.rpartition(":")[2])
        with pytest.raises(ResourceError, match="cannot listen"):
            WeightReceiver({}, transport="tcp", port=port).start()


@pytest.mark.parametrize("version", [-1, 1.0, "1", True, None], ids=repr)
def test_push_rejects_bad_versions(version):
    with WeightReceiver({}, transport="inproc") as receiver, WeightSender([receiver.address]) as sender:
        with pytest.raises(ConfigError, match="version"):
            sender.push({"a": torch.zeros(1)}, version=version)
        assert receiver.state == "empty"


@pytest.mark.parametrize(
    "tensors",
    [torch.zeros(3), "weights", 5, [("a", 1)], [("", torch.zeros(1))], [("a", torch.zeros(1))] * 2, [("a",)]],
    ids=["tensor", "str", "int", "not-a-tensor", "empty-name", "duplicate", "not-a-pair"],
)
def test_push_rejects_what_is_no_set_of_named_tensors(tensors):
    with WeightReceiver(lambda named: None, transport="inproc") as receiver, WeightSender([receiver.address]) as sender:
        with pytest.raises(ConfigError):
            sender.push(tensors, version=1)
        assert receiver.state == "empty"


def test_push_rejects_unsupported_dtypes_before_any_io():
    with WeightReceiver(lambda named: None, transport="inproc") as receiver, WeightSender([receiver.address]) as sender:
        with pytest.raises(ConfigError, match="not supported"):
            sender.push({"a": torch.zeros(2, dtype=torch.complex128)}, version=1)
        assert receiver.state == "empty"
