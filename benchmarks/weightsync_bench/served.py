"""`weightsync serve` in a process of its own, as the server benchmarks start it (bench_server,
bench_lora): timed from process start until it listens, then until it serves."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

import weightsync
from weightsync.serving.process import ChildProcess

__all__ = ["Served"]

PYTHONPATH = str(Path(weightsync.__file__).resolve().parent.parent)
"""Where this process's weightsync lies (src/ in a checkout): the server runs the same one."""


class Served:
    """`weightsync serve --engine E --model DIR --port 0 ...` in its own process; `listening_s` is
    process start -> URL printed. `extra` are more of its flags, `env` more environment."""

    def __init__(
        self,
        model: Path,
        engine: str,
        timeout: float,
        extra: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        started = time.perf_counter()
        command = [sys.executable, "-m", "weightsync", "serve", "--engine", engine, "--model", str(model)]
        command += ["--port", "0", "--ready-timeout", str(timeout), *extra]
        self.process = ChildProcess(command, env=os.environ | {"PYTHONPATH": PYTHONPATH} | (env or {}))
        # vLLM logs to stdout too: our line, within the timeout; the child's reader keeps draining.
        line = self.process.wait_for_line("weightsync serve: http://", timeout)
        if line is None:
            why = self.process.why_not_started(f"the {engine} server", timeout)
            self.process.close()
            raise RuntimeError(why)
        self.listening_s = time.perf_counter() - started
        self.started = started
        self.url = line.split()[2]
        self.client = httpx.Client(base_url=self.url, timeout=timeout)

    def wait_healthy(self, timeout: float) -> float:
        """Seconds from process start until /health answers 200."""
        deadline = time.monotonic() + timeout
        while self.client.get("/health").status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError("server never became healthy")
            time.sleep(0.01)
        return time.perf_counter() - self.started

    def close(self) -> None:
        self.client.close()
        self.process.close()
