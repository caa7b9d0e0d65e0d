"""The vLLM backend's parts that need no vLLM server: the checkpoint layout a worker checks
plans against, the rendezvous store, the registration through vLLM's plugin entry point, the
shape of vLLM's weight-transfer API the backend is written against (fails loudly on a vLLM
upgrade that changes it), and a weightsync source handed over as vLLM's."""

from __future__ import annotations

import importlib.metadata
import inspect
import socket
import types
from pathlib import Path

import msgspec
import psutil
import pytest
import torch

from tests.helpers import assert_all_bit_exact
from tests.models import model_config, save_model
from weightsync import HFCheckpointSource, ModuleSource
from weightsync.errors import ConnectError, PlanError, ProtocolError, ResourceError
from weightsync.plan import build_plan, wire_specs
from weightsync.workers.layout import check_plan_layout, checkpoint_layout
from weightsync.workers.rendezvous import WorkerAddress, announce, collect, open_store

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2", "llama"])
def test_the_layout_is_the_checkpoints_from_config_alone(tmp_path: Path, kind: str) -> None:
    from safetensors.torch import load_file

    save_model(kind, tmp_path)
    written = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()  # what a --load-format dummy server may have
    dtype = next(iter(written.values())).dtype
    layout = checkpoint_layout(tmp_path, dtype)
    tied = {name for group in layout.ties for name in group[1:]}
    assert {name: spec for name, spec in layout.tensors.items() if name not in tied} == {
        name: (tuple(tensor.shape), tensor.dtype) for name, tensor in written.items()
    }
    assert layout.ties == ((("model.embed_tokens.weight", "lm_head.weight"),) if kind == "qwen2" else ())


