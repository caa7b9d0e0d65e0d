"""vLLM's weight-transfer backend `weightsync`, for both of vLLM's registries.

Installing weightsync registers it in every vLLM process (API server, engine core, each worker)
through the `vllm.general_plugins` entry point, which calls `register`. Then::

    vllm serve MODEL --weight-transfer-config '{"backend": "weightsync"}'      # the workers
    WeightTransferTrainerFactory.trainer_init(WeightsyncTrainerInitInfo(rank=0), client=..., source=...)

    plugin.py      vLLM's general plugin: the backend's name in both registries
    worker.py      WeightsyncWorkerEngine: a WeightReceiver in each worker, driven by vLLM's
                   start / update / finish lifecycle through the model's own load_weights
    trainer.py     WeightsyncTrainerEngine: a WeightSender behind vLLM's trainer API;
                   VLLMSource: a weightsync WeightSource as vLLM's
    rendezvous.py  how the trainer (or the server) learns every worker's receiver address
    layout.py      the checkpoint layout a worker checks a push against

`weightsync serve --engine vllm` (and BackgroundServer, RolloutFleet with engine="vllm"): vLLM's
own OpenAI server with this backend in every worker, and weightsync's parts on top:

    server.py      assembly and lifecycle: the port, vLLM's app (build_app + init_app_state),
                   the receivers (init_weight_transfer_engine), start-up 503s, SIGTERM
    launch.py      vLLM's arguments (its own parser), preload, AsyncLLM, the warm-up
    doorbell.py    a worker rings the API process as a push reaches it (Unix socket, JSON)
    events.py      what a worker rings with: a closed set of typed messages
    control.py     the API process's pauses, the update window across workers, the version
    http.py        weightsync's routes and middleware (auth, gate, weight versions on responses)
    versions.py    weight versions recorded per HTTP request as vLLM's outputs pass
    internals.py   the one module that reads vLLM internals (streamed tokens' versions)

Importing this package imports no vLLM; its modules do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightsync.integrations.vllm.plugin import BACKEND, register

if TYPE_CHECKING:
    from weightsync.integrations.vllm.trainer import VLLMSource, WeightsyncTrainerEngine, WeightsyncTrainerInitInfo

__all__ = ["BACKEND", "VLLMSource", "WeightsyncTrainerEngine", "WeightsyncTrainerInitInfo", "register"]


def __getattr__(name: str) -> Any:
    """The trainer's classes, imported (with vLLM) only when asked for."""
    if name in ("VLLMSource", "WeightsyncTrainerEngine", "WeightsyncTrainerInitInfo"):
        from weightsync.integrations.vllm import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
