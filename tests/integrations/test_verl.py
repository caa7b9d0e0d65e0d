"""weightsync as verl's checkpoint engine, against verl 0.9.1's own classes, in real processes.

One trainer worker and two rollout workers are Ray actors that build the engine as verl's
workers do (tests/integrations/verl_workers.py). The driver uses verl's `CheckpointEngineConfig`
and `CheckpointEngineManager.build_process_group` (prepare, build_topology, init_process_group),
then sends and receives and finalizes as `CheckpointEngineManager.update_weights` does, over shm,
tcp, collective and nixl (skipped where nixl is not installed). Covered:
a tensor larger than the bucket, fp32 masters cast to bf16, three steps with versions, DTensor
parameters, a rollout worker killed mid-sync (the trainer's `send_weights` raises within the
timeout, the other worker commits), and a sync after the group changed; results bit-exact.
The checks that need no process (options, topology, the non-sending ranks) run in this one.

Skipped where verl is not installed (scripts/install-verl.sh installs it).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from tests.helpers import assert_all_bit_exact, missing_package

ray = pytest.importorskip("ray")
verl_base = pytest.importorskip("verl.checkpoint_engine.base", exc_type=ImportError)

from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineRegistry  # noqa: E402
from verl.workers.config import CheckpointEngineConfig  # noqa: E402

from tests.integrations import verl_workers  # noqa: E402
from weightsync import ConfigError, PlanError, WeightSyncError  # noqa: E402
from weightsync.integrations.verl import Endpoint, WeightSyncCheckpointEngine  # noqa: E402

pytestmark = pytest.mark.slow

TIMEOUT_S = 5.0
"""The engine's timeout: every failure must surface well within it (plus process start-up)."""


def engine_config(transport: str) -> CheckpointEngineConfig:
    """The lines a verl user adds: backend, the module that registers it, and the options."""
    return CheckpointEngineConfig(
        backend="weightsync",
        update_weights_bucket_megabytes=1,
        custom_backend_module="weightsync.integrations.verl",
        engine_kwargs={
            "weightsync": {"transport": transport, "cast": "bfloat16", "verify": "bucket", "timeout": TIMEOUT_S}
        },
    )


