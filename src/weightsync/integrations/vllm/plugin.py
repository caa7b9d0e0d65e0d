"""vLLM's general plugin: puts the `weightsync` backend in vLLM's two weight-transfer registries.

vLLM runs it in every process it starts (API server, engine core, each worker) once weightsync is
installed (the `vllm.general_plugins` entry point). It imports no more of vLLM than the registries.
"""

from __future__ import annotations

__all__ = ["BACKEND", "register"]

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