def test_a_plan_of_fused_experts_is_refused_and_one_per_expert_accepted(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    save_model("qwen3_moe", tmp_path)
    layout = checkpoint_layout(tmp_path, torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    fused = build_plan(wire_specs(ModuleSource(model).metas()), 1 << 20)
    with pytest.raises(PlanError, match=r"unknown tensor 'model.layers.0.mlp.experts.gate_up_proj'.*plan lacks"):
        check_plan_layout(fused, layout)
    feed = check_plan_layout(build_plan(wire_specs(HFCheckpointSource(model).metas()), 1 << 20), layout)
    expert = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert len(feed) == 45 and feed[expert] == expert


def test_a_plan_in_another_dtype_is_refused_with_the_fix(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    save_model("qwen2", tmp_path)
    layout = checkpoint_layout(tmp_path, torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    plan = build_plan(wire_specs(HFCheckpointSource(model).metas(), torch.bfloat16), 1 << 20)
    with pytest.raises(PlanError, match=r"^the push sends bfloat16 where this receiver holds float32 .*or serve a"):
        check_plan_layout(plan, layout)
    del_one = build_plan(wire_specs(HFCheckpointSource(model).metas(), torch.bfloat16)[1:], 1 << 20)
    with pytest.raises(PlanError, match=r"^plan does not match the model's checkpoint layout: "):
        check_plan_layout(del_one, layout)  # a dtype and a missing tensor: no single fix to name


def test_a_weightsync_source_serves_as_vllms() -> None:
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from weightsync.integrations.vllm import VLLMSource

    torch.manual_seed(0)
    source = HFCheckpointSource(AutoModelForCausalLM.from_config(model_config("qwen3_moe")))
    wrapped = VLLMSource(source)
    assert [(m.name, m.shape, m.dtype) for m in wrapped.metadata()] == [
        (m.name, m.shape, m.dtype) for m in source.metas()
    ]
    batches = list(wrapped.iter_groups())  # vLLM's own check that iteration follows metadata()
    assert [name for names, _ in batches for name in names] == [meta.name for meta in source.metas()]
    assert_all_bit_exact(dict(wrapped), dict(source.tensors()))


def _listening_on(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="inet") if c.laddr.port == port}


def test_workers_announce_and_the_trainer_collects_them_in_order() -> None:
    store, where = open_store("127.0.0.1", timeout=5)
    port = int(where.rpartition(":")[2])
    assert _listening_on(port) == {"127.0.0.1"}  # loopback only, not every interface
    workers = [WorkerAddress(address=f"shm://@w{rank}", rank=rank, weight_bytes=100) for rank in (1, 0)]
    for worker in workers:
        announce(where, "s1", worker, timeout=5)
    announce(where, "other", WorkerAddress(address="tcp://x:1", rank=0, weight_bytes=1), timeout=5)
    assert collect(store, "s1") == workers
    assert collect(store, "nobody") == []
    del store


def test_a_store_entry_that_is_no_worker_address_is_refused() -> None:
    store, where = open_store("127.0.0.1", timeout=5)
    announce(where, "s", WorkerAddress(address="shm://@a", rank=0, weight_bytes=1), timeout=5)
    store.add("s/count", 1)
    store.set("s/2", msgspec.json.encode({"address": 3}).decode())
    with pytest.raises(ProtocolError, match="not a worker address"):
        collect(store, "s")
    store.set("s/2", msgspec.json.encode(WorkerAddress(address="shm://@a", rank=1, weight_bytes=1)).decode())
    with pytest.raises(ProtocolError, match="same address"):
        collect(store, "s")
    del store


def test_an_unreachable_store_and_an_unusable_host_fail_clearly() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there
    with pytest.raises(ConnectError, match="rendezvous store"):
        announce(f"127.0.0.1:{port}", "s", WorkerAddress(address="a", rank=0, weight_bytes=1), timeout=1)
    with pytest.raises(ResourceError, match="cannot host a rendezvous store"):
        open_store("192.0.2.1", timeout=1)  # TEST-NET-1: not an address of this host


def test_the_plugin_entry_point_registers_both_halves() -> None:
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    (entry,) = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "weightsync"]
    register = entry.load()
    register()
    register()  # vLLM may load plugins more than once
    from vllm.config import ParallelConfig
    from vllm.config.weight_transfer import WeightTransferConfig

    from weightsync.integrations.vllm import WeightsyncTrainerInitInfo
    from weightsync.integrations.vllm.trainer import WeightsyncTrainerEngine
    from weightsync.integrations.vllm.worker import WeightsyncWorkerEngine

    # what vLLM builds for backend "weightsync", through its factories (nothing connects yet)
    vllm_config = types.SimpleNamespace(parallel_config=ParallelConfig(), model_config=None)
    model = torch.nn.Linear(3, 2)
    worker = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="weightsync"), vllm_config, torch.device("cpu"), model
    )  # type: ignore[arg-type]
    assert type(worker) is WeightsyncWorkerEngine
    trainer = WeightTransferTrainerFactory.trainer_init(
        WeightsyncTrainerInitInfo(rank=1), client=object(), source=ModuleSource(model)
    )  # type: ignore[arg-type]  # rank 1 only walks the source: it never calls the client
    assert type(trainer) is WeightsyncTrainerEngine


RECHECK = "vLLM's weight-transfer API changed: re-read weightsync/integrations/vllm against it"


def test_vllms_weight_transfer_api_is_the_one_the_backend_implements() -> None:
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine, WeightTransferEngine

    from weightsync.integrations.vllm.trainer import WeightsyncTrainerEngine
    from weightsync.integrations.vllm.worker import WeightsyncWorkerEngine

    assert WeightsyncWorkerEngine.__abstractmethods__ == frozenset(), RECHECK
    assert WeightsyncTrainerEngine.__abstractmethods__ == frozenset(), RECHECK
    worker_verbs = {"init_transfer_engine", "start_weight_update", "receive_weights", "finish_weight_update"}
    assert worker_verbs | {"shutdown", "update_weights"} <= set(vars(WeightTransferEngine)), RECHECK
    assert list(inspect.signature(WeightTransferEngine.__init__).parameters) == [
        "self",
        "config",
        "vllm_config",
        "device",
        "model",
    ], RECHECK
    assert {"client", "source"} <= set(inspect.signature(TrainerWeightTransferEngine.trainer_init).parameters)
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    assert list(inspect.signature(initialize_layerwise_reload).parameters) == ["model"], RECHECK
    assert callable(finalize_layerwise_reload), RECHECK
    # what the CPU MoE repack after a reload reads (layout.cpu_experts_to_prepack)
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    info = get_layerwise_info(torch.nn.Linear(1, 1))
    assert callable(info.can_load) and isinstance(info.load_numel, int), RECHECK
    assert "process_weights_after_loading" in vars(CPUUnquantizedExperts), RECHECK


