"""Megatron-Core trainers (real megatron-core, 2 gloo ranks, scripts/install-megatron.sh) push
what each rank holds, in the checkpoint's names, with no gather (`MegatronSource`): tensor, pipeline
and expert parallel layouts of one Qwen3-MoE checkpoint, and a tied, biased Qwen2 one, pushed
in turn into the same receivers. The oracle is the checkpoint the ranks loaded (tests/megatron_cpu.py
cuts it into Megatron's layout on its own): each receiver lands it bit for bit, or exactly its
boxes of it, each element once, with the checkpoint's own content digest. With delta, the ranks
step between pushes and each diffs what it holds: the receiver gets patches, and ends with what a
full push of the same weights gives a fresh receiver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import assert_bit_exact, missing_package
from tests.models import model_config, save_model
from tests.transports.test_sharded import Keeps
from weightsync import WeightReceiver
from weightsync.digest import source_digest
from weightsync.messages import Want

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(missing_package("megatron.core"), reason="megatron-core: scripts/install-megatron.sh"),
]

ROOT = Path(__file__).resolve().parents[2]


def second_half(checkpoint: dict[str, torch.Tensor]) -> tuple[Want, ...]:
    """What worker 1 of 2 tensor-parallel workers keeps: the second half of the rows of q, k, v,
    gate, up and the vocabulary, of the columns of o and down; norms and experts whole."""
    wants = []
    for name, tensor in checkpoint.items():
        shape = tuple(tensor.shape)
        dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) and "experts" not in name else 0
        if tensor.dim() < 2 or "experts" in name or "mlp.gate." in name:
            wants.append(Want(name, (0,) * len(shape), shape))
            continue
        start = tuple(shape[d] // 2 if d == dim else 0 for d in range(len(shape)))
        wants.append(Want(name, start, shape))
    return tuple(wants)


def ranks(model: Path, out: Path, layout: tuple[int, int, int], version: int, *target: str) -> list[dict[str, Any]]:
    """Two Megatron ranks (torchrun, gloo: `weightsync_bench.megatron_ranks`) at `layout` (TP, PP,
    EP) push the checkpoint at `model` once, as `version`, to `target`; each rank's push, as it
    reported it."""
    tp, pp, ep = layout
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m"]
    command += ["weightsync_bench.megatron_ranks", "--model", str(model), "--out", str(out)]
    command += ["--tp", str(tp), "--pp", str(pp), "--ep", str(ep), "--version", str(version), *target]
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]  # this checkout's weightsync first
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(paths)}
    subprocess.run(command, check=True, timeout=600, cwd=out, env=env)
    return [pushes[0] for pushes in rank_pushes(out)]


def rank_pushes(out: Path) -> list[list[dict[str, Any]]]:
    """Each rank's pushes, in order, as `megatron_ranks` wrote them to `out`."""
    return [json.loads((out / f"rank{rank}.json").read_text())["pushes"] for rank in range(2)]


def save(kind: str, path: Path) -> None:
    """The tests' tiny `kind` checkpoint at `path`; Qwen2 with 2 query groups (Megatron splits
    whole groups over 2 tensor-parallel ranks)."""
    from transformers import AutoModelForCausalLM

    if kind != "qwen2":
        save_model(kind, path)
        return
    config = model_config(kind)
    config.num_key_value_heads = 2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2"])
def receivers(request: Any, tmp_path_factory: Any) -> Iterator[tuple[str, Path, dict[str, torch.Tensor], list[Any]]]:
    """A checkpoint, and two receivers of it started once: one keeps every tensor whole, one the
    boxes of a tensor-parallel worker."""
    from safetensors.torch import load_file

    path = tmp_path_factory.mktemp(request.param) / "model"
    save(request.param, path)
    checkpoint = load_file(path / "model.safetensors")
    whole = {name: torch.zeros_like(tensor) for name, tensor in checkpoint.items()}
    kept = {name: torch.zeros_like(tensor) for name, tensor in checkpoint.items()}
    found = [
        (WeightReceiver(whole, "tcp", timeout=120), whole),
        (WeightReceiver(Keeps(kept, second_half(checkpoint)), "tcp", timeout=120), kept),
    ]
    with found[0][0].start(), found[1][0].start():
        yield request.param, path, checkpoint, found


