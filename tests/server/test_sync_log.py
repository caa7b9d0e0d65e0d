"""The server logs every sync on one line (version, bytes, seconds, outcome), and every push the
engine refuses once, with its reason; the sending side says it once too: the push raises it."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file

from tests.server.conftest import live_server
from weightsync import SyncFailed, WeightSender


def test_each_sync_and_each_refused_push_is_one_line(tiny_models, caplog) -> None:
    model = tiny_models["qwen2"]
    good = load_file(model / "model.safetensors")
    caplog.set_level(logging.INFO, logger="weightsync")
    with live_server(model) as server, WeightSender([server.address], timeout=20.0) as sender:
        report = sender.push(good, 1)
        with pytest.raises(SyncFailed) as refused:
            sender.push(good | {"extra.weight": torch.zeros(4)}, 2)
    assert "unknown tensor 'extra.weight'" in str(refused.value)
    synced = [r.getMessage() for r in caplog.records if r.name == "weightsync.serving.control"]
    assert synced[0].startswith(f"sync of version 1 committed on 1 worker(s): {report.total_bytes} bytes in "), synced
    assert synced[0].endswith(" GB/s)") and len(synced) == 1, synced
    # the refusal: one warning on the server's side (its receiver), none on the sender's
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING and "'extra.weight'" in r.getMessage()]
    assert [r.name for r in warned] == ["weightsync.receiver"], [(r.name, r.getMessage()) for r in warned]
    assert warned[0].getMessage().startswith("push of version 2 refused ("), warned[0].getMessage()


def test_serve_s_sync_lines_come_whatever_an_engine_makes_of_the_root_logger() -> None:
    """vLLM's app sets the root logger to ERROR as it builds (it imports SageMaker's routes): the
    server's sync lines still come, at the level `weightsync serve --log-level` names."""
    from weightsync.cli.serve import configure_logging

    root, ours = logging.getLogger(), logging.getLogger("weightsync")
    levels = root.level, ours.level
    try:
        configure_logging("info")
        root.setLevel(logging.ERROR)  # what vLLM's build_app leaves
        assert logging.getLogger("weightsync.serving.control").isEnabledFor(logging.INFO)
    finally:
        root.setLevel(levels[0])
        ours.setLevel(levels[1])
