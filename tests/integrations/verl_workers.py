"""The processes of the verl tests: a trainer worker and a rollout worker that build and call their
checkpoint engine exactly as verl 0.9.1 does (`ActorRolloutRefWorker` in verl/workers/
engine_workers.py, `CheckpointEngineWorker` in verl/checkpoint_engine/base.py), around a
stand-in model and a stand-in server adapter.

Ray ships this module to its workers by value, so it imports nothing from the tests.
"""

from __future__ import annotations

import os
from typing import Any

import torch

EMBED_SHAPE = (1024, 640)
"""fp32 2.5 MiB, 1.25 MiB as bf16: larger than the 1 MiB bucket the tests configure."""


def make_model(seed: int) -> dict[str, torch.Tensor]:
    """A trainer's fp32 master weights after step `seed`, plus an integer buffer (never cast)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(EMBED_SHAPE, generator=gen),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(640, 64, generator=gen),
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 640, generator=gen).t(),  # non-contiguous
        "model.norm.weight": torch.randn(640, generator=gen),
        "model.step": torch.tensor([seed, -seed], dtype=torch.int64),
    }


def expected(model: dict[str, torch.Tensor], cast: torch.dtype | None) -> dict[str, torch.Tensor]:
    """What a rollout worker should hold once `model` was sent with `cast`."""
    return {
        name: (tensor.to(cast) if cast is not None and tensor.is_floating_point() else tensor).contiguous()
        for name, tensor in model.items()
    }


def build_engine(config: Any, **role: Any) -> Any:
    """As verl builds it: import the custom backend module, then `CheckpointEngineRegistry.new`."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs(config.custom_backend_module or None)
    return CheckpointEngineRegistry.new(
        config.backend,
        **role,
        bucket_size=config.update_weights_bucket_megabytes << 20,
        **config.engine_kwargs.get(config.backend, {}),
    )


def leftover_segments() -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(f"weightsync-{os.getpid()}-"))


class TrainerWorker:
    """verl's actor worker: the engine gets `is_master=(rank == 0)` and sends a per-tensor
    generator (`get_per_tensor_param()`); with `dtensor`, the parameters are DTensors of a
    one-rank mesh, which the generator yields as FSDP2's would be before `full_tensor()`."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.engine: Any = None

    def configure(self, config: Any) -> list[str]:
        """A new engine for `config` (verl builds one per worker; the tests reuse the process)."""
        left = self.close()
        self.engine = build_engine(config, is_master=self.rank == 0)
        return left

    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.engine, method)(*args, **kwargs)

    async def update_weights(self, global_steps: int, seed: int, dtensor: bool = False) -> dict[str, float]:
        model = make_model(seed)
        if dtensor:
            model = _as_dtensors(model)
        per_tensor_param = ((name, tensor) for name, tensor in model.items())
        return await self.engine.send_weights(per_tensor_param, global_steps=global_steps)  # type: ignore[no-any-return]

    def close(self) -> list[str]:
        """Close the engine; the shared-memory segments this process still holds (none, we hope)."""
        if self.engine is not None:
            self.engine.close()
        return leftover_segments()


class ServerAdapter:
    """verl's server adapter, as far as weights go: iterates what `receive_weights` yields with
    verl's own `ensure_async_iterator` and copies each tensor into its own storage, as a loader."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.global_steps: int | None = None
        self.die_after: int | None = None

    async def update_weights(self, weights: Any, global_steps: int | None = None, **kwargs: Any) -> None:
        from verl.workers.rollout.utils import ensure_async_iterator

        assert kwargs.get("wire_format", "named_tensors") == "named_tensors"
        taken = 0
        async for name, tensor in ensure_async_iterator(weights):
            self.weights[name] = tensor.clone()
            taken += 1
            if self.die_after is not None and taken >= self.die_after:
                os._exit(1)  # the rollout process dies in the middle of the sync
        self.global_steps = global_steps


class RolloutWorker:
    """verl's `CheckpointEngineWorker`: the engine is built without `is_master`, and each sync
    hands `receive_weights(...)` to the server adapter."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.server_adapter = ServerAdapter()

    def configure(self, config: Any) -> list[str]:
        left = self.close()
        self.engine = build_engine(config)
        return left

    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.engine, method)(*args, **kwargs)

    async def update_weights(self, global_steps: int | None = None) -> dict[str, Any]:
        weights = self.engine.receive_weights(global_steps=global_steps)
        await self.server_adapter.update_weights(
            weights, global_steps=global_steps, wire_format=getattr(self.engine, "wire_format", "named_tensors")
        )
        return {"version": self.engine.version, "weights": dict(self.server_adapter.weights)}

    def die_after(self, num_tensors: int) -> None:
        self.server_adapter.die_after = num_tensors

    def close(self) -> list[str]:
        if self.engine is not None:
            self.engine.close()
        return leftover_segments()


def _as_dtensors(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    return {
        name: distribute_tensor(tensor.contiguous(), mesh, [Shard(0)]) if tensor.is_floating_point() else tensor
        for name, tensor in model.items()
    }
