"""/metrics counts committed syncs by how they travelled: full, or delta (a patch in place)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from tests.server.conftest import live_server
from weightsync import WeightSender


def modes(text: str) -> dict[str, float]:
    prefix = "weightsync_sync_modes_total{mode="
    return {
        line[len(prefix) + 1 : line.index('"', len(prefix) + 1)]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


def test_metrics_count_full_and_delta_syncs(tiny_models) -> None:
    model_dir = tiny_models["qwen2"]
    weights = load_file(model_dir / "model.safetensors")
    with (
        live_server(model_dir) as server,
        WeightSender([server.address], timeout=20.0, delta="all") as sender,
    ):
        assert modes(server.client.metrics()) == {"full": 0.0, "delta": 0.0}
        for version in range(3):
            report = sender.push(weights, version)
            assert report.ok, report.failed
            assert report.outcomes[0].mode == ("full" if version == 0 else "delta")
            name = next(iter(weights))
            weights[name] = weights[name].clone()
            weights[name].view(-1)[:3] += torch.tensor(1.0, dtype=weights[name].dtype)  # a few changed
        assert modes(server.client.metrics()) == {"full": 1.0, "delta": 2.0}
