"""The transport contract, run over every transport with inproc as the reference: what goes in
comes out bit for bit, chunked at any boundary, into a dict, a callable or a WeightSink, with
one negotiated bucket size, and every refusal reported per receiver while the others commit.

cudaipc runs it too, on a GPU host (marked `gpu`): its receivers stay in this process, with the
same sinks and the same assertions, and its pushes come from a child process (`SenderProcess`),
the source tensors moved to that process's GPU with their layout, because CUDA IPC does not open
a handle in the process that exported it. The few tests whose source or second sender cannot
leave this process skip it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import (
    DTYPES,
    TRANSPORTS,
    WAIT_S,
    Recorder,
    assert_all_bit_exact,
    assert_bit_exact,
    installed,
    non_contiguous,
    random_tensor,
    random_values,
    receiving,
    tensor_sets,
    wait_until,
)
from tests.peer_process import SenderProcess
from tests.peer_process import sending as sending_from_either
from weightsync import (
    Adapter,
    AdapterSink,
    Plan,
    PlanError,
    SinkTraits,
    StateDictSource,
    SyncFailed,
    TensorDictSink,
    TensorMeta,
    WeightReceiver,
    WeightSender,
    WeightSink,
)
from weightsync.digest import source_digest
from weightsync.lora import check_lora
from weightsync.transports import get_transport, links
from weightsync.wire import Connection

# --- cudaipc: pushed from a child process ----------------------------------------------------------


@pytest.fixture(params=[*TRANSPORTS, pytest.param("cudaipc", marks=pytest.mark.gpu)], scope="module")
def transport(request: pytest.FixtureRequest) -> str:
    """Each transport in turn, cudaipc included; inproc is the reference the others must match."""
    return request.param


_sender_process: list[SenderProcess] = []
"""The child process that pushes to this module's cudaipc receivers, once started."""


@pytest.fixture(scope="module", autouse=True)
def _stop_the_sender_process() -> Iterator[None]:
    yield
    while _sender_process:
        _sender_process.pop().close()


def sending(addresses: list[str] | str, **kwargs: object) -> contextlib.AbstractContextManager[Any]:
    """`tests.helpers.sending`, except that cudaipc receivers are pushed to from a child process
    whose sources are on its GPU: one process for the module, started on first use."""
    listed = [addresses] if isinstance(addresses, str) else addresses
    if any(address.startswith("cudaipc://") for address in listed) and not _sender_process:
        _sender_process.append(SenderProcess("cuda"))
    return sending_from_either(addresses, process=next(iter(_sender_process), None), **kwargs)


def source_stays_here(transport: str) -> None:
    """Skip cudaipc in a test whose source (a WeightSource class of the test's) or second sender
    must live in this process: cudaipc pushes from a child process."""
    if transport == "cudaipc":
        pytest.skip("cudaipc pushes from a child process; this test's source or sender cannot move there")


# --- random tensor sets (hypothesis), one receiver per transport for all examples ---------------


@pytest.fixture(scope="module")
def shared(transport):  # type: ignore[no-untyped-def]
    """One long-lived receiver per transport: a Recorder whose destinations each example sets."""
    sink = Recorder()
    receiver = WeightReceiver(sink, transport=transport, timeout=WAIT_S).start()
    yield receiver, sink, itertools.count(1)
    receiver.close()


