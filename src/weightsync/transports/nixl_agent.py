"""The NIXL agent as the nixl transport uses it: NIXL's Python API (`nixl._api`) imported on
first use, one UCX backend with the progress thread off, host memory registered and released,
one-sided writes posted and polled, every NIXL error turned into a `TransportError`.

NIXL is optional: nothing here is imported by `import weightsync`, and `load_nixl` raises a
one-line `ConfigError` naming `pip install 'weightsync[nixl]'` when it is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import secrets
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from weightsync.errors import ConfigError, PeerClosedError, TransportError, WeightSyncError

__all__ = [
    "INSTALL_HINT",
    "UCX_PARAMS",
    "NixlAgent",
    "Registered",
    "address_of",
    "close_all",
    "collapse_huge_pages",
    "huge_buffer",
    "live_registrations",
    "load_nixl",
    "nixl_errors",
    "require_nixl",
]

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'weightsync[nixl]'"

UCX_PARAMS = {"ucx_error_handling_mode": "none"}
"""The UCX backend's settings. NIXL's default error handling mode ("peer") has no shared-memory
transport, so `UCX_TLS=sm,self` fails at agent creation; "none" allows every transport. A dead
peer still fails its transfer (NIXL reports the disconnect), in either mode."""

Region = tuple[int, int]
"""(address, nbytes) of host memory."""


def load_nixl() -> Any:
    """NIXL's Python API (`nixl._api`), imported on first use; ConfigError when not installed."""
    try:
        api = importlib.import_module("nixl._api")
    except ImportError as exc:
        raise ConfigError(f"the nixl transport needs NIXL ({exc}): {INSTALL_HINT}") from None
    # NIXL logs every agent it makes at INFO on stdout, the command line's output stream.
    nixl_log = logging.getLogger("nixl")
    if nixl_log.level == logging.INFO:
        nixl_log.setLevel(logging.WARNING)
    return api


def require_nixl(role: str) -> None:
    """ConfigError (one line, naming the install command) when NIXL cannot be imported here."""
    load_nixl()


@contextlib.contextmanager
def nixl_errors(what: str) -> Iterator[None]:
    """Translate NIXL's exceptions (bindings classes with no common base) at the boundary."""
    try:
        yield
    except WeightSyncError:
        raise
    except Exception as exc:
        cls = PeerClosedError if type(exc).__name__ == "nixlRemoteDisconnectError" else TransportError
        message = f"nixl could not {what}: {type(exc).__name__}: {exc}"[:300]
        # NIXL's own frames hold its agent, which must not outlive `close` in an error that a
        # sink or a log record keeps: empty them (they have returned; the traceback stays).
        traceback.clear_frames(exc.__traceback__)
        raise cls(message, transport="nixl") from exc


HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux >= 6.1


def _madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


_madvise_function = _madvise()


def collapse_huge_pages(address: int, nbytes: int) -> float:
    """Back host memory [address, address + nbytes) with transparent huge pages now, every 2 MiB
    page it touches, edges included (contents unchanged; best effort, Linux 6.1 or later);
    returns the seconds it took.

    Why: between two processes on one host, UCX writes with the kernel's cross-memory copy,
    which pins and walks the destination's pages one by one. Between torch tensors (4 KiB pages)
    it ran at 5 GB/s here, between the same tensors collapsed into huge pages at 12.9 GB/s,
    numpy.copyto in one process at 12.5. A collapse copies the range once (about 1 s per GiB
    here), so callers do it once per long-lived buffer; on memory already huge it is a no-op.

    The edges: torch places a tensor 64 bytes past a page boundary, so the 2 MiB-aligned
    interior alone left a 2 MiB tensor on small pages and about 9% of a 4 GiB model's bytes
    (writes from and into them at 5 GB/s). So each huge page the range's ends touch is collapsed
    too, on its own (the kernel stops a range at its first page it cannot collapse: one that
    crosses into another mapping); it also holds memory next to the range, of the same process,
    none of whose bytes change.
    """
    if _madvise_function is None or nbytes <= 0:
        return 0.0
    began = time.monotonic()
    start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    stop = (address + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    edges = {
        page for page in (start - HUGE_PAGE_BYTES, stop) if page < address + nbytes and address < page + HUGE_PAGE_BYTES
    }
    for first, end in [(start, stop), *((page, page + HUGE_PAGE_BYTES) for page in sorted(edges))]:
        if end > first and _madvise_function(first, end - first, _MADV_HUGEPAGE) == 0:
            _madvise_function(first, end - first, _MADV_COLLAPSE)  # fails harmlessly where unsupported
    return time.monotonic() - began


def huge_buffer(nbytes: int) -> np.ndarray:
    """A zeroed, pre-faulted host buffer backed by huge pages where the kernel allows it."""
    buffer = np.empty(nbytes, dtype=np.uint8)
    if _madvise_function is not None and nbytes >= HUGE_PAGE_BYTES:
        collapse_huge_pages(address_of(buffer), nbytes)  # nothing to collapse yet: the advice sticks
    buffer.fill(0)  # pre-fault: the first sync runs at full speed
    return buffer


def address_of(view: np.ndarray) -> int:
    return int(view.ctypes.data)


def _merged(regions: Sequence[Region]) -> list[Region]:
    """`regions` with overlapping or touching ones merged (tensors may share a storage)."""
    merged: list[list[int]] = []
    for start, nbytes in sorted(regions):
        if merged and start <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], start + nbytes - merged[-1][0])
        else:
            merged.append([start, nbytes])
    return [(start, nbytes) for start, nbytes in merged]


