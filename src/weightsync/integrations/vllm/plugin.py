"""vLLM's general plugin: puts the `weightsync` backend in vLLM's two weight-transfer registries.

vLLM runs it in every process it starts (API server, engine core, each worker) once weightsync is
installed (the `vllm.general_plugins` entry point), before any model runs there. It imports no more
of vLLM than the registries.

On a CPU with AMX tiles (`amx_tile` in /proc/cpuinfo: most Xeons of the last three years) it also
asks the kernel for them in the process (`init_amx`): vLLM's CPU kernels take their AMX path for
bfloat16, and in a process that never asked, a worker's first short prompt dies of SIGILL.

It keeps two of vLLM's warnings out of the log (`quiet_reload`): at every in-place reload (every
sync) vLLM says "Failed to load weights" for each layer no checkpoint tensor loads into, which in
the models it serves are the rotary embeddings (their cos/sin cache is computed from the config,
not loaded) and a language-model head tied to the embedding (its weight is the embedding's, which
the sync loads). Every other layer's warning still shows.
"""

from __future__ import annotations

import logging

__all__ = ["BACKEND", "init_amx", "quiet_reload", "register"]

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

    init_amx()
    quiet_reload()

    for registry, (module, name) in _MODULES.items():
        try:
            getattr(factory, registry).register_engine(BACKEND, module, name)
        except ValueError:  # registered already: vLLM loads plugins once per process, tests again
            pass


def init_amx() -> bool:
    """Where the CPU has AMX tiles, enable them for this process (the permission Linux grants per
    process, `torch.cpu._init_amx`), so that bfloat16 kernels may use them; returns whether
    they are on. Safe to call more than once."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
"""The logger of vLLM's in-place (layerwise) reload."""


def _loads_nothing_by_design(record: logging.LogRecord) -> bool:
    """False for vLLM's "Failed to load weights" of a rotary embedding or a language-model head."""
    if record.msg != "%s: Failed to load weights" or not isinstance(record.args, tuple) or not record.args:
        return True
    layer = str(record.args[0])
    return not (layer.endswith("RotaryEmbedding") or layer == "ParallelLMHead")


def quiet_reload() -> None:
    """Drop the reload's warnings about layers that load nothing by design (the module
    docstring). Safe to call more than once."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if _loads_nothing_by_design not in logger.filters:
        logger.addFilter(_loads_nothing_by_design)
