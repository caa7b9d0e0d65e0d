"""Server test fixtures: tiny models built once per session, and real servers (uvicorn in a
thread on 127.0.0.1, port 0) around a RolloutServer."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import WAIT_S, wait_until
from tests.models import MODEL_KINDS, save_model


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Engine steps of tiny models gain nothing from 2 threads, and spin badly on a busy host."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """kind -> model dir (config.json, model.safetensors, tokenizer) for qwen2 (tied) and llama."""
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for kind in MODEL_KINDS:
        save_model(kind, root / kind)
        paths[kind] = root / kind
    return paths


class LiveServer:
    """A RolloutServer behind uvicorn in a background thread."""

    def __init__(self, model: Path, **options: object) -> None:
        import uvicorn

        from weightsync.server.app import create_app
        from weightsync.server.client import RolloutClient
        from weightsync.server.runtime import RolloutServer, ServeConfig

        self.server = RolloutServer(ServeConfig(model=str(model), **options))  # type: ignore[arg-type]
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(create_app(self.server), log_level="error", lifespan="off")
        self._http = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._http.run, kwargs={"sockets": [self._sock]}, name="test-uvicorn", daemon=True
        )
        self._thread.start()
        if not wait_until(lambda: self._http.started, WAIT_S):
            raise RuntimeError("uvicorn did not start")
        self.client = RolloutClient(self.url, timeout=WAIT_S * 3)

    @property
    def address(self) -> str:
        return self.server.receiver.address

    def close(self) -> None:
        self.client.close()
        self._http.should_exit = True
        self._thread.join(WAIT_S)
        self._sock.close()
        self.server.close()


@contextlib.contextmanager
def live_server(model: Path, **options: object) -> Iterator[LiveServer]:
    server = LiveServer(model, **options)
    try:
        yield server
    finally:
        server.close()
