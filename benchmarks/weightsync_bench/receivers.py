"""The receiving processes: each is spawned once, holds its destination tensors for the whole run,
and does what the parent sends it over a pipe (listen, arm, check, load a baseline)."""

from __future__ import annotations

import contextlib
import os
import pickle
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from weightsync.errors import BenchError
from weightsync.receiver import WeightReceiver
from weightsync_bench.measure import PeakRss
from weightsync_bench.model import Shapes, allocate, verify

__all__ = ["Worker", "broadcast"]


class ReceiverSide:
    """What a receiver process does on command; runs in the spawned process."""

    def __init__(self, shapes: Shapes, queue: Any, seed: int, timeout: float, device: str) -> None:
        self.dest = {name: tensor.to(device) for name, tensor in allocate(shapes).items()}
        self.queue = queue
        self.seed = seed
        self.timeout = timeout
        self.receiver: WeightReceiver | None = None
        self.peak = PeakRss()

    def listen(self, transport: str, max_bucket_bytes: int | None, sink: str = "dict") -> str:
        self.close_receiver()
        self.receiver = WeightReceiver(
            self.dest if sink == "dict" else self.load_into_dest,
            transport,
            max_bucket_bytes=max_bucket_bytes or "auto",
            timeout=self.timeout,
        ).start()
        return self.receiver.address

    def load_into_dest(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """An engine's loader: each tensor handed over is copied into the engine's own storage."""
        for name, tensor in named_tensors:
            self.dest[name].copy_(tensor)

    def close_receiver(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    def arm(self) -> None:
        self.peak.start()

    def check(self, version: int) -> tuple[bool, int]:
        growth = self.peak.stop()
        committed = self.receiver is None or self.receiver.version == version
        landed = {name: tensor.cpu() for name, tensor in self.dest.items()}  # no copy on the CPU
        return committed and verify(landed, self.seed, version), growth

    def load(self, method: str, path: str) -> float:
        """Run a baseline's receiving half; returns the time its last copy finished."""
        RECEIVE[method](self, path)
        return time.perf_counter()

    def _copy_all(self, get: Callable[[str], torch.Tensor]) -> None:
        for name, tensor in self.dest.items():
            tensor.copy_(get(name))

    def _receive_torch_save(self, path: str) -> None:
        self._copy_all(torch.load(path, weights_only=True).__getitem__)

    def _receive_safetensors(self, path: str) -> None:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as file:
            self._copy_all(file.get_tensor)

    def _receive_pickle(self, path: str) -> None:
        for _ in self.dest:
            name, payload = self.queue.get(timeout=self.timeout)
            self.dest[name].copy_(pickle.loads(payload))

    def _receive_shared(self, path: str) -> None:
        self._copy_all(self.queue.get(timeout=self.timeout).__getitem__)


RECEIVE: dict[str, Callable[[ReceiverSide, str], None]] = {
    "torch_save": ReceiverSide._receive_torch_save,
    "safetensors": ReceiverSide._receive_safetensors,
    "mp_queue_pickle": ReceiverSide._receive_pickle,
    "mp_queue_shared": ReceiverSide._receive_shared,
}


def receiver_main(conn: Connection, shapes: Shapes, queue: Any, seed: int, timeout: float, device: str) -> None:
    side = ReceiverSide(shapes, queue, seed, timeout, device)
    conn.send(("ok", os.getpid()))
    while True:
        command, *args = conn.recv()
        if command == "exit":
            break
        try:
            conn.send(("ok", getattr(side, command)(*args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))
    side.close_receiver()


class Worker:
    """The parent's handle on one receiver process."""

    def __init__(self, context: Any, shapes: Shapes, seed: int, timeout: float, device: str = "cpu") -> None:
        self.queue = context.Queue(maxsize=2)
        self.conn, child = context.Pipe()
        self.timeout = timeout
        self.process = context.Process(
            target=receiver_main, args=(child, shapes, self.queue, seed, timeout, device), daemon=True
        )
        self.process.start()
        child.close()

    def send(self, command: str, *args: Any) -> None:
        self.conn.send((command, *args))

    def reply(self, timeout: float | None = None) -> Any:
        deadline = time.monotonic() + (timeout or self.timeout)
        while not self.conn.poll(0.1):
            if not self.process.is_alive():
                raise BenchError(f"receiver process {self.process.pid} died (exit code {self.process.exitcode})")
            if time.monotonic() > deadline:
                raise BenchError(f"receiver process {self.process.pid} did not answer in time")
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise BenchError(f"receiver process {self.process.pid} closed its pipe") from None
        if status != "ok":
            raise BenchError(f"receiver process {self.process.pid} failed:\n{value}")
        return value

    def call(self, command: str, *args: Any) -> Any:
        self.send(command, *args)
        return self.reply()

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.send("exit")
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.queue.close()
        self.queue.cancel_join_thread()
        self.conn.close()


def broadcast(workers: Sequence[Worker], command: str, *args: Any) -> list[Any]:
    """Run a command on every worker at once; their replies in order."""
    for worker in workers:
        worker.send(command, *args)
    return [worker.reply() for worker in workers]