def destinations_for(named: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Fresh destination tensors matching `named` (tied names share one destination)."""
    made: dict[int, torch.Tensor] = {}
    dest = {}
    for name, tensor in named.items():
        key = id(tensor)
        if key not in made:
            made[key] = non_contiguous(torch.zeros(tensor.shape, dtype=tensor.dtype), layout)
        dest[name] = made[key]
    return dest


@settings(max_examples=100)
@given(
    named=tensor_sets(),
    bucket_bytes=st.sampled_from([64, 128, 256, 576, 4096, "auto"]),
    delivery=st.sampled_from(["load", "in-place", "non-contiguous-destination"]),
)
def test_random_tensor_sets_round_trip_bit_exact(shared, named, bucket_bytes, delivery):
    receiver, sink, versions = shared
    dest = (
        None
        if delivery == "load"
        else destinations_for(named, "contiguous" if delivery == "in-place" else "transposed")
    )
    sink.reset(dest)
    version = next(versions)
    with sending(receiver.address, bucket_bytes=bucket_bytes) as sender:
        report = sender.push(named, version=version)
    assert report.ok, report.failed
    assert receiver.version == version and receiver.state == "ready"
    assert report.total_bytes == sum(t.numel() * t.element_size() for t in named.values())
    assert report.num_tensors == len(named)
    got = sink.received if dest is None else dest
    assert_all_bit_exact(got, {name: tensor.contiguous() for name, tensor in named.items()})
    assert sink.hooks()[0] == "begin" and sink.hooks()[-1] == "commit"


@st.composite
def master_weights(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """fp32/fp64/fp16/bf16 tensors of finite values, any layout, plus an int tensor casts leave alone."""
    out = {}
    for index in range(draw(st.integers(1, 5))):
        dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
        shape = draw(st.lists(st.integers(0, 40), min_size=0, max_size=2).map(tuple))
        layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
        out[f"w{index}"] = non_contiguous(random_values(dtype, shape, seed=index), layout)
    out["step"] = torch.arange(draw(st.integers(0, 9)))
    return out


@settings(max_examples=50)
@given(master=master_weights(), cast=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
def test_random_cast_on_send_matches_torch_conversion(shared, master, cast):
    receiver, sink, versions = shared
    sink.reset(None)
    version = next(versions)
    with sending(receiver.address, bucket_bytes=64, cast=cast) as sender:
        report = sender.push(master, version=version)
    assert report.ok, report.failed
    expected = {name: t if name == "step" else t.to(cast) for name, t in master.items()}
    assert_all_bit_exact(sink.received, {name: t.contiguous() for name, t in expected.items()})
    declared = {spec.name: (spec.source_dtype, spec.dtype) for spec in sink.plans[0].tensors}
    for name, tensor in master.items():
        assert declared[name][0] == str(tensor.dtype).removeprefix("torch.")
        assert declared[name][1] == str(expected[name].dtype).removeprefix("torch.")


# --- every dtype, every shape kind --------------------------------------------------------------

SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (5, 3), (2, 3, 4)]


def every_dtype_and_shape() -> dict[str, torch.Tensor]:
    return {
        f"{str(dtype).removeprefix('torch.')}{list(shape)}": random_tensor(dtype, shape, seed=i)
        for i, (dtype, shape) in enumerate(itertools.product(DTYPES, SHAPES))
    }


@pytest.mark.parametrize("delivery", ["dict", "callable", "sink"])
def test_every_dtype_and_shape_round_trips_bit_exact(transport, delivery):
    source = every_dtype_and_shape()
    received: dict[str, torch.Tensor] = {}
    if delivery == "dict":
        sink = {name: torch.zeros(t.shape, dtype=t.dtype) for name, t in source.items()}
        received = sink
    elif delivery == "callable":

        def sink(named):  # type: ignore[no-untyped-def]
            received.update((name, tensor.clone()) for name, tensor in named)

    else:
        sink = Recorder()
    with receiving(sink, transport) as receiver, sending(receiver.address, bucket_bytes=128) as sender:
        report = sender.push(source, version=1)
    assert report.ok, report.failed
    assert_all_bit_exact(sink.received if delivery == "sink" else received, source)


WIRE_EXTRAS = [torch.complex64] + [
    getattr(torch, name)
    for name in ("uint16", "uint32", "uint64", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
]
"""The rest of what the wire carries, beyond the dtypes a model usually has."""


@pytest.mark.parametrize("dtype", WIRE_EXTRAS, ids=str)
def test_other_wire_dtypes_round_trip(transport, dtype):
    source = {"t": random_tensor(dtype, (37,), seed=1), "s": random_tensor(dtype, (), seed=2)}
    dest = {name: torch.zeros(t.shape, dtype=t.dtype) for name, t in source.items()}
    with receiving(dest, transport) as receiver, sending(receiver.address, bucket_bytes=64) as sender:
        assert sender.push(source, version=1).ok
    assert_all_bit_exact(dest, source)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_dim_and_empty_tensors(transport, dtype):
    source = {
        "scalar": random_tensor(dtype, (), seed=1),
        "empty": torch.empty(0, dtype=dtype),
        "empty2d": torch.empty(4, 0, dtype=dtype),
        "after": random_tensor(dtype, (3,), seed=2),
    }
    dest = {name: torch.zeros(t.shape, dtype=t.dtype) for name, t in source.items()}
    with receiving(dest, transport) as receiver, sending(receiver.address) as sender:
        assert sender.push(source, version=1).ok
    assert_all_bit_exact(dest, source)


def _odd_strides(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Tensors torch calls contiguous although their strides are not the usual ones."""
    wide = random_tensor(dtype, (40,), seed=seed)
    return {
        "one-of-every-other": wide[::2][:1],
        "one-by-one": wide.as_strided((1, 1), (5, 3)),
        "empty-stepped": wide[::3][:0],
        "empty-2d": wide.as_strided((0, 4), (7, 2)),
        "zero-dim-view": wide[5],
    }


@pytest.mark.parametrize("dtype", [torch.bool, torch.int16, torch.bfloat16, torch.float32, torch.int64], ids=str)
def test_odd_strided_small_tensors_as_source_and_destination(transport, dtype):
    source = _odd_strides(dtype, seed=1)
    assert all(t.is_contiguous() for t in source.values())
    dest = _odd_strides(dtype, seed=2)
    received: dict[str, torch.Tensor] = {}

    def load(named):  # type: ignore[no-untyped-def]
        received.update((n, t.clone()) for n, t in named)

    with receiving(dest, transport) as a, receiving(load, transport) as b, sending([a.address, b.address]) as sender:
        report = sender.push(source, version=1)
    assert report.ok, report.failed
    assert_all_bit_exact(dest, source)
    assert_all_bit_exact(received, source)


def test_only_empty_tensors_and_no_tensors_at_all(transport):
    with receiving(Recorder(), transport) as receiver, sending(receiver.address) as sender:
        report = sender.push({}, version=1)
        assert report.ok and report.num_buckets == 0 and report.total_bytes == 0
        assert receiver.version == 1
        report = sender.push({"e": torch.empty(0), "f": torch.empty(0, 5, dtype=torch.bfloat16)}, version=2)
        assert report.ok and report.total_bytes == 0
        assert receiver.version == 2


@pytest.mark.parametrize("layout", ["transposed", "strided", "expanded", "sliced-rows"])
@pytest.mark.parametrize("bucket_bytes", [64, 4096])
def test_non_contiguous_sources(transport, layout, bucket_bytes):
    base = random_tensor(torch.float32, (12, 10), seed=3)
    if layout == "expanded":
        tensor = base[:1].expand(12, 10)  # stride 0: every row is the same memory
    elif layout == "sliced-rows":
        tensor = base[2:9:3]
    else:
        tensor = non_contiguous(base, layout)
    assert not tensor.is_contiguous()
    source = {"w": tensor, "small": base[:, 1]}
    dest = {name: torch.zeros(t.shape, dtype=t.dtype) for name, t in source.items()}
    with receiving(dest, transport) as receiver, sending(receiver.address, bucket_bytes=bucket_bytes) as sender:
        assert sender.push(source, version=1).ok
    assert_all_bit_exact(dest, {name: t.contiguous() for name, t in source.items()})


def test_non_contiguous_destinations_are_filled(transport):
    source = {"a": random_tensor(torch.bfloat16, (9, 40), seed=1), "b": random_tensor(torch.int32, (5, 7), seed=2)}
    dest = {
        "a": torch.zeros(40, 9, dtype=torch.bfloat16).t(),
        "b": torch.zeros(5, 14, dtype=torch.int32)[:, ::2],
    }
    assert not any(t.is_contiguous() for t in dest.values())
    with receiving(dest, transport) as receiver, sending(receiver.address, bucket_bytes=128) as sender:
        assert sender.push(source, version=1).ok
    assert_all_bit_exact(dest, source)


def test_unicode_names(transport):
    names = ["模型.层.0.权重", "Ñandú/peso", "emoji.🦙.weight", "Ελληνικά", "x" * 300, "a b\tc", "\u200bzero-width"]
    source = {name: random_tensor(torch.float16, (i + 1,), seed=i) for i, name in enumerate(names)}
    dest = {name: torch.zeros_like(t) for name, t in source.items()}
    with receiving(dest, transport) as receiver, sending(receiver.address) as sender:
        assert sender.push(source, version=1).ok
    assert_all_bit_exact(dest, source)


def test_tied_tensors(transport):
    """One tensor under two names (embedding and lm_head) on both sides."""
    embed = random_tensor(torch.bfloat16, (50, 8), seed=1)
    source = {"embed.weight": embed, "norm": random_tensor(torch.float32, (8,), seed=2), "lm_head.weight": embed}
    shared_dest = torch.zeros(50, 8, dtype=torch.bfloat16)
    dest = {"embed.weight": shared_dest, "norm": torch.zeros(8), "lm_head.weight": shared_dest}
    with receiving(dest, transport) as receiver, sending(receiver.address, bucket_bytes=256) as sender:
        report = sender.push(source, version=1)
    assert report.ok
    assert report.num_tensors == 3
    assert_all_bit_exact(dest, source)
    assert dest["embed.weight"].data_ptr() == dest["lm_head.weight"].data_ptr(), "still tied"

    # tied on the sender only: each destination gets its own copy
    untied = {
        "embed.weight": torch.zeros(50, 8, dtype=torch.bfloat16),
        "lm_head.weight": torch.zeros(50, 8, dtype=torch.bfloat16),
    }
    with receiving(untied, transport) as receiver, sending(receiver.address) as sender:
        assert sender.push({"embed.weight": embed, "lm_head.weight": embed}, version=1).ok
    assert_all_bit_exact(untied, {"embed.weight": embed, "lm_head.weight": embed})


def test_model_parameters_to_model_parameters(transport):
    torch.manual_seed(0)
    trainer, engine = (
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)),
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)),
    )
    with receiving(dict(engine.named_parameters()), transport) as receiver, sending(receiver.address) as sender:
        assert sender.push(trainer.named_parameters(), version=1).ok
    assert_all_bit_exact(
        {n: p.detach() for n, p in engine.named_parameters()}, {n: p.detach() for n, p in trainer.named_parameters()}
    )
    assert all(p.requires_grad for p in engine.parameters())


