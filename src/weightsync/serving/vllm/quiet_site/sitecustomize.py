"""Run by Python at the start of every process of a vLLM server that has this folder first on its
PYTHONPATH (its engine core and workers, which vLLM starts by spawn): Triton, which cannot run on
this host, stays out of the process, and the lines that only say so are dropped (noise.py says
why). Imported as a module of weightsync, it lends `keep_triton_out` to the server's own process.

Standard library only: it runs before anything else in each process. A sitecustomize that this
one hides (a distribution's own) runs after it, as Python would have run it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import sys
import warnings

TRITON_NOTES = {
    "vllm.platforms.cpu": "Triton is not installed",
    "vllm.config.vllm": "Model Runner V2 requires Triton",
    "torch._library.triton": "Triton not available",
}
"""Logger -> the start of its lines that only say Triton is missing (vLLM and torch run without it)."""


class DropNote(logging.Filter):
    """Drops a logger's records whose message starts with `start`."""

    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def keep_triton_out() -> None:
    """In this process from now on: `import triton` fails, as where it is not installed, and the
    lines that only say so are dropped."""
    sys.modules.setdefault("triton", None)  # type: ignore[arg-type]  # import's "not here" (unless imported already)
    for name, start in TRITON_NOTES.items():  # filters outlive vLLM's and torch's own log set-up
        logging.getLogger(name).addFilter(DropNote(start))
    # Without Triton, vLLM's CPU platform scans every module for kernels to replace, and touching
    # torch.distributed's deprecated aliases on the way warns.
    warnings.filterwarnings("ignore", r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning)


def run_hidden_sitecustomize() -> None:
    """The sitecustomize that this folder, first on the path, hides: run it as Python would have."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


if __name__ == "sitecustomize":  # Python's start-up, not an import as weightsync's module
    keep_triton_out()
    run_hidden_sitecustomize()
