"""How a trainer (or `weightsync serve`) learns every engine worker's receiver address: a
rendezvous store it hosts.

An engine's calls into its workers carry information one way, to the workers, and return
nothing useful (vLLM's weight-update calls, SGLang's custom-loader door); yet a weightsync sender
connects to its receivers, so the trainer must learn where each worker listens, for any number
of workers on any number of hosts. The trainer therefore hosts a torch.distributed `TCPStore`
while it starts the workers' receivers::

    trainer   Rendezvous(host) / open_store()   listen on HOST (127.0.0.1 unless told), any port
    trainer   the engine's call with a `Start`  (start.py) naming "HOST:PORT" and a session
    worker    announce(...)                     one key per worker: its address, rank, bytes
    trainer   collect(store, session)           every worker has announced once the call
                                                returned (the engine runs it on every worker first)

Why a store and not fixed addresses: the trainer does not know which host each worker runs on,
nor its shm name, and a worker picks a free port itself. The store holds bytes only (no pickle):
each value is a msgspec JSON `WorkerAddress`, decoded as exactly that type. It answers anyone who
can reach it, so it listens on loopback by default and lives only while the receivers start; an
address planted by someone else still cannot take weights when a shared token is set, since the
sender requires every receiver to prove it holds the token.
"""

from __future__ import annotations

import datetime
import secrets
from types import TracebackType

import msgspec
import torch.distributed as dist

from weightsync.errors import ConnectError, ProtocolError
from weightsync.transports.collective import host_store

__all__ = ["Rendezvous", "WorkerAddress", "announce", "collect", "open_store"]


class WorkerAddress(msgspec.Struct, frozen=True, kw_only=True):
    """One engine worker's receiver, as it announces itself."""

    address: str
    rank: int
    """The worker's rank in its engine, across its data parallel replicas (two servers each have
    a rank 0)."""
    weight_bytes: int
    """Bytes of the weights a sync carries, in the engine's dtype."""


_WORKER = msgspec.json.Decoder(WorkerAddress)


def open_store(host: str, timeout: float) -> tuple[dist.TCPStore, str]:
    """A store listening on `host` only (any free port); returns it and its "HOST:PORT".

    Raises:
        ResourceError: `host` cannot be listened on.
    """
    store = host_store(host, timeout)
    return store, f"[{host}]:{store.port}" if ":" in host else f"{host}:{store.port}"


def announce(rendezvous: str, session: str, worker: WorkerAddress, *, timeout: float) -> None:
    """Leave `worker` in the trainer's store at `rendezvous` ("HOST:PORT").

    Raises:
        ConnectError: the store could not be reached within `timeout`.
    """
    host, _, port = rendezvous.rpartition(":")
    try:
        store = dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout))
        index = store.add(f"{session}/count", 1)
        store.set(f"{session}/{index}", msgspec.json.encode(worker).decode())
    except (ValueError, RuntimeError) as exc:  # torch raises DistStoreError, a RuntimeError
        raise ConnectError(f"cannot reach the trainer's rendezvous store at {rendezvous}: {exc}") from exc


def collect(store: dist.TCPStore, session: str) -> list[WorkerAddress]:
    """Every worker that announced itself in `session`, in the order they did.

    Raises:
        ProtocolError: a value is not a `WorkerAddress`, or two workers claim one address.
    """
    count = store.add(f"{session}/count", 0)
    workers = []
    for index in range(1, count + 1):
        try:
            workers.append(_WORKER.decode(store.get(f"{session}/{index}")))
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"rendezvous entry {index} of {count} is not a worker address: {exc}") from exc
    addresses = [worker.address for worker in workers]
    if len(set(addresses)) != len(addresses):
        raise ProtocolError(f"two workers announced the same address: {sorted(addresses)}")
    return workers


class Rendezvous:
    """A store hosted for the length of one init call, with a fresh session: pass `where` and
    `session` to the workers, then `collect()` once the call returned; leaving the `with` block
    stops listening.

    Raises:
        ResourceError: `host` cannot be listened on.
    """

    def __init__(self, host: str, timeout: float) -> None:
        self._store: dist.TCPStore | None
        self._store, self.where = open_store(host, timeout)
        self.session = secrets.token_hex(8)

    def collect(self) -> list[WorkerAddress]:
        """Every worker that announced itself so far (`collect`)."""
        if self._store is None:
            raise ProtocolError("the rendezvous was closed")
        return collect(self._store, self.session)

    def __enter__(self) -> Rendezvous:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._store = None  # its last reference: the store stops listening
