"""vLLM's general plugin: puts the `weightsync` backend in vLLM's two weight-transfer registries.

vLLM runs it in every process it starts (API server, engine core, each worker) once weightsync is
installed (the `vllm.general_plugins` entry point), before any model runs there. It imports no more
of vLLM than the registries.

On a CPU with AMX tiles (`amx_tile` in /proc/cpuinfo: most Xeons of the last three years) it also
asks the kernel for them in the process (`init_amx`): vLLM's CPU kernels take their AMX path for
bfloat16, and in a process that never asked, a worker's first short prompt dies of SIGILL.
"""

from __future__ import annotations

__all__ = ["BACKEND", "init_amx", "register"]

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