# --- cast on send --------------------------------------------------------------------------------


def test_cast_on_send_is_declared_in_the_plan(transport):
    master = {
        "w": random_values(torch.float32, (33, 5), seed=1),
        "b": random_values(torch.float64, (7,), seed=2),
        "steps": torch.arange(6, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "fp8": random_tensor(torch.float8_e4m3fn, (9,), seed=3),
        "half": random_values(torch.float16, (4,), seed=4),
    }
    expected = {
        "w": master["w"].to(torch.bfloat16),
        "b": master["b"].to(torch.bfloat16),
        "steps": master["steps"],
        "mask": master["mask"],
        "fp8": master["fp8"],
        "half": master["half"].to(torch.bfloat16),
    }
    sink = Recorder({name: torch.zeros(t.shape, dtype=t.dtype) for name, t in expected.items()})
    with receiving(sink, transport) as receiver, sending(receiver.address, cast=torch.bfloat16, bucket_bytes=128) as s:
        report = s.push(master, version=1)
    assert report.ok, report.failed
    assert_all_bit_exact(sink.dest, expected)
    declared = {spec.name: (spec.source_dtype, spec.dtype) for spec in sink.plans[0].tensors}
    assert declared["w"] == ("float32", "bfloat16")
    assert declared["b"] == ("float64", "bfloat16")
    assert declared["steps"] == ("int64", "int64")
    assert declared["fp8"] == ("float8_e4m3fn", "float8_e4m3fn")
    assert report.total_bytes == sum(t.numel() * t.element_size() for t in expected.values())


def test_cast_on_send_non_contiguous_and_chunked(transport):
    master = non_contiguous(random_values(torch.float32, (20, 30), seed=5), "transposed")
    received: dict[str, torch.Tensor] = {}

    def load(named):  # type: ignore[no-untyped-def]
        received.update((n, t.clone()) for n, t in named)

    with (
        receiving(load, transport) as receiver,
        sending(receiver.address, cast={"w": torch.float16}, bucket_bytes=64) as s,
    ):
        assert s.push({"w": master, "keep": master[0]}, version=1).ok
    assert_all_bit_exact(received, {"w": master.to(torch.float16), "keep": master[0].contiguous()})


def test_cast_mismatching_the_destination_is_a_plan_error_that_names_the_fix(transport):
    """By default the push raises SyncFailed, whose one-line message names the receiver, the
    refusal and its fix; the report it carries has the receiver's own error."""
    dest = {f"w{i}": torch.zeros(4, dtype=torch.float32) for i in range(12)}
    with (
        receiving(dest, transport) as receiver,
        sending(receiver.address, cast=torch.bfloat16) as sender,
        pytest.raises(SyncFailed) as failed,
    ):
        sender.push({name: torch.ones(4) for name in dest}, version=1)
    message = str(failed.value)
    assert message.startswith(f"version 1 did not commit on 1 of 1 receivers: {receiver.address}: PlanError: ")
    assert "push float32 (cast=torch.float32, or no cast) or serve a bfloat16 model" in message
    assert "\n" not in message
    report = failed.value.report
    assert [o.kind for o in report.failed] == ["PlanError"]
    error = report.failed[0].error
    assert "the push sends bfloat16 where this receiver holds float32 (12 tensors" in error
    assert "\n" not in error and "(and " not in error, "one line, not a list of every tensor"
    assert all(torch.equal(t, torch.zeros(4)) for t in dest.values())


# --- chunking at every boundary ------------------------------------------------------------------

BUCKET = 256

CHUNK_CASES = {
    "exactly-one-bucket": ({"w": (torch.float32, (64,))}, 1),
    "one-byte-over": ({"w": (torch.uint8, (257,))}, 2),
    "one-element-over": ({"w": (torch.float32, (65,))}, 2),
    "one-element-under": ({"w": (torch.bfloat16, (127,))}, 1),
    "many-times-over": ({"w": (torch.float32, (64 * 10 + 3,))}, 11),
    "many-times-exactly": ({"w": (torch.int64, (32 * 7,))}, 7),
    "whole-bucket-after-small": ({"a": (torch.uint8, (1,)), "w": (torch.float32, (64,))}, 2),
    "chunked-after-small": ({"a": (torch.uint8, (1,)), "w": (torch.float32, (200,)), "z": (torch.bool, (3,))}, 4),
    "small-after-chunked": ({"w": (torch.float16, (300,)), "a": (torch.int8, (10,))}, 3),
}


@pytest.mark.parametrize("case", sorted(CHUNK_CASES))
@pytest.mark.parametrize("delivery", ["in-place", "load"])
def test_chunk_boundaries(transport, case, delivery):
    shapes, num_buckets = CHUNK_CASES[case]
    source = {name: random_tensor(dtype, shape, seed=i) for i, (name, (dtype, shape)) in enumerate(shapes.items())}
    sink = Recorder(
        {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in source.items()} if delivery == "in-place" else None
    )
    with receiving(sink, transport) as receiver, sending(receiver.address, bucket_bytes=BUCKET) as sender:
        report = sender.push(source, version=1)
    assert report.ok, report.failed
    assert (report.num_buckets, report.bucket_bytes) == (num_buckets, BUCKET)
    assert_all_bit_exact(sink.dest if delivery == "in-place" else sink.received, source)


def test_chunked_tensor_is_loaded_once_when_complete(transport):
    """A tensor chunked over many buckets reaches `load` once, whole, with the bucket that completes it."""
    sink = Recorder()
    source = {"big": random_tensor(torch.float32, (64 * 5,), seed=1), "tail": torch.ones(2)}
    with receiving(sink, transport) as receiver, sending(receiver.address, bucket_bytes=BUCKET) as sender:
        assert sender.push(source, version=1).ok
    loads = [names for hook, names in sink.calls if hook == "load"]
    assert loads in ([["big"], ["tail"]], [["big", "tail"]])
    assert_all_bit_exact(sink.received, source)


# --- several receivers, several versions ----------------------------------------------------------


def test_multiple_receivers_same_transport(transport):
    source = {"w": random_tensor(torch.bfloat16, (300,), seed=1), "b": random_tensor(torch.int16, (5,), seed=2)}
    sinks = [Recorder({n: torch.zeros_like(t) for n, t in source.items()}), Recorder(), Recorder()]
    receivers = [WeightReceiver(sink, transport=transport, timeout=WAIT_S).start() for sink in sinks]
    try:
        with sending([r.address for r in receivers], bucket_bytes=128) as sender:
            report = sender.push(source, version=4)
        assert report.ok and len(report.outcomes) == 3
        assert [o.address for o in report.outcomes] == [r.address for r in receivers]
        assert all(r.version == 4 for r in receivers)
        assert_all_bit_exact(sinks[0].dest, source)
        for sink in sinks[1:]:
            assert_all_bit_exact(sink.received, source)
    finally:
        for receiver in receivers:
            receiver.close()


def test_one_sender_mixing_every_transport():
    source = {"w": random_tensor(torch.float32, (100,), seed=1)}
    dests = {t: {"w": torch.zeros(100)} for t in installed(TRANSPORTS)}
    receivers = [WeightReceiver(dests[t], transport=t, timeout=WAIT_S).start() for t in dests]
    try:
        with sending([r.address for r in receivers], bucket_bytes=64) as sender:
            assert sender.push(source, version=1).ok
        for dest in dests.values():
            assert_all_bit_exact(dest, source)
    finally:
        for receiver in receivers:
            receiver.close()


def test_several_versions_in_a_row(transport):
    dest = {"w": torch.zeros(50, dtype=torch.bfloat16), "n": torch.zeros((), dtype=torch.int64)}
    with receiving(dest, transport) as receiver, sending(receiver.address, bucket_bytes=64) as sender:
        for version in range(1, 6):
            source = {"w": random_tensor(torch.bfloat16, (50,), seed=version), "n": torch.tensor(version)}
            report = sender.push(source, version=version)
            assert report.ok and report.version == version
            assert receiver.version == version and receiver.state == "ready" and receiver.last_error == ""
            assert receiver.wait_for_version(version, timeout=0.1)
            assert_all_bit_exact(dest, source)
        # the plan may change between versions (a new bucket size, new tensors): still one sender
        assert sender.push({"w": torch.ones(50, dtype=torch.bfloat16), "n": torch.tensor(9)}, version=9).ok
        assert receiver.version == 9


def test_wait_for_version(transport):
    with receiving(Recorder(), transport) as receiver:
        assert not receiver.wait_for_version(1, timeout=0.05)
        with sending(receiver.address) as sender:
            sender.push({"a": torch.ones(1)}, version=3)
        assert receiver.wait_for_version(1, timeout=0.05)
        assert receiver.wait_for_version(3, timeout=0.05)
        assert not receiver.wait_for_version(4, timeout=0.05)


def test_weight_source_is_consumed_lazily_in_order(transport):
    """A WeightSource's tensors are produced one at a time, in metas() order, each once."""
    source_stays_here(transport)
    produced: list[str] = []
    sizes = {"a": 100, "b": 3, "c": 64, "d": 1}

    class Gathered:
        def metas(self) -> list[TensorMeta]:
            return [TensorMeta(name, (n,), torch.float32) for name, n in sizes.items()]

        def tensors(self):  # type: ignore[no-untyped-def]
            for name, n in sizes.items():
                produced.append(name)
                yield name, torch.full((n,), float(len(produced)))

    sink = Recorder()
    with receiving(sink, transport) as receiver, sending(receiver.address, bucket_bytes=128) as sender:
        assert sender.push(Gathered(), version=1).ok
    assert produced == list(sizes)
    assert_all_bit_exact(
        sink.received, {name: torch.full((n,), float(i + 1)) for i, (name, n) in enumerate(sizes.items())}
    )
    assert isinstance(StateDictSource({"a": torch.ones(1)}).metas()[0], TensorMeta)


def test_report_fields(transport):
    with receiving(Recorder(), transport) as receiver, sending(receiver.address, bucket_bytes=64) as sender:
        report = sender.push({"a": torch.ones(16), "b": torch.ones(3, dtype=torch.int8)}, version=2)
    assert report.ok and report.failed == ()
    assert (report.version, report.total_bytes, report.num_tensors, report.num_buckets, report.bucket_bytes) == (
        2,
        67,
        2,
        2,
        64,
    )
    assert report.seconds > 0 and report.gbps > 0
    assert report.outcomes[0].committed and report.outcomes[0].kind == "" and report.outcomes[0].error == ""


# --- the sink's hooks --------------------------------------------------------------------------


def test_sink_hooks_are_called_in_order(transport):
    sink = Recorder({"in_place": torch.zeros(20)})
    with receiving(sink, transport) as receiver, sending(receiver.address, bucket_bytes=64) as sender:
        sender.push({"in_place": torch.ones(20), "loaded": torch.ones(3)}, version=7)
    hooks = sink.hooks()
    assert hooks[0] == "begin" and hooks[-1] == "commit"
    assert set(hooks[1:-1]) == {"load"}
    assert ("commit", 7) in sink.calls and sink.aborts == []
    assert [names for hook, names in sink.calls if hook == "load"] == [["loaded"]]


class _Failing(WeightSink):
    def __init__(self, hook: str, dest: dict[str, torch.Tensor] | None = None) -> None:
        self.hook, self.dest, self.aborted_with = hook, dest or {}, []

    def begin(self, plan, version):  # type: ignore[no-untyped-def]
        if self.hook == "begin":
            raise RuntimeError("engine is shutting down")

    def destination(self, name):  # type: ignore[no-untyped-def]
        if self.hook == "destination":
            raise KeyError(name)
        return self.dest.get(name)

    def load(self, named):  # type: ignore[no-untyped-def]
        if self.hook == "load":
            raise ValueError("engine rejected " + named[0][0])

    def commit(self, version):  # type: ignore[no-untyped-def]
        if self.hook == "commit":
            raise ValueError("engine could not swap weights")

    def abort(self, version, error, *, intact):  # type: ignore[no-untyped-def]
        self.aborted_with.append((version, error))


@pytest.mark.parametrize("hook", ["begin", "destination", "load", "commit"])
def test_sink_errors_fail_that_receiver_only(transport, hook):
    bad_sink = _Failing(hook, {"w": torch.zeros(64)})
    good_dest = {"w": torch.zeros(64), "extra": torch.zeros(3)}
    source = {"w": torch.ones(64), "extra": torch.ones(3)}
    with (
        receiving(bad_sink, transport) as bad,
        receiving(good_dest, transport) as good,
        sending([bad.address, good.address], bucket_bytes=256, raise_on_failure=False) as sender,
    ):
        report = sender.push(source, version=3)
        assert [o.address for o in report.failed] == [bad.address]
        outcome = report.failed[0]
        assert outcome.kind == "SinkError", outcome
        assert f"sink.{hook}" in outcome.error
        assert good.version == 3
        assert bad.version is None and bad.last_error
        if hook in ("load", "commit"):
            assert [v for v, _ in bad_sink.aborted_with] == [3]
            assert bad.state == "dirty", "live weights were written before the failure"
        else:
            assert bad.state == "empty"
        # the failed receiver recovers on the next push
        bad_sink.hook = ""
        report = sender.push(source, version=4)
        assert report.ok, report.failed
        assert bad.version == 4 and bad.state == "ready"


def test_sink_abort_raising_does_not_hide_the_failure(transport):
    """load fails, then abort fails too: the receiver reports load's error and recovers."""

    class Both(_Failing):
        def abort(self, version, error, *, intact):  # type: ignore[no-untyped-def]
            super().abort(version, error)
            raise RuntimeError("abort failed as well")

    both = Both("load")
    with receiving(both, transport) as receiver, sending(receiver.address, raise_on_failure=False) as sender:
        report = sender.push({"w": torch.ones(4)}, version=1)
        assert report.failed[0].kind == "SinkError"
        assert "engine rejected" in receiver.last_error
        assert receiver.state == "empty"
        both.hook = ""
        assert sender.push({"w": torch.ones(4)}, version=2).ok


def test_push_raises_by_default_and_returns_the_report_when_asked(transport):
    """A push that does not commit everywhere raises SyncFailed (one line: which receivers, the
    first cause), even when others committed; `raise_on_failure=False` returns the report."""
    with (
        receiving({"w": torch.zeros(4)}, transport) as good,
        receiving({"v": torch.zeros(4)}, transport) as bad,
        receiving({"v": torch.zeros(4)}, transport) as worse,
        sending([good.address, bad.address, worse.address]) as sender,
    ):
        with pytest.raises(SyncFailed) as info:
            sender.push({"w": torch.ones(4)}, version=1)
        message = str(info.value)
        assert message.startswith(
            f"version 1 did not commit on 2 of 3 receivers: {bad.address}, {worse.address}; the first: PlanError: "
        ), message
        assert "unknown tensor 'w'" in message and "\n" not in message
        report = info.value.report
        assert [o.committed for o in report.outcomes] == [True, False, False] and good.version == 1
    with (
        receiving({"w": torch.zeros(4)}, transport) as receiver,
        sending(receiver.address, raise_on_failure=False) as sender,
    ):
        report = sender.push({"other": torch.ones(4)}, version=1)
        assert not report.ok and report.failed[0].address == receiver.address
        assert report.failed[0].kind == "PlanError" and receiver.version is None
        assert sender.push({"w": torch.ones(4)}, version=2).ok


# --- plan mismatch: rejected before any byte moves, previous version kept -----------------------

MISMATCHES = {
    "unknown-name": ({"w": torch.ones(8), "b": torch.ones(2), "extra": torch.ones(1)}, "unknown tensor 'extra'"),
    "wrong-shape": ({"w": torch.ones(2, 4), "b": torch.ones(2)}, "'w'"),
    "wrong-dtype": ({"w": torch.ones(8, dtype=torch.float64), "b": torch.ones(2)}, "float64"),
    "missing-name": ({"w": torch.ones(8)}, "plan lacks 'b'"),
}


@pytest.mark.parametrize("mismatch", sorted(MISMATCHES))
def test_plan_mismatch_is_refused_and_the_previous_version_kept(transport, mismatch):
    dest = {"w": torch.zeros(8), "b": torch.zeros(2)}
    good = {"w": random_tensor(torch.float32, (8,), seed=1), "b": random_tensor(torch.float32, (2,), seed=2)}
    bad_source, text = MISMATCHES[mismatch]
    with receiving(dest, transport) as receiver, sending(receiver.address, raise_on_failure=False) as sender:
        assert sender.push(good, version=1).ok
        report = sender.push(bad_source, version=2)
        assert not report.ok
        (outcome,) = report.failed
        assert outcome.kind == "PlanError", outcome
        assert text in outcome.error
        assert receiver.version == 1 and receiver.state == "ready"
        assert "version 2" in receiver.last_error
        assert_all_bit_exact(dest, good)
        # and the same sender and receiver go on
        assert sender.push(good, version=3).ok
        assert receiver.version == 3 and receiver.last_error == ""


def test_plan_mismatch_on_one_receiver_does_not_stop_the_others(transport):
    source = {"w": torch.ones(8)}
    with (
        receiving({"w": torch.zeros(9)}, transport) as wrong,
        receiving({"w": torch.zeros(8)}, transport) as right,
        sending([wrong.address, right.address], raise_on_failure=False) as sender,
    ):
        report = sender.push(source, version=1)
    assert [(o.address, o.kind) for o in report.failed] == [(wrong.address, "PlanError")]
    assert right.version == 1 and wrong.version is None


def test_tensor_dict_sink_not_strict_accepts_a_subset(transport):
    from weightsync import TensorDictSink

    dest = {"w": torch.zeros(4), "frozen": torch.full((2,), 7.0)}
    with (
        receiving(TensorDictSink(dest, strict=False), transport) as receiver,
        sending(receiver.address, raise_on_failure=False) as sender,
    ):
        assert sender.push({"w": torch.ones(4)}, version=1).ok
        assert sender.push({"nope": torch.ones(4)}, version=2).failed[0].kind == "PlanError"
    assert torch.equal(dest["w"], torch.ones(4)) and torch.equal(dest["frozen"], torch.full((2,), 7.0))


def test_source_contradicting_its_metadata_aborts_every_receiver(transport):
    source_stays_here(transport)

    class Liar:
        def metas(self):  # type: ignore[no-untyped-def]
            return [TensorMeta("a", (64,), torch.float32), TensorMeta("b", (64,), torch.float32)]

        def tensors(self):  # type: ignore[no-untyped-def]
            yield "a", torch.ones(64)
            yield "b", torch.ones(65)

    dest = {"a": torch.zeros(64), "b": torch.zeros(64)}
    sink = Recorder(dest)
    with receiving(sink, transport) as receiver, sending(receiver.address, bucket_bytes=256) as sender:
        assert sender.push({"a": torch.full((64,), 2.0), "b": torch.full((64,), 2.0)}, version=1).ok
        with pytest.raises(PlanError, match="metadata promised"):
            sender.push(Liar(), version=2)
        assert wait_until(lambda: receiver.state != "syncing")
        assert [version for version, _ in sink.aborts] == [2]
        if torch.equal(dest["a"], torch.ones(64)):  # bucket 0 landed before the abort: a mix
            assert receiver.state == "dirty" and receiver.version is None, "'a' was already written in place"
        else:  # collective: bucket 0 was still in flight when the abort came; nothing was written
            assert transport == "collective" and torch.equal(dest["a"], torch.full((64,), 2.0))
            assert receiver.state == "ready" and receiver.version == 1
        assert "version 2" in receiver.last_error
        assert sender.push({"a": torch.ones(64), "b": torch.ones(64)}, version=3).ok
        assert receiver.version == 3 and receiver.state == "ready"
        # A trainer retries at once: the push right after an abort must not trip over the aborted
        # connection (still closing on the receiver's side, holding that sync's late messages).
        for version in range(4, 24, 2):
            with pytest.raises(PlanError):
                sender.push(Liar(), version=version)
            report = sender.push({"a": torch.ones(64), "b": torch.ones(64)}, version=version + 1)
            assert report.ok, (version, report.failed)
            assert receiver.version == version + 1 and receiver.state == "ready"


def test_source_failing_before_any_byte_keeps_the_previous_version(transport):
    source_stays_here(transport)

    class Broken:
        def metas(self):  # type: ignore[no-untyped-def]
            return [TensorMeta("a", (4,), torch.float32)]

        def tensors(self):  # type: ignore[no-untyped-def]
            raise OSError("checkpoint shard missing")
            yield  # pragma: no cover

    dest = {"a": torch.zeros(4)}
    with receiving(dest, transport) as receiver, sending(receiver.address) as sender:
        assert sender.push({"a": torch.ones(4)}, version=1).ok
        with pytest.raises(OSError, match="shard missing"):
            sender.push(Broken(), version=2)
        assert wait_until(lambda: receiver.state != "syncing")
        assert receiver.state == "ready" and receiver.version == 1
        assert "version 2" in receiver.last_error
        assert torch.equal(dest["a"], torch.ones(4))
        assert sender.push({"a": torch.full((4,), 3.0)}, version=3).ok
        assert receiver.version == 3


# --- negotiation ------------------------------------------------------------------------------


def test_receiver_limit_below_the_proposal_wins_on_both_sides(transport):
    sinks = [Recorder(), Recorder()]
    with (
        receiving(sinks[0], transport, max_bucket_bytes=512) as a,
        receiving(sinks[1], transport, max_bucket_bytes=256) as b,
        sending([a.address, b.address], bucket_bytes=4096) as sender,
    ):
        report = sender.push({"w": random_tensor(torch.float32, (1000,), seed=1)}, version=1)
    assert report.ok, report.failed
    assert report.bucket_bytes == 256
    assert report.num_buckets == 4000 // 256 + 1
    assert [sink.plans[0].bucket_bytes for sink in sinks] == [256, 256]
    for sink in sinks:
        assert_all_bit_exact(sink.received, {"w": random_tensor(torch.float32, (1000,), seed=1)})


def test_receiver_memory_budget_sets_its_limit(transport):
    sink = Recorder()
    with receiving(sink, transport, memory_budget_bytes=1024) as receiver, sending(receiver.address) as sender:
        report = sender.push({"w": torch.ones(1000)}, version=1)
    assert report.ok and report.bucket_bytes == 512


def test_auto_bucket_size_fits_the_largest_tensor(transport):
    with receiving(Recorder(), transport) as receiver, sending(receiver.address) as sender:
        report = sender.push({"a": torch.ones(10), "big": torch.ones(1000), "c": torch.ones(3)}, version=1)
    assert report.ok and report.bucket_bytes == 4032 and report.num_buckets == 3


def test_sender_minimum_above_a_receiver_limit_fails_that_receiver_only(transport):
    with (
        receiving(Recorder(), transport, max_bucket_bytes=1024) as small,
        receiving(Recorder(), transport) as roomy,
        sending(
            [small.address, roomy.address], bucket_bytes=8192, min_bucket_bytes=4096, raise_on_failure=False
        ) as sender,
    ):
        report = sender.push({"w": torch.ones(2000)}, version=1)
        assert [o.address for o in report.failed] == [small.address]
        outcome = report.failed[0]
        assert outcome.kind == "NegotiationError"
        assert small.address in outcome.error and "1024" in outcome.error and "4096" in outcome.error
        assert report.bucket_bytes == 8192
        assert roomy.version == 1 and small.version is None and small.state == "empty"


def test_sender_minimum_with_auto_size_is_honoured(transport):
    """min_bucket_bytes (e.g. the embedding's size) is a floor for the automatic size too, even
    when this push's tensors are all smaller."""
    sink = Recorder()
    with (
        receiving(sink, transport) as receiver,
        sending(receiver.address, min_bucket_bytes=8000) as sender,
    ):
        report = sender.push({"norm": torch.ones(10)}, version=1)
    assert report.ok, report.failed
    assert report.bucket_bytes >= 8000
    assert sink.plans[0].bucket_bytes == report.bucket_bytes


# --- unreachable and busy receivers -----------------------------------------------------------


def test_unreachable_receiver_fails_and_the_others_commit(transport):
    gone = WeightReceiver(Recorder(), transport=transport).start()
    gone.close()
    with (
        receiving(Recorder(), transport) as alive,
        sending([gone.address, alive.address], timeout=5, raise_on_failure=False) as sender,
    ):
        report = sender.push({"w": torch.ones(3)}, version=1)
    assert [(o.address, o.kind) for o in report.failed] == [(gone.address, "ConnectError")]
    assert alive.version == 1


def test_busy_receiver_refuses_a_second_sender(transport):
    source_stays_here(transport)
    gate = threading.Event()
    sink = Recorder(gate=gate)
    with receiving(sink, transport) as receiver:
        first_report = []
        first = WeightSender(receiver.address, timeout=WAIT_S, raise_on_failure=False)
        thread = threading.Thread(target=lambda: first_report.append(first.push({"w": torch.ones(4)}, version=1)))
        thread.start()
        try:
            assert sink.loading.wait(WAIT_S)
            assert receiver.state == "syncing"
            with sending(receiver.address, raise_on_failure=False) as second:
                report = second.push({"w": torch.ones(4)}, version=2)
            assert [o.kind for o in report.failed] == ["NegotiationError"]
            assert "busy" in report.failed[0].error
        finally:
            gate.set()
            thread.join(WAIT_S)
            first.close()
        assert first_report and first_report[0].ok
        assert receiver.version == 1


# --- lifecycle ------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["shm", "tcp"])  # inproc syncs run inside push itself
def test_receiver_closed_mid_sync_aborts_before_close_returns(transport):
    gate = threading.Event()

    class Held:
        def metas(self):  # type: ignore[no-untyped-def]
            return [TensorMeta("a", (64,), torch.float32), TensorMeta("b", (64,), torch.float32)]

        def tensors(self):  # type: ignore[no-untyped-def]
            yield "a", torch.ones(64)
            gate.wait(WAIT_S)
            yield "b", torch.ones(64)

    dest = {"a": torch.zeros(64), "b": torch.zeros(64)}
    sink = Recorder(dest)
    receiver = WeightReceiver(sink, transport=transport, timeout=WAIT_S).start()
    with sending(receiver.address, bucket_bytes=256, raise_on_failure=False) as sender:
        reports = []
        pusher = threading.Thread(target=lambda: reports.append(sender.push(Held(), version=1)))
        pusher.start()
        try:
            assert wait_until(lambda: bool((dest["a"] == 1).all()))
            receiver.close()
            assert [version for version, _ in sink.aborts] == [1], "abort is heard before close returns"
            assert receiver.state == "dirty" and receiver.version is None
        finally:
            gate.set()
            pusher.join(WAIT_S)
        assert not reports[0].ok


@pytest.mark.parametrize("noticed", [True, False], ids=["close-noticed", "close-not-yet-noticed"])
def test_tcp_receiver_restarted_on_the_same_port_rejoins(noticed, monkeypatch):
    opened: list[Connection] = []
    readers: list[threading.Thread] = []
    held, release = threading.Event(), threading.Event()
    real_connect = links.connect_tcp

    def connect_tcp(address: str, scheme: str, timeout: float, messages=()) -> Connection:
        """The sender's links, with a hook on the reader that waits for its replies."""
        link = real_connect(address, scheme, timeout, messages)
        real_wait, first = link.wait_readable, not opened
        opened.append(link)

        def wait_readable() -> None:
            if first and not readers:
                readers.append(threading.current_thread())
            real_wait()
            if first and held.is_set():  # the race a push right after the restart can hit:
                release.wait(WAIT_S)  # the reader has not run yet

        link.wait_readable = wait_readable  # type: ignore[method-assign]
        return link

    monkeypatch.setattr(links, "connect_tcp", connect_tcp)
    first = WeightReceiver({"w": torch.zeros(4)}, transport="tcp").start()
    port = int(first.address.rpartition(":")[2])
    with sending(first.address) as sender:
        try:
            assert sender.push({"w": torch.ones(4)}, version=1).ok
            if not noticed:
                held.set()
        finally:
            first.close()
        (reader,) = readers
        if noticed:
            reader.join(WAIT_S)
            assert not reader.is_alive(), "the sender's reader saw the connection close"
        try:
            dest = {"w": torch.zeros(4)}
            with receiving(dest, "tcp", port=port) as second:
                assert second.address == first.address
                report = sender.push({"w": torch.full((4,), 2.0)}, version=2)
                assert report.ok, report.failed
                assert second.version == 2 and torch.equal(dest["w"], torch.full((4,), 2.0))
            assert len(opened) == 2, "the sender reconnected"
            assert noticed or reader.is_alive(), "the reader had still not run when the push reconnected"
        finally:
            release.set()


@pytest.mark.parametrize("num_slots", [1, 3, 16])
def test_ring_sizes(transport, num_slots):
    source = {f"t{i}": random_tensor(torch.float32, (40 + i,), seed=i) for i in range(20)}  # one per bucket
    sink = Recorder()
    with receiving(sink, transport) as receiver, sending(receiver.address, bucket_bytes=256, num_slots=num_slots) as s:
        for version in (1, 2):
            report = s.push(source, version=version)
            assert report.ok and report.num_buckets == 20
    assert_all_bit_exact(sink.received, source)


def test_tensor_larger_than_the_largest_auto_bucket(transport):
    """80 MiB in one tensor: auto sizing stops at 64 MiB, so it is chunked; still bit-exact.
    (nixl's auto stops at 256 MiB: there the tensor is one bucket, the small one a second.)"""
    big = random_tensor(torch.uint8, (80 << 20,), seed=1).view(torch.bfloat16)
    dest = {"big": torch.zeros_like(big), "small": torch.zeros(3)}
    with receiving(dest, transport) as receiver, sending(receiver.address) as sender:
        report = sender.push({"big": big, "small": torch.ones(3)}, version=1)
    assert report.ok, report.failed
    largest = get_transport(transport).largest_auto_bucket_bytes
    assert report.bucket_bytes == min(80 << 20, largest) and report.num_buckets == 2
    assert torch.equal(dest["big"].view(torch.uint8), big.view(torch.uint8))


def test_destination_of_the_wrong_dtype_from_a_custom_sink_is_a_plan_error(transport):
    class Loose(WeightSink):
        def destination(self, name):  # type: ignore[no-untyped-def]
            return {"w": torch.zeros(4, dtype=torch.float16)}.get(name)

    with receiving(Loose(), transport) as receiver, sending(receiver.address, raise_on_failure=False) as sender:
        report = sender.push({"w": torch.ones(4)}, version=1)
    assert [o.kind for o in report.failed] == ["PlanError"]
    assert "'w'" in report.failed[0].error and receiver.state == "empty"


# --- the receiver's state machine -----------------------------------------------------------------


def test_failure_after_staging_only_keeps_the_previous_version(transport):
    """Bytes that landed in staging (a callable sink) are not live: the previous version stands."""
    sink = Recorder()
    with (
        receiving(sink, transport) as receiver,
        sending(receiver.address, bucket_bytes=64, raise_on_failure=False) as sender,
    ):
        assert sender.push({"a": torch.ones(16), "b": torch.ones(16)}, version=1).ok
        sink.fail_load = RuntimeError("engine busy")
        report = sender.push({"a": torch.ones(16), "b": torch.ones(16)}, version=2)
        assert report.failed[0].kind == "SinkError"
        assert receiver.state == "ready" and receiver.version == 1
        assert "version 2" in receiver.last_error and "engine busy" in receiver.last_error


def test_dirty_stays_dirty_until_a_sync_commits(transport):
    dest = {"a": torch.zeros(16), "b": torch.zeros(16)}

    class FailsOnB(Recorder):
        armed = True

        def destination(self, name):  # type: ignore[no-untyped-def]
            return dest["a"] if name == "a" else None

        def load(self, named):  # type: ignore[no-untyped-def]
            if self.armed:
                raise RuntimeError("cannot load b")
            super().load(named)

    sink = FailsOnB()
    with (
        receiving(sink, transport) as receiver,
        sending(receiver.address, bucket_bytes=64, raise_on_failure=False) as sender,
    ):
        assert not sender.push({"a": torch.ones(16), "b": torch.ones(16)}, version=1).ok
        assert (receiver.state, receiver.version) == ("dirty", None)
        # a refused plan and an aborted sync leave it dirty: it still holds a mix
        refused = sender.push({"a": torch.ones(16, dtype=torch.float64), "b": torch.ones(16)}, version=2)
        assert refused.failed[0].kind == "PlanError"
        assert (receiver.state, receiver.version) == ("dirty", None)
        assert not sender.push({"a": torch.ones(16), "b": torch.ones(16)}, version=3).ok
        assert (receiver.state, receiver.version) == ("dirty", None)
        sink.armed = False
        assert sender.push({"a": torch.full((16,), 2.0), "b": torch.ones(16)}, version=4).ok
        assert (receiver.state, receiver.version, receiver.last_error) == ("ready", 4, "")
        assert torch.equal(dest["a"], torch.full((16,), 2.0))


def test_sink_hears_abort_when_landing_refuses_after_begin(transport):
    """A destination of the wrong shape is found after sink.begin accepted the plan: the sink
    must still be told the sync is off (a server would otherwise stay paused)."""

    class WrongDestination(Recorder):
        def destination(self, name):  # type: ignore[no-untyped-def]
            return torch.zeros(3)

    sink = WrongDestination()
    with receiving(sink, transport) as receiver, sending(receiver.address, raise_on_failure=False) as sender:
        report = sender.push({"w": torch.ones(4)}, version=1)
        assert report.failed[0].kind == "PlanError"
        assert sink.hooks() == ["begin", "abort"]
        assert receiver.state == "empty" and receiver.version is None


def test_failed_sync_into_a_live_loader_leaves_the_receiver_dirty(transport):
    """A sink whose load() feeds the served model (traits.live_loads) is mixed after a failure past
    the first load, even though no byte was written in place."""

    class LiveLoader(Recorder):
        traits = SinkTraits(live_loads=True)

    sink = LiveLoader()
    with (
        receiving(sink, transport) as receiver,
        sending(receiver.address, bucket_bytes=64, raise_on_failure=False) as sender,
    ):
        assert sender.push({"a": torch.ones(16), "b": torch.ones(16)}, version=1).ok
        sink.fail_load = ValueError("engine rejected b")
        report = sender.push({"a": torch.ones(16), "b": torch.ones(16)}, version=2)
        assert report.failed[0].kind == "SinkError"
        assert receiver.state == "dirty" and receiver.version is None


# --- LoRA adapters: a sync of their own, beside the base weights ------------------------------------

LORA = {
    "base_model.model.layer.lora_A.weight": (4, 8),
    "base_model.model.layer.lora_B.weight": (6, 4),
}


class AdapterServingSink(TensorDictSink):
    """Base weights in place, and adapters kept whole as they are installed."""

    def __init__(self, base: dict[str, torch.Tensor]) -> None:
        super().__init__(base)
        self.installed: list[tuple[Adapter, int, dict[str, torch.Tensor]]] = []

    def adapter_sink(self, adapter: Adapter) -> WeightSink:
        def check(plan: Plan, adapter: Adapter) -> None:
            check_lora(plan, adapter, {"layer": (8, 6)}, max_rank=4)

        def install(adapter: Adapter, version: int, tensors: dict[str, torch.Tensor]) -> None:
            self.installed.append((adapter, version, {name: t.clone() for name, t in tensors.items()}))

        return AdapterSink(adapter, check, install)


def test_an_adapter_lands_whole_and_leaves_the_base_weights_as_they_are(transport: str) -> None:
    base = {"layer.weight": random_tensor(torch.float32, (6, 8), seed=1)}
    lora = {name: random_tensor(torch.float32, shape, seed=2) for name, shape in LORA.items()}
    adapter = Adapter("policy", 4, 8.0, ("layer",))
    sink = AdapterServingSink({"layer.weight": torch.zeros(6, 8)})
    with (
        receiving(sink, transport) as receiver,
        sending(receiver.address, verify="bucket", raise_on_failure=False) as sender,
    ):
        assert sender.push(base, version=1).ok
        before = receiver.status
        report = sender.push(lora, version=5, adapter=adapter)
        assert report.ok
        assert report.content_digest == (source_digest(lora) if get_transport(transport).has_wire else "")
        ((got_adapter, version, tensors),) = sink.installed
        assert (got_adapter, version) == (adapter, 5)
        assert_all_bit_exact(tensors, lora)
        assert_bit_exact(sink.tensors["layer.weight"], base["layer.weight"])
        after = receiver.status  # what it holds is the base weights', as before; `times` is the last sync's
        assert (after.version, after.state, after.content_digest) == (
            before.version,
            before.state,
            before.content_digest,
        )

        wrong_rank = Adapter("policy", 2, 4.0, ("layer",))
        refused = sender.push(lora, version=6, adapter=wrong_rank)
        assert not refused.ok and refused.failed[0].kind == "PlanError" and "rank 2" in refused.failed[0].error
        assert len(sink.installed) == 1 and (receiver.version, receiver.state) == (1, "ready")


def test_a_receiver_that_serves_no_adapters_refuses_them(transport: str) -> None:
    lora = {name: random_tensor(torch.float32, shape) for name, shape in LORA.items()}
    with (
        receiving({"layer.weight": torch.zeros(6, 8)}, transport) as receiver,
        sending(receiver.address, raise_on_failure=False) as sender,
    ):
        report = sender.push(lora, version=1, adapter=Adapter("policy", 4, 8.0, ("layer",)))
        assert not report.ok and "serves no LoRA adapters" in report.failed[0].error
        assert (receiver.version, receiver.state) == (None, "empty")
