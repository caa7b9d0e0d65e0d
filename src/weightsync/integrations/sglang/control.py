"""What the trainer and SGLang's TP workers tell each other, and the one way each travels.

SGLang's `POST /update_weights_from_tensor` with `load_format=LOADER` calls weightsync's loader
in every TP worker with the named tensors the request carries. weightsync sends no weights
there, only one tiny control message per call, as the bytes of a uint8 tensor named
`weightsync.control` (msgspec JSON)::

    Start     start this worker's receiver (a fresh one) and announce its address in the
              trainer's rendezvous store (the worker kit's start message, every engine's)
    Land      land version N from the receiver into the model, then write how it went (a
              `LandResult`) into the same store

SGLang's own request body is a pickle (of a list of (name, tensor) pairs, base64 per TP rank,
read by SGLang's restricted unpickler); `payload` makes it from the control message alone, so
no weight byte and nothing of weightsync's own wire is ever pickled.

The way back is the rendezvous store the trainer hosts (a torch.distributed TCPStore, loopback
by default; values are msgspec JSON, decoded as exactly their type): SGLang's update call returns
only success or failure, and a loader that raises takes SGLang's scheduler down with it, so each
worker reports its `LandResult` there and returns normally.
"""

from __future__ import annotations

import base64
import datetime
import io
import pickle
from typing import TypeAlias

import msgspec
import torch
import torch.distributed as dist

from weightsync.errors import ConnectError, ProtocolError, TransferTimeout
from weightsync.workers.start import Start

__all__ = [
    "CONTROL_NAME",
    "Control",
    "Land",
    "LandResult",
    "connect_store",
    "decode",
    "payload",
    "read_results",
    "write_result",
]

CONTROL_NAME = "weightsync.control"
"""The one tensor name a weightsync update call carries."""


class Land(msgspec.Struct, tag="land", frozen=True, kw_only=True):
    """Land the push of `version` into the model through SGLang's own `load_weights`."""

    version: int
    session: str
    """The `Start` this push belongs to: a worker started since by another trainer refuses it."""
    timeout: float
    """Seconds the worker waits for the push to reach it, and for each part of it after."""


Control: TypeAlias = Start | Land

_DECODER = msgspec.json.Decoder(Control)


class LandResult(msgspec.Struct, frozen=True, kw_only=True):
    """How one TP worker's `Land` went, as it writes it into the trainer's store."""

    rank: int
    version: int
    landed: bool
    """Every tensor of the version went through SGLang's `load_weights`."""
    touched: bool
    """Some tensor reached the model: when not `landed`, its weights are mixed."""
    error: str = ""


_RESULT = msgspec.json.Decoder(LandResult)


def payload(message: Control, num_ranks: int) -> list[str]:
    """SGLang's `serialized_named_tensors` for `message`: the same tiny payload for each of
    `num_ranks` TP ranks (SGLang's worker r reads entry r)."""
    data = torch.frombuffer(bytearray(msgspec.json.encode(message)), dtype=torch.uint8)
    buffer = io.BytesIO()
    pickle.dump([(CONTROL_NAME, data)], buffer)  # SGLang's format; see the module docstring
    text = base64.b64encode(buffer.getvalue()).decode("ascii")
    return [text] * num_ranks


def decode(named_tensors: list[tuple[str, torch.Tensor]]) -> Control:
    """The control message of one update call.

    Raises:
        ProtocolError: the call carries anything but one weightsync control tensor.
    """
    if len(named_tensors) != 1 or named_tensors[0][0] != CONTROL_NAME:
        names = [name for name, _ in named_tensors[:3]]
        raise ProtocolError(f"weightsync's loader takes one {CONTROL_NAME!r} tensor, got {names} (weights?)")
    tensor = named_tensors[0][1]
    if tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise ProtocolError(f"{CONTROL_NAME!r} must be a 1-D uint8 tensor, got {tensor.dtype}{list(tensor.shape)}")
    try:
        return _DECODER.decode(tensor.cpu().numpy().tobytes())
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"{CONTROL_NAME!r} is not a weightsync control message: {exc}") from exc


def write_result(store: dist.Store, session: str, result: LandResult) -> None:
    """Leave `result` in the trainer's store (the worker's side)."""
    store.set(f"{session}/landing/{result.version}/{result.rank}", msgspec.json.encode(result).decode())


def read_results(store: dist.Store, session: str, version: int, ranks: list[int], timeout: float) -> list[LandResult]:
    """Every worker's `LandResult` of `version` (the trainer's side), waiting up to `timeout`.

    Raises:
        TransferTimeout: some worker wrote none within `timeout`.
        ProtocolError: a value is not a `LandResult` of this version and rank.
    """
    keys = [f"{session}/landing/{version}/{rank}" for rank in ranks]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:  # torch raises DistStoreError, a RuntimeError
        raise TransferTimeout(f"no result of version {version} from every SGLang worker: {exc}") from exc
    results = []
    for rank, key in zip(ranks, keys, strict=True):
        try:
            result = _RESULT.decode(store.get(key))
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"{key} is not a weightsync LandResult: {exc}") from exc
        if result.rank != rank or result.version != version:
            raise ProtocolError(f"{key} holds the result of rank {result.rank}, version {result.version}")
        results.append(result)
        store.delete_key(key)
    return results


def connect_store(rendezvous: str, timeout: float) -> dist.TCPStore:
    """A client of the trainer's store at `rendezvous` ("HOST:PORT").

    Raises:
        ConnectError: the store could not be reached within `timeout`.
    """
    host, _, port = rendezvous.rpartition(":")
    try:
        return dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout))
    except (ValueError, RuntimeError) as exc:
        raise ConnectError(f"cannot reach the trainer's rendezvous store at {rendezvous}: {exc}") from exc
