"""weightsync into a stock SGLang server (0.5.23), through SGLang's own doors.

SGLang is started as its users start it, plus weightsync's loader::

    python -m sglang.launch_server --model-path M \\
        --custom-weight-loader weightsync.integrations.sglang.load_weights

and the trainer pushes with one call per step::

    from weightsync.integrations.sglang import SGLangEngine
    engine = SGLangEngine("http://127.0.0.1:30000", transport="shm")
    engine.push(model.state_dict(), version=step)

    trainer.py     SGLangEngine: the whole round (pause, begin, push, end, label, continue)
    client.py      SGLang's HTTP routes, with timeouts
    control.py     the tiny control messages sent through update_weights_from_tensor, and
                   each worker's LandResult written back into the trainer's store
    worker.py      load_weights: SGLang's custom loader; a WeightReceiver in every TP worker

docs/integrations/sglang.md tells the whole story. Importing this package imports no SGLang;
only the worker's loader does, inside SGLang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weightsync.integrations.sglang.trainer import LOADER, SGLangEngine
    from weightsync.integrations.sglang.worker import load_weights

__all__ = ["LOADER", "SGLangEngine", "load_weights"]


def __getattr__(name: str) -> Any:
    """The trainer's classes and the worker's loader, imported when asked for."""
    if name in ("LOADER", "SGLangEngine"):
        from weightsync.integrations.sglang import trainer

        return getattr(trainer, name)
    if name == "load_weights":
        from weightsync.integrations.sglang.worker import load_weights

        return load_weights
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
