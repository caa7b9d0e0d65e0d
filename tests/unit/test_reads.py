"""reads.py: the box of each checkpoint tensor an engine's loaders read, found by a dry run on
tensors without storage, and what a sharded push makes of it. A tensor whose reads name no box
falls back to the whole tensor, for that tensor only: the sender's report names it, and the
sync stays exact."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from tests.helpers import assert_bit_exact, random_tensor
from weightsync import SyncReport, WeightReceiver, WeightSender, WeightSink
from weightsync.messages import Want
from weightsync.reads import loader_reads, view_box
from weightsync.source import SourceLayout, StateDictSource, TensorMeta, chunk_rows


def test_views_name_their_box() -> None:
    whole = torch.empty(8, 6, device="meta")
    cases = {
        "rows": (whole.narrow(0, 2, 3), ((2, 0), (5, 6))),
        "columns": (whole[:, 3:], ((0, 3), (8, 6))),
        "a block": (whole[4:, 1:3], ((4, 1), (8, 3))),
        "transposed": (whole.t()[1:4, 2:6], ((2, 1), (6, 4))),
        "one row": (whole.select(0, 7), ((7, 0), (8, 6))),
        "rows as a flat view": (whole[2:4].reshape(-1), ((2, 0), (4, 6))),
        "a chunk": (whole.chunk(2, dim=1)[1], ((0, 3), (8, 6))),
    }
    for what, (view, box) in cases.items():
        assert view_box(view, (8, 6)) == box, what
    assert view_box(whole[::2], (8, 6)) is None, "every other row is no box"


class Engine:
    """A tensor-parallel rank of a toy engine, with loaders written the way vLLM's are: each
    narrows the checkpoint tensor to its rank's part and copies it into its parameter."""

    def __init__(self, rank: int, world: int, device: str = "meta") -> None:
        self.rank, self.world = rank, world
        self.params = {
            "embed": torch.zeros(8 // world, 6, device=device),
            "down": torch.zeros(6, 12 // world, device=device),
            "norm": torch.zeros(6, device=device),
            "odd": torch.zeros(5, device=device),
            "later": torch.zeros(3, device=device),
            f"experts.{rank}": torch.zeros(2, 3, device=device),  # expert parallel: one expert per rank
        }
        self.held: list[torch.Tensor] = []

    def load(self, name: str, tensor: torch.Tensor) -> None:
        param = self.params.get(name)
        if name == "embed":  # rows: a vocabulary-parallel embedding
            param.copy_(tensor.narrow(0, self.rank * param.shape[0], param.shape[0]))
        elif name == "down":  # columns: a row-parallel linear layer
            param.copy_(tensor.narrow(1, self.rank * param.shape[1], param.shape[1]))
        elif name == "norm":  # replicated
            param.copy_(tensor)
        elif name.startswith("experts."):  # another rank's expert is not read at all
            if name in self.params:
                param.copy_(tensor)
        elif name == "later":  # a loader that holds the tensor, as one that loads a layer once all of it came
            self.held.append(tensor)
            param.copy_(tensor)
        else:  # a loader that computes on the tensor first: its reads name no box
            param.copy_((tensor.clone() * 2)[: param.shape[0]])


METAS = [
    TensorMeta("embed", (8, 6), torch.float32),
    TensorMeta("down", (6, 12), torch.float32),
    TensorMeta("norm", (6,), torch.float32),
    TensorMeta("odd", (7,), torch.float32),
    TensorMeta("later", (3,), torch.float32),
    TensorMeta("experts.0", (2, 3), torch.float32),
    TensorMeta("experts.1", (2, 3), torch.float32),
]


def test_the_dry_run_finds_each_ranks_box_and_writes_nothing() -> None:
    live = Engine(1, 2, device="cpu")
    before = {name: param.clone() for name, param in live.params.items()}
    assert loader_reads(Engine(1, 2).load, METAS) == {
        "embed": ((4, 0), (8, 6)),
        "down": ((0, 6), (6, 12)),
        "norm": ((0,), (6,)),
        "odd": None,
        "later": None,
        "experts.0": ((0, 0), (0, 0)),
        "experts.1": ((0, 0), (2, 3)),
    }
    assert loader_reads(live.load, METAS[:1]) == {"embed": ((4, 0), (8, 6))}  # its parameters on the host
    for name, param in live.params.items():
        assert torch.equal(param, before[name]), f"the dry run wrote into {name}"


class Worker(WeightSink):
    """A worker of the toy engine: it keeps what its loaders read, and loads what it is sent
    (a box inside a tensor of the whole shape, as the vLLM worker does)."""

    def __init__(self, rank: int, world: int) -> None:
        self.engine = Engine(rank, world, device="cpu")
        reads = loader_reads(Engine(rank, world).load, METAS)
        self.kept = tuple(Want(name, *box) for name, box in reads.items() if box is not None)
        self.shapes = {meta.name: meta.shape for meta in METAS}
        self.specs: dict[str, object] = {}
        self.received = 0

    def wants(self) -> tuple[Want, ...]:
        return self.kept

    def begin(self, plan, version: int) -> None:  # type: ignore[no-untyped-def]
        self.specs = {spec.name: spec for spec in plan.tensors}

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_tensors:
            self.received += tensor.nbytes
            spec = self.specs[name]
            whole = torch.full(self.shapes[name], float("nan"))
            region = spec.region  # type: ignore[attr-defined]
            start = region.start if region is not None else (0,) * tensor.dim()
            whole[tuple(slice(a, a + n) for a, n in zip(start, tensor.shape, strict=True))] = tensor
            self.engine.load(name, whole)


class Ranks:
    """Rank `rank` of a trainer holding rows of every tensor (`ShardedSource`)."""

    def __init__(self, full: dict[str, torch.Tensor], rank: int, world: int) -> None:
        self.full, self.rank, self.world = full, rank, world

    def metas(self) -> list[TensorMeta]:
        return METAS

    def tensors(self):  # type: ignore[no-untyped-def]
        return iter(self.full.items())

    def layout(self) -> SourceLayout:
        return SourceLayout.from_rows(
            self.rank, self.world, tuple(chunk_rows(t.shape[0], self.world) for t in self.full.values())
        )

    def held(self):  # type: ignore[no-untyped-def]
        for name, tensor in self.full.items():
            bounds = chunk_rows(tensor.shape[0], self.world)
            yield name, tensor[bounds[self.rank] : bounds[self.rank + 1]]


@pytest.mark.parametrize("transport", ["inproc", "shm", "tcp"])
def test_an_underivable_tensor_goes_whole_is_named_once_and_the_sync_is_exact(transport: str, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="weightsync")
    full = {meta.name: random_tensor(meta.dtype, meta.shape, seed) for seed, meta in enumerate(METAS)}
    workers = [Worker(rank, 2) for rank in range(2)]
    with (
        WeightReceiver(workers[0], transport, timeout=10) as one,
        WeightReceiver(workers[1], transport, timeout=10) as two,
    ):
        reports: list[SyncReport] = []

        def push(rank: int) -> None:
            with WeightSender([one.address, two.address], timeout=10, bucket_bytes=128) as sender:
                reports.append(sender.push(Ranks(full, rank, 2), version=1))
                reports.append(sender.push(Ranks(full, rank, 2), version=2))

        threads = [threading.Thread(target=push, args=(rank,)) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert len(reports) == 4 and all(report.ok for report in reports)
    assert all(report.whole_tensors == ("later", "odd") for report in reports)
    said = [record for record in caplog.records if "sent whole" in record.getMessage()]
    assert len(said) == 2, "once per sender, not once per push"

    reference = [Engine(rank, 2, device="cpu") for rank in range(2)]
    for rank, engine in enumerate(reference):
        for name, tensor in full.items():
            engine.load(name, tensor)
        for name, param in engine.params.items():
            assert_bit_exact(workers[rank].engine.params[name], param, f"rank {rank} {name}")
    boxes = (full["embed"].nbytes + full["down"].nbytes) // 2 + full["norm"].nbytes + full["experts.0"].nbytes
    underivable = full["odd"].nbytes + full["later"].nbytes
    assert workers[0].received == 2 * (boxes + underivable), "its boxes, no other rank's expert, the underivable whole"


def test_a_source_made_on_demand_sends_whole_tensors_to_workers_keeping_different_boxes() -> None:
    full = {meta.name: random_tensor(meta.dtype, meta.shape, seed) for seed, meta in enumerate(METAS)}
    workers = [Worker(rank, 2) for rank in range(2)]

    class OnDemand(StateDictSource):
        holds_tensors = False

    with WeightReceiver(workers[0], "shm", timeout=10) as one, WeightReceiver(workers[1], "shm", timeout=10) as two:
        with WeightSender([one.address, two.address], timeout=10) as sender:
            assert sender.push(OnDemand(full), version=1).ok
    assert workers[0].received == sum(t.nbytes for t in full.values())