LAYOUTS = {"qwen3_moe": [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2)], "qwen2": [(2, 1, 1), (1, 2, 1)]}


@pytest.mark.parametrize("index", range(4))
def test_every_megatron_layout_lands_the_checkpoint(index: int, receivers: Any, tmp_path: Path) -> None:
    kind, path, checkpoint, found = receivers
    if index >= len(LAYOUTS[kind]):
        pytest.skip(f"{kind}: {len(LAYOUTS[kind])} layouts")
    layout = LAYOUTS[kind][index]
    for _, tensors in found:
        for tensor in tensors.values():
            tensor.zero_()
    version = index + 1
    pushes = ranks(path, tmp_path, layout, version, "--to", *(receiver.address for receiver, _ in found))
    assert all(push["ok"] for push in pushes), pushes
    (whole, landed), (kept, boxes) = found
    assert whole.version == kept.version == version
    for name, tensor in checkpoint.items():
        assert_bit_exact(landed[name], tensor, name)
    wants = {want.name: want for want in second_half(checkpoint)}
    for name, tensor in checkpoint.items():
        box = tuple(slice(a, b) for a, b in zip(wants[name].start, wants[name].stop, strict=True))
        assert_bit_exact(boxes[name][box], tensor[box], name)
    digest = source_digest(checkpoint)
    assert whole.content_digest == kept.content_digest == digest, "the checkpoint's digest, whatever the layout"
    sent = [sum(push["wire_bytes"][receiver.address] for push in pushes) for receiver, _ in found]
    kept_bytes = sum(
        checkpoint[name][tuple(slice(a, b) for a, b in zip(w.start, w.stop, strict=True))].nbytes
        for name, w in wants.items()
    )
    assert sent == [sum(tensor.nbytes for tensor in checkpoint.values()), kept_bytes], "each element once"
    assert all(push["wire_bytes"][found[0][0].address] > 0 for push in pushes), "both ranks sent a part"


DELTA_LAYOUTS = {"qwen3_moe": (1, 1, 2), "qwen2": (2, 1, 1)}
"""One layout each: experts owned by one rank each, and tensors cut by tensor parallelism (the
patches' indices are the whole tensors')."""


def test_megatron_ranks_push_deltas_of_what_they_hold_exact(receivers: Any, tmp_path: Path) -> None:
    """Three pushes with delta (a training step before the second and the third), then the last
    weights in full to a fresh receiver: the second and third reach the receiver that holds the
    version before as patches, a fraction of a full push, and it ends bit for bit with what the
    full push gave, and the same content digest."""
    kind, path, checkpoint, found = receivers
    (receiver, landed), _ = found
    full_bytes = sum(tensor.nbytes for tensor in checkpoint.values())
    reference = {name: torch.zeros_like(tensor) for name, tensor in checkpoint.items()}
    fresh = WeightReceiver(reference, "tcp", timeout=120)
    with fresh.start():
        target = ["--to", receiver.address, "--versions", "3", "--delta", "--then-full-to", fresh.address]
        ranks(path, tmp_path, DELTA_LAYOUTS[kind], 101, *target)
    pushes = rank_pushes(tmp_path)
    assert all(push["ok"] for rank in pushes for push in rank), pushes
    for rank in pushes:
        assert [push["modes"][receiver.address] for push in rank[:3]] == ["full", "delta", "delta"], rank
    for step in (1, 2):
        sent = sum(rank[step]["wire_bytes"][receiver.address] for rank in pushes)
        assert 0 < sent < 0.25 * full_bytes, (step, sent, full_bytes)
    assert receiver.version == fresh.version == 103
    for name in checkpoint:
        assert_bit_exact(landed[name], reference[name], name)
    assert receiver.content_digest == fresh.content_digest != source_digest(checkpoint), "the weights moved"
    assert pushes[0][2]["content_digest"] == receiver.content_digest