class WorkerGroup:
    """The calls `CheckpointEngineManager` makes on a verl `RayWorkerGroup`, over plain Ray actors:
    `execute_checkpoint_engine` dispatched as verl's DP_COMPUTE (the i-th of each argument list
    to the i-th worker) and `update_weights` sent to every worker (ONE_TO_ALL)."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    @property
    def world_size(self) -> int:
        return len(self.handles)

    def execute_checkpoint_engine(self, method: list[str], **kwargs: list[Any]) -> list[Any]:
        return [
            handle.execute_checkpoint_engine.remote(method[i], **{key: value[i] for key, value in kwargs.items()})
            for i, handle in enumerate(self.handles)
        ]

    def update_weights(self, **kwargs: Any) -> list[Any]:
        return [handle.update_weights.remote(**kwargs) for handle in self.handles]


STARTUP_S = 300
"""How long a worker process may take to start (Ray's worker, torch and verl imported) on a
loaded host; the bounds on what the tests check start once the workers are up."""


def start(cls: type, *args: Any) -> Any:
    return ray.remote(num_cpus=0, max_restarts=0)(cls).remote(*args)


def answering(*handles: Any) -> list[Any]:
    """The handles, once each worker process is up and answers."""
    assert ray.get([handle.close.remote() for handle in handles], timeout=STARTUP_S) == [[]] * len(handles)
    return list(handles)


def finalize(*groups: WorkerGroup) -> None:
    """Step 6 of `CheckpointEngineManager.update_weights`."""
    ray.get([ref for group in groups for ref in group.execute_checkpoint_engine(["finalize"] * group.world_size)])


@pytest.fixture(scope="module")
def processes():  # type: ignore[no-untyped-def]
    """A local Ray cluster with one trainer worker and two rollout workers, started once: each
    transport below gives them new engines (a test that kills a worker replaces it)."""
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    ray.cloudpickle.register_pickle_by_value(verl_workers)
    trainer, *rollouts = answering(
        start(verl_workers.TrainerWorker, 0), *(start(verl_workers.RolloutWorker) for _ in range(2))
    )
    live = {"trainer": trainer, "rollouts": rollouts}
    yield live
    for handle in [live["trainer"], *live["rollouts"]]:
        assert ray.get(handle.close.remote(), timeout=30) == [], "shared memory left behind"
    ray.shutdown()


@pytest.fixture(scope="module", params=["shm", "tcp", "collective", "nixl"])
def workers(request, processes):  # type: ignore[no-untyped-def]
    """The workers with engines for one transport, as worker groups, and verl's manager over them."""
    if package := missing_package(request.param):
        pytest.skip(f"{request.param} needs {package!r}, not installed")
    config = engine_config(request.param)
    handles = [processes["trainer"], *processes["rollouts"]]
    assert ray.get([handle.configure.remote(config) for handle in handles], timeout=STARTUP_S) == [[]] * 3
    trainer, rollout = WorkerGroup(handles[:1]), WorkerGroup(handles[1:])
    manager = CheckpointEngineManager(config, actor_wg=trainer, replicas=[])
    return {"config": config, "manager": manager, "trainer": trainer, "rollout": rollout, "processes": processes}


def sync(workers: dict[str, Any], rollout: WorkerGroup, step: int, **send: Any) -> tuple[Any, list[Any]]:
    """One weight update as `CheckpointEngineManager.update_weights` runs it (steps 4 to 6)."""
    manager, trainer = workers["manager"], workers["trainer"]
    manager.build_process_group(rollout)
    metrics, *results = ray.get(
        trainer.update_weights(global_steps=step, seed=step, **send) + rollout.update_weights(global_steps=step),
        timeout=60,
    )
    finalize(trainer, rollout)
    return metrics, results


def test_three_steps_land_bit_exact_with_their_versions(workers):
    want_bucket = 1 << 20
    for step in (1, 2, 3):
        metrics, results = sync(workers, workers["rollout"], step, dtensor=step == 3)
        want = verl_workers.expected(verl_workers.make_model(step), torch.bfloat16)
        assert metrics["weightsync/buckets"] >= 2, "the embedding spans more than one bucket"
        for result in results:
            assert result["version"] == step
            assert list(result["weights"]) == list(want), "in the trainer's order"
            assert_all_bit_exact(result["weights"], want)
    embed_bytes = want["model.embed_tokens.weight"].nbytes
    assert embed_bytes > want_bucket and metrics["weightsync/bytes"] > embed_bytes


def test_a_rollout_worker_killed_mid_sync_fails_the_push_in_time_and_a_new_group_syncs(workers):
    config, trainer = workers["config"], workers["trainer"]
    survivor, doomed = workers["rollout"].handles
    ray.get(doomed.die_after.remote(2))
    doomed_address, survivor_address = (
        ray.get(h.execute_checkpoint_engine.remote("prepare")).address for h in (doomed, survivor)
    )
    rollout = workers["rollout"]
    workers["manager"].build_process_group(rollout)

    started = time.monotonic()
    sent = trainer.update_weights(global_steps=10, seed=10)
    received = rollout.update_weights(global_steps=10)
    with pytest.raises(ray.exceptions.RayTaskError, match="SyncFailed") as failed:
        ray.get(sent[0], timeout=60)
    assert time.monotonic() - started < TIMEOUT_S, "the push outlived its timeout"
    assert doomed_address in str(failed.value) and survivor_address not in str(failed.value)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(received[1], timeout=60)
    kept = ray.get(received[0], timeout=60)
    assert kept["version"] == 10, "the worker that lived committed"
    assert_all_bit_exact(kept["weights"], verl_workers.expected(verl_workers.make_model(10), torch.bfloat16))
    finalize(trainer, WorkerGroup([survivor]))

    # the group changed: the dead worker is replaced; the next sync reaches both
    (newcomer,) = answering(start(verl_workers.RolloutWorker))
    assert ray.get(newcomer.configure.remote(config), timeout=60) == []
    workers["processes"]["rollouts"] = [survivor, newcomer]
    _, results = sync(workers, WorkerGroup([survivor, newcomer]), 11)
    want = verl_workers.expected(verl_workers.make_model(11), torch.bfloat16)
    for result in results:
        assert result["version"] == 11
        assert_all_bit_exact(result["weights"], want)


# --- in this process: options, topology, the ranks that do not send -----------------------------


def test_the_backend_is_registered_and_its_options_are_checked_when_built():
    assert CheckpointEngineRegistry.get("weightsync") is WeightSyncCheckpointEngine
    with pytest.raises(ConfigError, match="unknown engine_kwargs.weightsync key"):
        WeightSyncCheckpointEngine(bucket_size=1 << 20, is_master=True, bucket_size_mb=4)
    with pytest.raises(ConfigError, match="above verl's update_weights_bucket_megabytes"):
        WeightSyncCheckpointEngine(bucket_size=1 << 20, is_master=True, bucket_bytes=2 << 20)
    with pytest.raises(ConfigError, match="cannot reach another process"):
        WeightSyncCheckpointEngine(bucket_size=1 << 20, transport="inproc")
    with pytest.raises(ConfigError):
        WeightSyncCheckpointEngine(bucket_size=1 << 20, is_master=True, cast="int8")
    with pytest.raises(ConfigError):
        WeightSyncCheckpointEngine(bucket_size=1 << 20, verify="sometimes")
    engine = WeightSyncCheckpointEngine(bucket_size=1 << 20, is_master=True)
    options = engine.sender_options
    assert options is not None and engine.receiver_options is None, "an actor sends"
    assert options.bucket_bytes == "auto" and options.memory_budget_bytes == 2 << 20, "auto stays within verl's bucket"


def test_topology_rank_zero_sends_to_every_rollout_worker():
    metadata = [
        Endpoint("actor", is_master=True),
        Endpoint("actor"),
        Endpoint("rollout", "shm://@a"),
        Endpoint("rollout", "shm://@b"),
    ]
    actor, rollout = WeightSyncCheckpointEngine.build_topology(2, 2, metadata)
    assert actor == {"rank": [0, -1], "world_size": [3, 3], "addresses": [("shm://@a", "shm://@b"), ()]}
    assert rollout == {"rank": [1, 2], "world_size": [3, 3], "addresses": [(), ()]}
    with pytest.raises(ConfigError, match="actor rank 0 must be the sender"):
        WeightSyncCheckpointEngine.build_topology(1, 1, [Endpoint("actor"), Endpoint("rollout", "shm://@a")])
    with pytest.raises(ConfigError, match="endpoints"):
        WeightSyncCheckpointEngine.build_topology(1, 1, [{"master": True}, Endpoint("rollout", "shm://@a")])


def test_ranks_that_do_not_send_walk_the_generator_and_return():
    engine = WeightSyncCheckpointEngine(bucket_size=1 << 20, is_master=False)
    assert engine.prepare() == Endpoint("actor")
    engine.init_process_group(rank=-1, world_size=3, addresses=())
    walked = []

    def weights():  # type: ignore[no-untyped-def]
        for name, tensor in verl_workers.make_model(0).items():
            walked.append(name)
            yield name, tensor

    assert asyncio.run(engine.send_weights(weights(), global_steps=0)) == {}
    assert walked == list(verl_workers.make_model(0))


def test_a_changed_tensor_list_fails_one_sync_cleanly_and_the_next_learns_it():
    """In one process (both sides on one event loop): an async generator works as a sync one
    does, a sync whose tensors differ from the last one's commits nothing, and the one after
    learns the new list."""
    actor = WeightSyncCheckpointEngine(bucket_size=1 << 20, is_master=True, timeout=TIMEOUT_S)
    rollout = WeightSyncCheckpointEngine(bucket_size=1 << 20, timeout=TIMEOUT_S)
    try:
        actor_kwargs, rollout_kwargs = WeightSyncCheckpointEngine.build_topology(
            1, 1, [actor.prepare(), rollout.prepare()]
        )
        actor.init_process_group(**{key: value[0] for key, value in actor_kwargs.items()})
        rollout.init_process_group(**{key: value[0] for key, value in rollout_kwargs.items()})

        async def weights(model):  # type: ignore[no-untyped-def]
            for item in model.items():
                yield item

        async def sync(model, step):  # type: ignore[no-untyped-def]
            async def receive():  # type: ignore[no-untyped-def]
                return {name: tensor.clone() async for name, tensor in rollout.receive_weights(step)}

            return await asyncio.gather(actor.send_weights(weights(model), step), receive(), return_exceptions=True)

        model = verl_workers.make_model(1)
        metrics, got = asyncio.run(sync(model, 1))
        assert metrics["weightsync/buckets"] >= 2 and rollout.version == 1
        assert_all_bit_exact(got, verl_workers.expected(model, None))

        grown = {**verl_workers.make_model(2), "lm_head.weight": torch.ones(8, 8)}
        sent, received = asyncio.run(sync(grown, 2))
        assert isinstance(sent, PlanError) and "lm_head.weight" in str(sent)
        assert isinstance(received, WeightSyncError) and "lm_head.weight" in str(received)
        assert rollout.version in (1, None), "version 2 never commits (None: some of it was loaded)"

        metrics, got = asyncio.run(sync(grown, 3))
        assert rollout.version == 3
        assert_all_bit_exact(got, verl_workers.expected(grown, None))
    finally:
        actor.close()
        rollout.close()


def test_the_config_lines_of_the_docs_build_both_sides(monkeypatch):
    """Each config block of docs/integrations/verl.md, composed into verl's own trainer config
    (Hydra) and turned into engines as verl's workers do: the documented lines work as written."""
    import re
    from pathlib import Path

    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    monkeypatch.setenv("WEIGHTSYNC_AUTH_TOKEN", "a-token-of-sixteen-chars")  # host=auto listens beyond loopback
    doc = (Path(__file__).parents[2] / "docs" / "integrations" / "verl.md").read_text(encoding="utf-8")
    blocks = [block.split() for block in re.findall(r"```bash\n(.*?)```", doc, re.S) if "backend=weightsync" in block]
    assert len(blocks) == 4, "shm, cudaipc, tcp, collective"
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    for overrides in blocks:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            config = compose(config_name="ppo_trainer", overrides=overrides)
        engine_config = omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine)
        transport = overrides[2].rpartition("=")[2]
        for role in ({"is_master": True}, {}):
            engine = verl_workers.build_engine(engine_config, **role)
            assert isinstance(engine, WeightSyncCheckpointEngine) and engine.settings.transport == transport