def test_a_rank_other_than_0_only_walks_the_source_whatever_its_kind() -> None:
    pytest.importorskip("vllm")
    import torch
    from vllm.distributed.weight_transfer.base import ModuleSource as VLLMModuleSource

    from weightsync import ModuleSource
    from weightsync.integrations.vllm import WeightsyncTrainerInitInfo
    from weightsync.integrations.vllm.trainer import WeightsyncTrainerEngine

    class Untouchable:  # a non-sending rank never calls the client
        def __getattr__(self, name: str) -> None:
            raise AssertionError(f"rank 1 called the client's {name}")

    model = torch.nn.Linear(3, 2)
    for source in (ModuleSource(model), VLLMModuleSource(model)):
        engine = WeightsyncTrainerEngine.trainer_init(
            WeightsyncTrainerInitInfo(rank=1), client=Untouchable(), source=source
        )  # type: ignore[arg-type]
        assert engine.sender is None and engine.workers == []
        assert engine.send_weights() is None


@pytest.mark.parametrize(
    ("worker_token", "trainer_token"),
    [("t" * 32, None), ("t" * 32, "o" * 32), (None, "t" * 32)],
    ids=["trainer-without", "wrong-token", "worker-without"],
)
def test_a_worker_that_refuses_the_sender_fails_the_round_before_any_window_opens(
    worker_token: str | None, trainer_token: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("vllm")
    from weightsync.auth import TOKEN_ENV

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    import time

    from weightsync import StateDictSource, StreamSink, SyncFailed, WeightReceiver, WeightSender
    from weightsync.integrations.vllm.trainer import WeightsyncTrainerEngine

    class Recording:  # vLLM's client: no call may reach the workers
        calls: list[str] = []

        def __getattr__(self, name: str) -> object:
            return lambda *args, **kwargs: self.calls.append(name)

    class Walked(StateDictSource):  # the other ranks walk the source: rank 0 must too
        walked: list[str] = []

        def tensors(self):  # type: ignore[no-untyped-def]
            for name, tensor in super().tensors():
                self.walked.append(name)
                yield name, tensor

    model = torch.nn.Linear(3, 2)
    with WeightReceiver(StreamSink(timeout=30), "tcp", auth_token=worker_token, timeout=30) as worker:
        sender = WeightSender([worker.address], timeout=30, raise_on_failure=False, auth_token=trainer_token)
        engine = WeightsyncTrainerEngine(client=Recording(), source=Walked(model.named_parameters()), sender=sender)  # type: ignore[arg-type]
        started = time.monotonic()
        with pytest.raises(SyncFailed, match=f"version 1 was not labelled: {worker.address}: AuthError") as failed:
            engine.send_weights()
        assert time.monotonic() - started < 10
        assert Recording.calls == [], "an update window was opened for a round no worker could take"
        assert Walked.walked == ["weight", "bias"]
        assert [(outcome.address, outcome.kind) for outcome in failed.value.report.failed] == [
            (worker.address, "AuthError")
        ]
        assert engine.version == 0 and worker.version is None
        engine.shutdown()


def test_versions_go_forward_through_vllms_trainer_api_unless_the_options_allow_older() -> None:
    """The trainer refuses a version at or below its last label; a restarted trainer (its count
    back at 0) is refused by the worker's receiver, which remembers what it committed, and vLLM
    keeps its weights; `allow_older_version` lifts both."""
    pytest.importorskip("vllm")
    from weightsync import ConfigError, SenderOptions, SyncFailed, WeightReceiver, WeightSender
    from weightsync.integrations.vllm.trainer import WeightsyncTrainerEngine

    class Client:  # vLLM's client: every call of the update window does nothing here
        def __getattr__(self, name: str) -> object:
            return lambda *args, **kwargs: None

    model = torch.nn.Linear(3, 2)
    held = {name: torch.zeros_like(tensor) for name, tensor in model.state_dict().items()}

    def trainer(**options: object) -> WeightsyncTrainerEngine:
        sender = WeightSender([worker.address], SenderOptions(timeout=30, raise_on_failure=False, **options))  # type: ignore[arg-type]
        return WeightsyncTrainerEngine(client=Client(), source=ModuleSource(model), sender=sender)  # type: ignore[arg-type]

    with WeightReceiver(held, "tcp", timeout=30) as worker:
        first = trainer()
        assert first.send_weights(5) is not None and worker.version == 5
        with pytest.raises(ConfigError, match=r"above the last one \(5\), got 3"):
            first.send_weights(3)
        first.shutdown()
        restarted = trainer()
        with torch.no_grad():
            model.weight.add_(1.0)
        with pytest.raises(SyncFailed, match="version 1 is not above version 5, committed here last") as refused:
            restarted.send_weights()
        assert "the previous weights serve" in str(refused.value) and worker.version == 5
        assert not torch.equal(held["weight"], model.weight.detach())
        restarted.shutdown()
        allowed = trainer(allow_older_version=True)
        assert allowed.send_weights(1) is not None and allowed.send_weights(1) is not None
        assert worker.version == 1 and torch.equal(held["weight"], model.weight.detach())
        allowed.shutdown()


def test_vllms_window_says_not_ready_by_its_label_and_pauses_only_what_it_owns() -> None:
    """`VLLMWindow` (the one rule on vLLM's trainer API): not ready is the weight version
    `not-ready` and, through an HTTP client's server, vLLM's own `/pause`, resumed by the next
    label; a pause its caller holds stays the caller's."""
    pytest.importorskip("vllm")
    import http.server
    import json
    import threading

    from weightsync.integrations.vllm.trainer import VLLMWindow
    from weightsync.round import NOT_READY, Outcome

    routes: list[str] = []
    paused = {"now": False}

    class Routes(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            routes.append(self.path)
            if self.path.startswith("/pause"):
                paused["now"] = True
            elif self.path == "/resume":
                paused["now"] = False
            body = json.dumps({"is_paused": paused["now"]} if self.path == "/is_paused" else {"status": "ok"})
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.encode())

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            return None

    class Client:
        def __init__(self, base_url: str) -> None:
            self.base_url = base_url
            self.labels: list[str | None] = []

        def finish_weight_update(self, weight_version: str | None = None) -> None:
            self.labels.append(weight_version)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Routes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = Client(f"http://127.0.0.1:{server.server_address[1]}")
        window = VLLMWindow(client, 2)  # type: ignore[arg-type]
        window.finish(1, Outcome("keep", "refused"))
        assert client.labels == [None] and window.ready and routes == []
        window.finish(2, Outcome("not-ready", "a mix"))
        assert client.labels[-1] == NOT_READY and not window.ready
        assert routes == ["/is_paused", "/pause?mode=abort"] and paused["now"]
        window.finish(3, Outcome("label"))
        assert client.labels[-1] == "3" and window.ready and routes[-1] == "/resume" and not paused["now"]

        paused["now"] = True  # the caller pauses around its rounds: the window leaves that pause alone
        routes.clear()
        window.finish(4, Outcome("not-ready", "a mix"))
        window.finish(5, Outcome("label"))
        assert routes == ["/is_paused"] and paused["now"] and client.labels[-2:] == [NOT_READY, "5"]
    finally:
        server.shutdown()
        server.server_close()
