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
    internals.py   the one module that reads vLLM internals
    (the worker kit, weightsync.workers: the start message, the receiver stack, the rendezvous,
    the checkpoint layout a worker checks a push against)

`weightsync serve --engine vllm` (and BackgroundServer, RolloutFleet with engine="vllm"): vLLM's
own OpenAI server with this backend in every worker, and weightsync's parts on top:

    serving/vllm/  vLLM's args, AsyncLLM, its app, per-request weight versions; the body it
                   shares with SGLang's adapter is serving/own_server.py
    serving/       the control (pauses, the update window across workers, the version), the
                   HTTP face; the worker kit's doorbell and events carry the workers' rings

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
