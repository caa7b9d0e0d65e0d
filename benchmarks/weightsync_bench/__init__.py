"""`weightsync-bench`: push a synthetic model through each transport and the usual baselines.

Every method is timed the same way, end to end: from the sender's first byte until the values
sit in a separate receiving process's preallocated (and already resident) destination tensors.
Each receiver then checks every byte against content regenerated from the seed, outside the
timed region. Content differs per tensor and per sync, so stale bytes cannot pass.

The sender is this process; receivers are spawned processes that hold their destination
tensors for the whole run. Baselines (`torch.save`/`torch.load` and safetensors through a
`/dev/shm` file, a `multiprocessing` queue) always run against one receiver.

Peak RSS growth is measured per process over each sync: the kernel's peak (VmHWM) is reset
through `/proc/self/clear_refs` before it and read after it; where that is not allowed a
thread samples RSS every millisecond instead. Shared-memory pages a process maps and touches
count, as they do in RSS.

config.py what a run measures; model.py the synthetic model and its content; measure.py memcpy,
peak RSS and the environment; receivers.py the receiving processes; runs.py the runs;
results.py what they measured, as JSON and as a table; args.py the command's flags, cli.py its
run and output (`weightsync-bench`, `python -m weightsync_bench`); delta.py and link.py the
`--delta-lr` and `--link` runs.

This package is the benchmarks' one home: it lives in benchmarks/ beside the scripts that use it,
outside the library package `weightsync`, and ships in the same distribution with its own
command, `weightsync-bench`. It imports weightsync; weightsync never imports it.
"""

from __future__ import annotations

from weightsync_bench.config import BASELINES, DEFAULT_TRANSPORTS, GIB, MIB, TRANSPORTS, BenchConfig
from weightsync_bench.results import BenchReport, MethodResult, format_table
from weightsync_bench.runs import fitting_size_bytes, run

__all__ = [
    "BASELINES",
    "DEFAULT_TRANSPORTS",
    "GIB",
    "MIB",
    "TRANSPORTS",
    "BenchConfig",
    "BenchReport",
    "MethodResult",
    "fitting_size_bytes",
    "format_table",
    "run",
]
