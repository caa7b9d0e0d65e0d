"""A stock SGLang server started with weightsync's loader, from SGLang's own venv, for the SGLang
tests and benchmark (scripts/install-sglang.sh makes the venv).

    with SGLangServer(venv, model_dir, tp=1) as server:
        SGLangEngine(server.url).push(...)

On a host without a GPU it runs SGLang's CPU path (`SGLANG_USE_CPU_ENGINE=1`, torch_native
attention, one core per TP rank) with its KV cache capped; stopping it removes the shared-memory
files SGLang itself leaves behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import httpx

from weightsync.integrations.sglang.trainer import LOADER

__all__ = ["SGLangServer", "gpu_count", "sglang_venv"]

START_TIMEOUT_S = 420.0
"""SGLang's first start on a cold page cache took 158 s here; a busy host doubles it."""


def sglang_venv() -> Path | None:
    """SGLang's venv: $WEIGHTSYNC_SGLANG_VENV, else .venv-sglang in this checkout; None if absent."""
    root = Path(__file__).resolve().parents[2]
    venv = Path(os.environ.get("WEIGHTSYNC_SGLANG_VENV", root / ".venv-sglang"))
    return venv if (venv / "bin" / "python").exists() else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _leftovers() -> set[Path]:
    """SGLang's own files in /dev/shm (load snapshots), which it leaves behind when stopped."""
    return set(Path("/dev/shm").glob("sglang_*"))


class SGLangServer:
    """`python -m sglang.launch_server` with weightsync's loader (and `extra` arguments).

    Args:
        venv: SGLang's venv.
        model: the checkpoint folder.
        tp: tensor parallel size.
        extra: more of SGLang's arguments.
    """

    def __init__(self, venv: Path, model: Path, *, tp: int = 1, extra: tuple[str, ...] = ()) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [str(venv / "bin" / "python"), "-m", "sglang.launch_server", "--model-path", str(model)]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--tp", str(tp), "--dtype", "float32"]
        command += ["--custom-weight-loader", LOADER, "--max-total-tokens", "4096", *extra]
        env = dict(os.environ)
        if not gpu_count():
            command += ["--device", "cpu", "--attention-backend", "torch_native"]
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            if tp > 1:  # one core per rank (SGLang's default gives each rank a whole NUMA node)
                env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(map(str, range(tp)))
        self._before = _leftovers()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sglang-", suffix=".log", delete=False)
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> SGLangServer:
        """Wait until SGLang answers /health; RuntimeError (with its log's tail) if it does not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"SGLang exited with {self.process.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"SGLang did not serve within {timeout:g} s:\n{self.tail()}")

    def tail(self, num_lines: int = 40) -> str:
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-num_lines:])

    def close(self) -> None:
        """Stop SGLang (its whole process group) and remove what it left in /dev/shm."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
        with contextlib.suppress(ProcessLookupError):  # children that outlived the leader
            os.killpg(self.process.pid, signal.SIGKILL)
        for path in _leftovers() - self._before:
            path.unlink(missing_ok=True)
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)

    def __enter__(self) -> SGLangServer:
        return self.wait_ready()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def gpu_count() -> int:
    """GPUs nvidia-smi sees here (0 without it)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return listed.stdout.count("GPU ") if listed.returncode == 0 else 0
