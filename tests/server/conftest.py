"""Server test fixtures: tiny models built once per session, and real servers (uvicorn in a
thread on 127.0.0.1, port 0) around a RolloutServer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import WAIT_S
from tests.models import MODEL_KINDS, save_model
from weightsync.serving.background import BackgroundServer


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


class LiveServer(BackgroundServer):
    """A BackgroundServer on 127.0.0.1 with a client for it."""

    def __init__(self, model: Path, port: int = 0, **options: object) -> None:
        from weightsync.client import RolloutClient
        from weightsync.serving.config import ServeConfig

        config = ServeConfig(model=str(model), **options)  # type: ignore[arg-type]
        super().__init__(config, port=port, start_timeout=None if config.engine == "vllm" else WAIT_S)
        self.client = RolloutClient(self.url, timeout=WAIT_S * 3)

    @property
    def address(self) -> str:
        """Its one receiver (the hf engine's)."""
        (address,) = self.addresses
        return address

    def close(self) -> None:  # type: ignore[override]
        self.client.close()
        super().close(WAIT_S)


@contextlib.contextmanager
def live_server(model: Path, **options: object) -> Iterator[LiveServer]:
    server = LiveServer(model, **options)
    try:
        yield server
    finally:
        server.close()
