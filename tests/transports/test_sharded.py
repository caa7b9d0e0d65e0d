"""Sharded sync through the public API: several senders (the ranks of a trainer, here threads),
each holding rows of every tensor, push one version into receivers that keep boxes of the
tensors. Every receiver lands exactly what a full push would have given it, receives only its
boxes, commits only once every part landed, and a part that fails or never comes aborts the sync
on every receiver, which keeps what it held."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import helpers
from tests.helpers import RowShards, assert_bit_exact, random_tensor, wait_until
from tests.models import save_model
from weightsync import SyncReport, TensorDictSink, WeightReceiver, WeightSender, WeightSink
from weightsync.digest import source_digest
from weightsync.messages import Want
from weightsync.source import Held, SourceLayout

TRANSPORTS = ["inproc", "shm", "tcp", "collective"]
TIMEOUT_S = 10.0


class Keeps(TensorDictSink):
    """Destinations of the whole tensors, of which it keeps `wants`."""

    def __init__(self, tensors: dict[str, torch.Tensor], wants: tuple[Want, ...]) -> None:
        super().__init__(tensors)
        self._wants = wants

    def wants(self) -> tuple[Want, ...]:
        return self._wants


class Loads(WeightSink):
    """A loader keeping `wants`: what it is handed, copied."""

    def __init__(self, wants: tuple[Want, ...]) -> None:
        self._wants = wants
        self.loaded: dict[str, torch.Tensor] = {}

    def wants(self) -> tuple[Want, ...]:
        return self._wants

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.loaded.update((name, tensor.clone()) for name, tensor in named_tensors)


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    return {
        "embed": random_tensor(torch.float32, (9, 8), seed),
        "q": random_tensor(torch.bfloat16, (8, 8), seed + 1),
        "norm": random_tensor(torch.float32, (8,), seed + 2),
        "down": random_tensor(torch.float32, (8, 12), seed + 3),
        "experts": random_tensor(torch.float16, (4, 6, 8), seed + 4),
    }


WORKER_0 = (Want("embed", (0, 0), (5, 8)), Want("q", (0, 0), (4, 8)), Want("down", (0, 0), (8, 6)))
WORKER_1 = (
    Want("embed", (5, 0), (9, 8)),
    Want("q", (4, 0), (8, 8)),
    Want("down", (0, 6), (8, 12)),
    Want("experts", (0, 3, 0), (4, 6, 8)),
    Want("norm", (0,), (8,)),
)
"""Two tensor-parallel workers: rows of embed and q, columns of down; worker 1 also keeps half of
every expert and the whole norm, and names everything, worker 0 names neither (it is sent them
whole: its loaders could not be traced for them)."""


def box(want: Want) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in zip(want.start, want.stop, strict=True))


def push_from_ranks(addresses: list[str], sources: list[object], version: int) -> list[SyncReport]:
    return helpers.push_from_ranks(
        addresses, sources, version, timeout=TIMEOUT_S, bucket_bytes=256, verify="bucket", raise_on_failure=False
    )


class BoxShards(RowShards):
    """Rank `rank` of 2 holding boxes of every tensor along any dimension (as Megatron's tensor
    parallelism splits a model): rows of embed, columns of q and down (unevenly), the norm whole
    on rank 1, the experts split along their middle dimension."""

    HELD: dict[str, tuple[Held | None, ...]] = {
        "embed": (((0, 5),), ((5, 9),)),
        "q": (((0, 8), (0, 4)), ((0, 8), (4, 8))),
        "norm": (None, ()),
        "down": (((0, 8), (0, 5)), ((0, 8), (5, 12))),
        "experts": (((0, 4), (0, 2)), ((0, 4), (2, 6))),
    }

    def layout(self) -> SourceLayout:
        return SourceLayout(self.rank, self.world, tuple(self.HELD[name] for name in self.full))

    def held(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.full.items():
            held = self.HELD[name][self.rank]
            yield name, tensor[tuple(slice(a, b) for a, b in held)] if held is not None else tensor[:0]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(("split", "world"), [(RowShards, 1), (RowShards, 2), (RowShards, 3), (BoxShards, 2)])
def test_every_rank_sends_its_rows_and_each_receiver_gets_its_boxes(
    transport: str, split: type[RowShards], world: int
) -> None:
    full = model()
    whole = {name: torch.zeros_like(t) for name, t in full.items()}
    kept = {name: torch.zeros_like(t) for name, t in full.items()}
    loader = Loads(WORKER_1)
    receivers = [
        WeightReceiver(whole, transport, timeout=TIMEOUT_S),
        WeightReceiver(Keeps(kept, WORKER_0), transport, timeout=TIMEOUT_S),
        WeightReceiver(loader, transport, timeout=TIMEOUT_S),
    ]
    with receivers[0].start(), receivers[1].start(), receivers[2].start():
        addresses = [receiver.address for receiver in receivers]
        reports = push_from_ranks(addresses, [split(full, rank, world) for rank in range(world)], 1)
        assert all(report.ok for report in reports), [report.summary() for report in reports]
        assert all(receiver.version == 1 and receiver.state == "ready" for receiver in receivers)

    for name, tensor in full.items():
        assert_bit_exact(whole[name], tensor, name)
        want = {w.name: w for w in WORKER_0}.get(name)
        assert_bit_exact(kept[name][box(want)] if want else kept[name], tensor[box(want)] if want else tensor, name)
    assert sorted(loader.loaded) == sorted(full)
    for want in WORKER_1:
        assert_bit_exact(loader.loaded[want.name], full[want.name][box(want)], want.name)

    assert {report.content_digest for report in reports} == {source_digest(full)}, "every rank hears it"
    assert [receiver.content_digest for receiver in receivers] == [source_digest(full)] * 3, (
        "every receiver holds the digest of the whole version, whatever the layout"
    )
    received = [sum(report.outcomes[i].wire_bytes for report in reports) for i in range(3)]
    boxes = [sum(t.nbytes for t in full.values()), 0, sum(t.nbytes for t in loader.loaded.values())]
    boxes[1] = sum(full[w.name][box(w)].nbytes for w in WORKER_0) + full["norm"].nbytes + full["experts"].nbytes
    assert received == boxes, "every receiver is sent its boxes, each element once"
    assert reports[0].whole_tensors == ("experts", "norm"), "worker 0 named neither: sent whole, and said"


def test_a_checkpoint_sends_each_receiver_its_boxes_read_as_slices(tmp_path: Path, monkeypatch: Any) -> None:
    """`weightsync push --model DIR` to a tensor-parallel server: each worker is sent its boxes,
    read from the files as slices (no whole tensor read), and holds the digest of the whole."""
    from safetensors.torch import save_file

    from weightsync.checkpoint import SafetensorsSource

    full = model()
    save_file(full, str(tmp_path / "model.safetensors"))
    kept = {name: torch.zeros_like(t) for name, t in full.items()}
    loader = Loads(WORKER_1)
    monkeypatch.setattr(SafetensorsSource, "tensors", lambda self: pytest.fail("a whole tensor was read"))
    with (
        WeightReceiver(Keeps(kept, WORKER_0), "tcp", timeout=TIMEOUT_S) as one,
        WeightReceiver(loader, "tcp", timeout=TIMEOUT_S) as two,
        WeightSender([one.address, two.address], timeout=TIMEOUT_S) as sender,
    ):
        report = sender.push(SafetensorsSource(tmp_path), 1)
    for want in WORKER_0:
        assert_bit_exact(kept[want.name][box(want)], full[want.name][box(want)], want.name)
    for want in WORKER_1:
        assert_bit_exact(loader.loaded[want.name], full[want.name][box(want)], want.name)
    sent = [sum(full[w.name][box(w)].nbytes for w in WORKER_0) + full["norm"].nbytes + full["experts"].nbytes]
    sent.append(sum(t.nbytes for t in loader.loaded.values()))
    assert [outcome.wire_bytes for outcome in report.outcomes] == sent, "each receiver is sent its boxes"
    monkeypatch.undo()
    with WeightReceiver(Loads(WORKER_1), "tcp", timeout=TIMEOUT_S) as three:
        with WeightSender([three.address], timeout=TIMEOUT_S, verify="bucket") as sender:
            report = sender.push(SafetensorsSource(tmp_path), 1)
        assert report.content_digest == three.content_digest == source_digest(full)


@pytest.mark.parametrize("transport", ["shm", "tcp", "collective"])
def test_a_failed_part_aborts_the_sync_on_every_receiver_and_the_next_push_lands(transport: str) -> None:
    first, second = model(0), model(10)
    whole = {name: torch.zeros_like(t) for name, t in first.items()}
    loader = Loads(WORKER_1)
    with (
        WeightReceiver(whole, transport, timeout=TIMEOUT_S) as one,
        WeightReceiver(loader, transport, timeout=TIMEOUT_S) as two,
    ):
        addresses = [one.address, two.address]
        assert all(r.ok for r in push_from_ranks(addresses, [RowShards(first, rank, 2) for rank in range(2)], 1))
        failing = [RowShards(second, 0, 2), RowShards(second, 1, 2, fail_at="down")]
        with pytest.raises(RuntimeError, match="lost down"):
            push_from_ranks(addresses, failing, 2)
        # rank 0's rows were written in place into one's live tensors: dirty, no version; two's
        # loader takes only complete tensors, and kept version 1
        assert (one.state, one.version, two.state, two.version) == ("dirty", None, "ready", 1)
        assert "version 2" in one.last_error and "version 2" in two.last_error
        reports = push_from_ranks(addresses, [RowShards(second, rank, 2) for rank in range(2)], 3)
        assert all(report.ok for report in reports)
        assert one.version == 3 and two.version == 3
    for name, tensor in second.items():
        assert_bit_exact(whole[name], tensor, name)


def test_a_part_that_never_comes_fails_the_sync_within_the_timeout() -> None:
    full = model()
    whole = {name: torch.zeros_like(t) for name, t in full.items()}
    with WeightReceiver(whole, "tcp", timeout=2.0) as receiver:
        with WeightSender(receiver.address, timeout=TIMEOUT_S, raise_on_failure=False) as sender:
            report = sender.push(RowShards(full, 0, 2), version=1)
        assert not report.ok and "parts [1] did not land" in report.outcomes[0].error
        assert receiver.version is None


@pytest.mark.parametrize("transport", ["shm", "tcp", "collective"])
@pytest.mark.parametrize("leaves", ["before the offer", "during the sync", "before its first part"])
def test_a_rank_that_leaves_before_offering_its_part_fails_the_sync_at_once(transport: str, leaves: str) -> None:
    """Rank 1's sender closes (its process died, say) before it offers its part of rank 0's
    push: having sent its part of version 1, before rank 0 offers version 2 or while version 2
    waits for it; or having connected and never offered, while version 1 waits for it (no
    connected sender is left to send part 1). The receiver refuses or aborts the sync then, not
    at its timeout."""
    full = model()
    whole = {name: torch.zeros_like(t) for name, t in full.items()}
    with WeightReceiver(whole, transport, timeout=30.0) as receiver:
        senders = [WeightSender(receiver.address, timeout=30.0, bucket_bytes=256, raise_on_failure=False) for _ in "ab"]
        try:
            version = 1
            if leaves == "before its first part":
                assert senders[1].connect() == {}
            else:
                pushed = [
                    threading.Thread(target=senders[rank].push, args=(RowShards(full, rank, 2), 1)) for rank in (0, 1)
                ]
                for thread in pushed:
                    thread.start()
                for thread in pushed:
                    thread.join(4 * TIMEOUT_S)
                assert receiver.version == 1
                version = 2
            reports: list[SyncReport] = []
            rank0 = threading.Thread(target=lambda: reports.append(senders[0].push(RowShards(full, 0, 2), version)))
            started = time.monotonic()
            if leaves == "before the offer":
                senders[1].close()
                time.sleep(0.2)  # the receiver heard it
            rank0.start()
            if leaves != "before the offer":
                assert wait_until(lambda: receiver.state == "syncing", TIMEOUT_S)
                senders[1].close()
            rank0.join(4 * TIMEOUT_S)
            seconds = time.monotonic() - started
        finally:
            for sender in senders:
                sender.close()
    (report,) = reports
    why = "parts [1] of the sync cannot come from 0 other senders" if version == 1 else "the sender of part 1 closed"
    assert not report.ok and why in report.outcomes[0].error, report.summary()
    assert seconds < 10.0, f"{seconds:.1f} s: the receiver waited out its timeout (30 s)"
    assert receiver.version == (1 if version == 2 else None) or receiver.state == "dirty"


def fsdp_ranks(
    target: list[str], model: Path, transport: str, out: Path, versions: int = 1
) -> list[list[dict[str, Any]]]:
    """Two FSDP2 ranks (torchrun, gloo: `weightsync_bench.fsdp_ranks`) push the checkpoint at
    `model` `versions` times, sharded, to `target` (`["--to", ADDRESS]`, `["--vllm", URL]`);
    each rank's pushes, as it reported them."""
    command = [*(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m")]
    command += ["weightsync_bench.fsdp_ranks", "--model", str(model), "--out", str(out)]
    command += ["--transport", transport, "--versions", str(versions), *target]
    subprocess.run(command, check=True, timeout=600, cwd=out, env=os.environ | {"OMP_NUM_THREADS": "1"})
    return [json.loads((out / f"rank{rank}.json").read_text())["pushes"] for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "collective"])
@pytest.mark.parametrize("kind", ["qwen2", "qwen3_moe"])
def test_fsdp2_ranks_push_their_shards_through_weight_sender(kind: str, transport: str, tmp_path: Path) -> None:
    """A real FSDP2 trainer (2 ranks, gloo): every rank's `WeightSender` pushes its rows of a
    dense model (`ModuleSource(sharded=True)`) or of a mixture of experts in its checkpoint's
    names (`HFCheckpointSource(sharded=True)`: each expert whole from the rank holding it)."""
    from safetensors.torch import load_file

    save_model(kind, tmp_path / "model")
    checkpoint = load_file(tmp_path / "model" / "model.safetensors")
    landed = {name: torch.zeros_like(tensor) for name, tensor in checkpoint.items()}
    with WeightReceiver(landed, transport, timeout=60) as receiver:
        ranks = fsdp_ranks(["--to", receiver.address], tmp_path / "model", transport, tmp_path)
        assert receiver.version == 1
    assert all(push["ok"] for rank in ranks for push in rank)
    sent = [push["wire_bytes"][receiver.address] for rank in ranks for push in rank]
    assert sum(sent) == sum(tensor.nbytes for tensor in checkpoint.values()), "every element once"
    assert all(0 < bytes_ < sum(sent) for bytes_ in sent), "both ranks sent a part"
    for name, tensor in checkpoint.items():
        assert_bit_exact(landed[name], tensor, name)
    assert receiver.content_digest == source_digest(checkpoint), "the digest of the checkpoint, pushed in parts"


def stepped_weights(model_dir: Path, steps: int) -> Any:
    """The weights the FSDP2 ranks of `fsdp_ranks(..., "--delta")` end with after `steps` training
    steps (`weightsync_bench.fsdp_ranks.train_step`), as a source of whole tensors in the names
    they push."""
    from transformers import AutoModelForCausalLM

    from weightsync_bench.fsdp_ranks import train_step, trainer_source

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    for step in range(1, steps + 1):
        train_step(model, step)
    return trainer_source(model, sharded=False, vllm_source=False)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2", "qwen3_moe"])
def test_fsdp2_ranks_push_deltas_of_their_shards_exact(kind: str, tmp_path: Path) -> None:
    """A real FSDP2 trainer (2 ranks, gloo) stepping between pushes: every rank diffs its rows
    against its own baseline, the ranks exchange over torch.distributed, and the receiver lands
    the patches exact, with the digest of the weights the trainer ends with."""
    save_model(kind, tmp_path / "model")
    expected = dict(stepped_weights(tmp_path / "model", steps=3).tensors())
    landed = {name: torch.zeros_like(tensor) for name, tensor in expected.items()}
    full_bytes = sum(tensor.nbytes for tensor in expected.values())
    with WeightReceiver(landed, "tcp", timeout=60) as receiver:
        ranks = fsdp_ranks(["--to", receiver.address, "--delta"], tmp_path / "model", "tcp", tmp_path, versions=4)
        assert receiver.version == 4 and receiver.status.mode == "delta"
    assert all(push["ok"] for rank in ranks for push in rank), ranks
    assert [push["modes"][receiver.address] for push in ranks[0]] == ["full", "delta", "delta", "delta"]
    for push in range(1, 4):
        sent = sum(rank[push]["wire_bytes"][receiver.address] for rank in ranks)
        assert 0 < sent < 0.5 * full_bytes, (push, sent, full_bytes)
    for name, tensor in expected.items():
        assert_bit_exact(landed[name], tensor, name)
    digest = source_digest(expected)
    assert receiver.content_digest == digest == ranks[0][-1]["content_digest"] == ranks[1][-1]["content_digest"]


def half_rows(checkpoint: dict[str, torch.Tensor], worker: int) -> tuple[Want, ...]:
    """What tensor-parallel worker `worker` of two keeps: half the rows of every matrix, the rest whole."""
    wants = []
    for name, tensor in checkpoint.items():
        rows = len(tensor) // 2 if tensor.dim() == 2 else 0
        first, end = (worker * rows, rows + worker * (len(tensor) - rows)) if rows else (0, len(tensor))
        wants.append(Want(name, (first, *[0] * (tensor.dim() - 1)), (end, *tensor.shape[1:])))
    return tuple(wants)


@pytest.mark.slow
def test_the_docs_sharded_program_runs_as_written(tmp_path: Path) -> None:
    """docs/deployment.md's sharded trainer, as written, on two ranks (torchrun, gloo) into two
    tensor-parallel workers (receivers keeping half the rows of every matrix)."""
    from safetensors.torch import load_file

    from tests.doc_snippets import write_program

    heading = "## A sharded trainer into tensor-parallel engines: every rank pushes its part"
    program = write_program("docs/deployment.md", heading, tmp_path / "sharded_push.py")
    save_model("qwen2", tmp_path / "model")
    checkpoint = load_file(tmp_path / "model" / "model.safetensors")
    held = [{name: torch.zeros_like(t) for name, t in checkpoint.items()} for _ in range(2)]
    with (
        WeightReceiver(Keeps(held[0], half_rows(checkpoint, 0)), "tcp", timeout=60) as one,
        WeightReceiver(Keeps(held[1], half_rows(checkpoint, 1)), "tcp", timeout=60) as two,
    ):
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(program)]
        command += [str(tmp_path / "model"), one.address, two.address]
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        said = [line.split(" committed on 2 of 2 receivers")[0] for line in done.stdout.splitlines()]
        assert said == ["version 1", "version 2", "version 3"], done.stdout
        assert one.version == two.version == 3 and one.content_digest == two.content_digest != "", "one version"
    embedding = "model.embed_tokens.weight"
    assert not torch.equal(held[0][embedding][:4], checkpoint[embedding][:4]), "trained, then pushed"
    assert torch.equal(held[0][embedding][-4:], torch.zeros_like(checkpoint[embedding][-4:])), "worker 0: its half"