_registrations = [0]
"""Registrations made in this process and not yet released (one per `register` call)."""
_registrations_lock = threading.Lock()


def live_registrations() -> int:
    """How many registrations of host memory this process holds now: 0 once every sender and
    receiver over nixl has closed, on every path (the tests check it)."""
    return _registrations[0]


def _count_registrations(change: int) -> None:
    with _registrations_lock:
        _registrations[0] += change


class NixlAgent:
    """One NIXL agent with the UCX backend, its progress driven by the caller (never by a thread
    of its own). Host memory only. Every call's error is a TransportError.

    NIXL has no call that destroys an agent: it goes (with its UCX worker and listening socket)
    when the last reference to it does. `close` drops this wrapper's, and `release` the one each
    transfer handle keeps, so that a traceback holding this wrapper or a handle (a sink may keep
    the error that ended a sync) does not keep the agent alive.
    """

    def __init__(self, role: str) -> None:
        api = load_nixl()
        self.name = f"weightsync-{role}-{os.getpid()}-{secrets.token_hex(6)}"
        with nixl_errors("create an agent"):
            config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
            agent = api.nixl_agent(self.name, config)
            agent.create_backend("UCX", dict(UCX_PARAMS))
        self._nixl: Any = agent

    @property
    def _agent(self) -> Any:
        if self._nixl is None:
            raise TransportError("the NIXL agent is closed", transport="nixl")
        return self._nixl

    def close(self) -> None:
        """Let go of the agent (registrations must have been released first)."""
        self._nixl = None

    def register(self, regions: Sequence[Region]) -> Any:
        """Register host memory; returns what `deregister` takes (None for no regions)."""
        if not regions:
            return None
        with nixl_errors("register memory"):
            registration = self._agent.register_memory([(start, nbytes, 0, "") for start, nbytes in regions], "DRAM")
        _count_registrations(1)
        return registration

    def deregister(self, registration: Any) -> None:
        if registration is not None:
            _count_registrations(-1)  # NIXL frees what it can even when it reports an error
            with nixl_errors("deregister memory"):
                self._agent.deregister_memory(registration)

    def metadata(self) -> bytes:
        with nixl_errors("export its metadata"):
            return bytes(self._agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata (connection and memory keys); returns the peer's agent name."""
        with nixl_errors("load a receiver's metadata"):
            name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, name: str) -> None:
        with nixl_errors("forget a receiver"):
            self._agent.remove_remote_agent(name)

    def post_write(self, local: np.ndarray, remote: np.ndarray, peer: str) -> tuple[Any, str]:
        """Post the WRITE of every (address, nbytes, 0) row of `local` to the same row of
        `remote` in `peer`; returns the transfer and its state ("DONE", "PROC" or "ERR")."""
        with nixl_errors(f"post a write to {peer}"):
            local_descs = self._agent.get_xfer_descs(local, "DRAM")
            remote_descs = self._agent.get_xfer_descs(remote, "DRAM")
            transfer = self._agent.initialize_xfer("WRITE", local_descs, remote_descs, peer)
        try:
            with nixl_errors(f"write to {peer}"):
                return transfer, str(self._agent.transfer(transfer))
        except BaseException:
            self.release(transfer)
            raise

    def state(self, transfer: Any) -> str:
        """Progress, then the transfer's state: "DONE", "PROC" or "ERR"."""
        with nixl_errors("complete a write"):
            return str(self._agent.check_xfer_state(transfer))

    def ended(self, transfer: Any) -> bool:
        """Progress, then whether a transfer is over, done or failed (never raises)."""
        try:
            return self.state(transfer) != "PROC"
        except TransportError:
            return True

    def release(self, transfer: Any) -> None:
        """Free a transfer; one still in flight is cancelled (best effort: never raises)."""
        try:
            transfer.release()
        except Exception as exc:  # NIXL keeps a handle it cannot free and retries at agent teardown
            log.warning("nixl could not release a transfer: %s", exc)
        else:
            transfer._agent = None  # a released handle needs no agent (see the class docstring)

    def progress(self) -> None:
        with nixl_errors("make progress"):
            self._agent.get_new_notifs()


class Registered:
    """Host memory registered with an agent, kept alive as long as it is registered."""

    def __init__(self, agent: NixlAgent, views: Sequence[np.ndarray]) -> None:
        self.agent = agent
        self._views = list(views)  # the memory must outlive its registration
        self._registration = agent.register(_merged([(address_of(v), v.nbytes) for v in self._views if v.nbytes]))

    def close(self) -> None:
        registration, self._registration, self._views = self._registration, None, []
        self.agent.deregister(registration)


def close_all(memory: Sequence[Registered]) -> None:
    """Deregister each; a failure is logged, never raised (this runs on error paths)."""
    for registered in memory:
        try:
            registered.close()
        except TransportError as exc:
            log.warning("%s", exc)
