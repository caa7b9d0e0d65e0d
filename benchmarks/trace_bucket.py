"""Which of weightsync's files one bucket crosses, on each side of a push.

    python benchmarks/trace_bucket.py --transport shm        # or tcp; --sink dict|callable

A receiver runs in a child process and the sender here, each under a profiler that records every
call into a function of the `weightsync` package (`threading.setprofile`, so every thread is
seen). A bucket's window on the sender runs from its plane's `send(k)` to `send(k + 1)`; on the
receiver from its plane's `receive(k)` to `receive(k + 1)`. For a bucket in the middle of the
push (the steady state: no set-up, no commit), it prints the project files and the distinct
functions that ran in its window on each side, with the threads they ran on. Timings are not
the point: the profiler slows everything down.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

import weightsync
from weightsync import WeightReceiver, WeightSender

PACKAGE = str(Path(weightsync.__file__).parent)
NUM_TENSORS = 16
TENSOR_ELEMENTS = 256 << 10  # 512 KiB in bf16
BUCKET_BYTES = 1 << 20  # two tensors a bucket: 8 buckets


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        f"layers.{i}.weight": torch.randn(TENSOR_ELEMENTS, generator=generator).to(torch.bfloat16)
        for i in range(NUM_TENSORS)
    }


class Recorder:
    """Every call into the package: (seconds, thread name, file relative to the package, function)."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, str, str, str]] = []
        self._lock = threading.Lock()

    def __call__(self, frame, event, arg):  # type: ignore[no-untyped-def]
        if event != "call":
            return
        filename = frame.f_code.co_filename
        if not filename.startswith(PACKAGE):
            return
        entry = (
            time.perf_counter(),
            threading.current_thread().name,
            os.path.relpath(filename, PACKAGE),
            frame.f_code.co_qualname,
        )
        with self._lock:
            self.calls.append(entry)

    def start(self) -> None:
        threading.setprofile(self)
        sys.setprofile(self)

    def stop(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def window(calls: list[tuple[float, str, str, str]], marker: str, index: int) -> list[tuple[float, str, str, str]]:
    """The calls between the `index`-th and the next call of function `marker` (a qualname)."""
    starts = [t for t, _, _, name in calls if name == marker]
    if len(starts) < index + 2:
        raise SystemExit(f"only {len(starts)} calls of {marker}: not enough buckets to trace")
    begin, end = starts[index], starts[index + 1]
    return [call for call in calls if begin <= call[0] < end]


def summarize(calls: list[tuple[float, str, str, str]]) -> dict[str, object]:
    files: dict[str, set[str]] = defaultdict(set)
    threads: dict[str, set[str]] = defaultdict(set)
    for _, thread, file, function in calls:
        files[file].add(function)
        threads[file].add(thread.rstrip("0123456789_-"))
    return {
        "files": len(files),
        "functions": sum(len(f) for f in files.values()),
        "threads": sorted({t.rstrip("0123456789_-") for _, t, _, _ in calls}),
        "by_file": {
            file: {"functions": sorted(fs), "threads": sorted(threads[file])} for file, fs in sorted(files.items())
        },
    }


def marker_of(calls: list[tuple[float, str, str, str]], side: str) -> str:
    """The plane's per-bucket function: the `send`/`receive` method of a class in transports/."""
    verb = "send" if side == "sender" else "receive"
    names = {name for _, _, file, name in calls if file.startswith("transports") and name.endswith(f"Plane.{verb}")}
    if len(names) != 1:
        raise SystemExit(f"cannot tell the {side}'s per-bucket plane call among {sorted(names)}")
    return names.pop()


def run_receiver(transport: str, sink_kind: str, out: Path) -> None:
    tensors = {name: torch.empty_like(t) for name, t in _tensors().items()}
    loaded: list[str] = []
    sink = tensors if sink_kind == "dict" else (lambda pairs: loaded.extend(name for name, _ in pairs))
    recorder = Recorder()
    recorder.start()
    with WeightReceiver(sink, transport, timeout=60) as receiver:
        print(receiver.address, flush=True)
        sys.stdin.readline()  # the sender is done (the receiver answers its commit before that)
        if receiver.version != 1:
            raise SystemExit("the push did not arrive")
    recorder.stop()
    out.write_text(json.dumps(recorder.calls))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", choices=["shm", "tcp"], default="shm")
    parser.add_argument("--sink", choices=["dict", "callable"], default="dict")
    parser.add_argument("--verify", choices=["off", "bucket", "full"], default="bucket")
    parser.add_argument("--bucket", type=int, default=4, help="which bucket to trace (not the first or last)")
    parser.add_argument("--json", action="store_true", help="print the whole trace summary as JSON")
    parser.add_argument("--receiver-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receiver_out:
        run_receiver(args.transport, args.sink, Path(args.receiver_out))
        return

    out = Path(f"/tmp/weightsync-trace-{os.getpid()}.json")
    child = subprocess.Popen(
        [sys.executable, __file__, "--transport", args.transport, "--sink", args.sink, "--receiver-out", str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        address = child.stdout.readline().strip()
        tensors = _tensors()
        recorder = Recorder()
        with WeightSender(address, bucket_bytes=BUCKET_BYTES, timeout=60, verify=args.verify) as sender:
            recorder.start()
            report = sender.push(tensors, version=1)
            recorder.stop()
        assert child.stdin is not None
        child.stdin.write("done\n")
        child.stdin.flush()
        child.wait(timeout=120)
        received = json.loads(out.read_text())
    finally:
        child.kill()
        out.unlink(missing_ok=True)
    sides = {}
    for side, calls in (("sender", recorder.calls), ("receiver", [tuple(c) for c in received])):
        marker = marker_of(calls, side)
        whole = summarize(calls)
        sides[side] = {
            "marker": marker,
            **summarize(window(calls, marker, args.bucket)),
            "whole_push": {"files": whole["files"], "functions": whole["functions"], "threads": whole["threads"]},
        }
    if args.json:
        print(
            json.dumps(
                {"transport": args.transport, "sink": args.sink, "buckets": report.num_buckets, **sides}, indent=1
            )
        )
        return
    print(f"{args.transport}, {args.sink} sink, verify={args.verify}, bucket {args.bucket} of {report.num_buckets}")
    for side, summary in sides.items():
        whole = summary["whole_push"]
        print(
            f"\n{side}: {summary['files']} files, {summary['functions']} functions, threads {summary['threads']}"
            f" (the whole push: {whole['files']} files, {whole['functions']} functions, {len(whole['threads'])} threads)"
        )
        for file, detail in summary["by_file"].items():  # type: ignore[union-attr]
            print(f"  {file:32} {len(detail['functions']):3}  {', '.join(detail['functions'])}")


if __name__ == "__main__":
    main()
