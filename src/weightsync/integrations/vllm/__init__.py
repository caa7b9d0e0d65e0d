"""vLLM's weight-transfer backend `weightsync`, for both of vLLM's registries.

Installing weightsync registers it in every vLLM process (API server, engine core, each worker)
through the `vllm.general_plugins` entry point, which calls `register`. Then::

    vllm serve MODEL --weight-transfer-config '{"backend": "weightsync"}'      # the workers
    WeightTransferTrainerFactory.trainer_init(WeightsyncTrainerInitInfo(rank=0), client=..., source=...)

    worker.py      WeightsyncWorkerEngine: a WeightReceiver in each worker, driven by vLLM's
                   start / update / finish lifecycle through the model's own load_weights
    trainer.py     WeightsyncTrainerEngine: a WeightSender behind vLLM's trainer API;
                   VLLMSource: a weightsync WeightSource as vLLM's
    rendezvous.py  how the trainer learns every worker's receiver address

Importing this package imports no vLLM; its modules do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weightsync.integrations.vllm.trainer import VLLMSource, WeightsyncTrainerEngine, WeightsyncTrainerInitInfo

__all__ = ["BACKEND", "VLLMSource", "WeightsyncTrainerEngine", "WeightsyncTrainerInitInfo", "register"]

BACKEND = "weightsync"
"""The name vLLM's config gives: `--weight-transfer-config '{"backend": "weightsync"}'`."""

_MODULES = {
    "WeightTransferEngineFactory": ("weightsync.integrations.vllm.worker", "WeightsyncWorkerEngine"),
    "WeightTransferTrainerFactory": ("weightsync.integrations.vllm.trainer", "WeightsyncTrainerEngine"),
}


def register() -> None:
    """vLLM's general plugin: put `weightsync` in both weight-transfer registries (lazily: the
    engines' modules are imported when vLLM builds one). Safe to call more than once."""
    from vllm.distributed.weight_transfer import factory

    for registry, (module, name) in _MODULES.items():
        try:
            getattr(factory, registry).register_engine(BACKEND, module, name)
        except ValueError:  # registered already: vLLM loads plugins once per process, tests again
            pass


def __getattr__(name: str) -> Any:
    """The trainer's classes, imported (with vLLM) only when asked for."""
    if name in ("VLLMSource", "WeightsyncTrainerEngine", "WeightsyncTrainerInitInfo"):
        from weightsync.integrations.vllm import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
