"""A sender in a child process, driven by the test: `SenderProcess` runs `WeightSender`s for it.

cudaipc needs one: CUDA IPC does not open a handle in the process that exported it, so a cudaipc
sender and its receivers must live in different processes. With the sender in a child, the
receivers stay in the test process with every sink the tests use (a `Recorder`, a dict, a
callable, a custom `WeightSink`, a monkeypatched `Landing`), and so do the assertions on them.
`sending` picks it for cudaipc addresses and is `tests.helpers.sending` for the others.

The test talks to a child over its stdin and stdout, one pickled message per length-prefixed
frame: test plumbing between two processes of one test run (the library's own wire carries no
pickle). Tensors travel by torch.save and are loaded with `map_location=device`, which keeps
views, strides, offsets and ties: a non-contiguous source stays non-contiguous on the GPU.

This module is also the child's program (`python -m tests.peer_process`); it imports no test
helper at module level, so that the child needs only torch and weightsync.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import itertools
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

import weightsync
from weightsync import SyncReport, WeightSender, WeightSource
from weightsync import errors as weightsync_errors

ROOT = Path(__file__).resolve().parents[1]
"""The checkout: the child runs `-m tests.peer_process` from here."""

START_S = 120.0
"""How long a child may take to start: importing torch and opening CUDA take seconds, more on a cold host."""

REPLY_S = 120.0
"""How long one request may take; every wait inside a push is bounded far below this by its own timeout."""

_HEADER = struct.Struct("<Q")
_KEYS = itertools.count(1)


def _frame(message: object) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def _pack_tensors(tensors: Any) -> bytes:
    """torch.save of the (name, tensor) pairs in `tensors` (a mapping or an iterable of pairs)."""
    if isinstance(tensors, WeightSource):
        raise TypeError("a WeightSource cannot move to the sender process; pass named tensors")
    pairs = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    buffer = io.BytesIO()
    torch.save(pairs, buffer)
    return buffer.getvalue()


def _rebuild_error(name: str, message: str, report: object, kind: str, where: str) -> BaseException:
    """The child's exception, rebuilt in this process with the same class and message."""
    cls = getattr(weightsync_errors, name, None) or getattr(builtins, name, None)
    if cls is weightsync_errors.SyncFailed:
        error: BaseException = cls(message, report)
    elif cls is weightsync_errors.RemoteError:
        error = cls(message, kind=kind)
    elif isinstance(cls, type) and issubclass(cls, Exception):
        error = cls(message)  # a TransportError's message already names transport, version and bucket
    else:
        error = RuntimeError(f"{name}: {message}")
    error.add_note(where)
    return error


# --- the test's side ------------------------------------------------------------------------------


class _Child:
    """A child process running this module's `main`, answering one request at a time."""

    def __init__(self, config: dict[str, Any]) -> None:
        paths = [str(Path(weightsync.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.peer_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths))),
        )
        self.pid = self._proc.pid
        self._lock = threading.Lock()
        try:
            self.hello = self.request(config, timeout=START_S)
        except BaseException:
            self.kill()
            raise

    def request(self, *message: object, timeout: float = REPLY_S) -> Any:
        """Send `message`, wait for the answer; raises what the child raised."""
        with self._lock:
            assert self._proc.stdin is not None
            self._proc.stdin.write(_frame(message))
            self._proc.stdin.flush()
            deadline = time.monotonic() + timeout
            (size,) = _HEADER.unpack(self._read(_HEADER.size, deadline))
            status, value = pickle.loads(self._read(size, deadline))
        if status == "raise":
            raise _rebuild_error(*value)
        return value

    def _read(self, size: int, deadline: float) -> bytes:
        assert self._proc.stdout is not None
        fd, chunks = self._proc.stdout.fileno(), []
        while size:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"child {self.pid} did not answer in time")
            chunk = os.read(fd, min(size, 1 << 20))
            if not chunk:
                raise AssertionError(f"child {self.pid} exited (status {self._proc.wait(10)}) without answering")
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        """Ask the child to close its peers and exit; kill it if it does not."""
        try:
            if self._proc.poll() is None:
                self.request("exit", timeout=60)
                self._proc.wait(30)
        except (AssertionError, OSError, subprocess.TimeoutExpired):
            pass
        finally:
            self.kill()

    def kill(self) -> None:
        """SIGKILL (if still running), then reap: a zombie's pid still counts as alive."""
        if self._proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self._proc.wait(30)
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


