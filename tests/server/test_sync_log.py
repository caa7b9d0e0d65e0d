"""The server logs every sync on one line (version, bytes, seconds, outcome), and every push the
engine refuses, with its reason."""

from __future__ import annotations

import logging

import torch
from safetensors.torch import load_file

from tests.server.conftest import live_server
from weightsync import WeightSender


def test_each_sync_and_each_refused_push_is_one_line(tiny_models, caplog) -> None:
    model = tiny_models["qwen2"]
    good = load_file(model / "model.safetensors")
    caplog.set_level(logging.INFO, logger="weightsync.server.sync")
    with live_server(model) as server, WeightSender([server.address], timeout=20.0) as sender:
        report = sender.push(good, 1)
        assert sender.push(good | {"extra.weight": torch.zeros(4)}, 2).failed
    lines = [r.getMessage() for r in caplog.records if r.name == "weightsync.server.sync"]
    assert lines[0].startswith(f"sync of version 1 committed: {report.total_bytes} bytes in "), lines
    assert lines[0].endswith(" GB/s)")
    assert lines[1].startswith("push of version 2 refused (") and "unknown tensor 'extra.weight'" in lines[1], lines
    assert len(lines) == 2, lines