class SenderProcess:
    """A child process that runs `WeightSender`s for the test, its tensors on `device`.

    One process serves any number of senders, one call at a time: start it once per module
    (importing torch and opening CUDA take seconds) and open a sender per push with `sending`.
    """

    def __init__(self, device: str = "cuda") -> None:
        self._child = _Child({"device": device})
        self.pid = self._child.pid

    @contextlib.contextmanager
    def sending(self, addresses: list[str] | str, **kwargs: Any) -> Iterator[RemoteSender]:
        """As `tests.helpers.sending`: a sender (timeout 10 s unless given), closed on exit."""
        kwargs.setdefault("timeout", 10.0)
        sender = RemoteSender(self._child, addresses, kwargs)
        try:
            yield sender
        finally:
            sender.close()

    def close(self) -> None:
        self._child.close()

    def __enter__(self) -> SenderProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class RemoteSender:
    """A `WeightSender` in a `SenderProcess`: `push` ships the tensors there and returns the
    child's SyncReport, or raises what its push raised (same class, same message)."""

    def __init__(self, child: _Child, addresses: list[str] | str, kwargs: dict[str, Any]) -> None:
        self._child = child
        self._key = next(_KEYS)
        self.addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        child.request("open", self._key, addresses, kwargs)

    def push(self, tensors: Any, version: int) -> SyncReport:
        return self._child.request("push", self._key, _pack_tensors(tensors), version)

    def close(self) -> None:
        self._child.request("close", self._key)


@contextlib.contextmanager
def sending(
    addresses: list[str] | str, *, process: SenderProcess | None = None, **kwargs: Any
) -> Iterator[WeightSender | RemoteSender]:
    """As `tests.helpers.sending`, but a push to cudaipc receivers comes from a child process:
    `process`, or one started for this sender alone (and gone once it is closed)."""
    listed = [addresses] if isinstance(addresses, str) else addresses
    if not any(address.startswith("cudaipc://") for address in listed):
        from tests.helpers import sending as sending_here  # not in the child, which needs no test helpers

        with sending_here(addresses, **kwargs) as sender:
            yield sender
        return
    with contextlib.ExitStack() as stack:
        process = process or stack.enter_context(SenderProcess("cuda"))
        yield stack.enter_context(process.sending(addresses, **kwargs))


# --- the child's side -----------------------------------------------------------------------------


class _Channel:
    def __init__(self, reader: BinaryIO, writer: BinaryIO) -> None:
        self._reader, self._writer = reader, writer

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        while header := self._reader.read(_HEADER.size):
            (size,) = _HEADER.unpack(header)
            yield pickle.loads(self._reader.read(size))

    def answer(self, status: str, value: object) -> None:
        self._writer.write(_frame((status, value)))
        self._writer.flush()


def _serve_sender(config: dict[str, Any], channel: _Channel) -> None:
    device = config["device"]
    if device != "cpu":
        torch.zeros(1, device=device)  # open CUDA now, not inside the first push
    channel.answer("ok", os.getpid())
    senders: dict[int, WeightSender] = {}
    try:
        for request in channel:
            op, args = request[0], request[1:]
            try:
                if op == "open":
                    key, addresses, kwargs = args
                    senders[key] = WeightSender(addresses, **kwargs)
                    channel.answer("ok", None)
                elif op == "push":
                    key, payload, version = args
                    pairs = torch.load(io.BytesIO(payload), map_location=device, weights_only=False)
                    channel.answer("ok", senders[key].push(pairs, version))
                elif op == "close":
                    senders.pop(args[0]).close()
                    channel.answer("ok", None)
                elif op == "exit":
                    break
                else:
                    raise ValueError(f"unknown request {op!r}")
            except Exception as exc:
                channel.answer("raise", _describe(exc))
    finally:
        for sender in senders.values():
            sender.close()
    channel.answer("ok", None)


def _describe(exc: BaseException) -> tuple[str, str, object, str, str]:
    where = f"raised in child process {os.getpid()}:\n{traceback.format_exc()}"
    return type(exc).__name__, str(exc), getattr(exc, "report", None), getattr(exc, "kind", ""), where


def main() -> None:
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr; stdout carries the answers only
    channel = _Channel(sys.stdin.buffer, answers)
    (config,) = next(iter(channel))
    try:
        _serve_sender(config, channel)
    except Exception as exc:
        channel.answer("raise", _describe(exc))


if __name__ == "__main__":
    main()
