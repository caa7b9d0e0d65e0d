"""Stock SGLang with weightsync's loader: a weightsync push against SGLang's own ways in, with the
same weights, on the same server, in one run.

    .venv-sglang/bin/python benchmarks/bench_sglang.py --json sglang.json     # 0.5 GiB, 3 rounds
    .venv-sglang/bin/python benchmarks/bench_sglang.py --size-gb 0.05 --repeat 1  # smoke test

It runs in SGLang's own venv (scripts/install-sglang.sh: weightsync is installed there too),
because SGLang's broadcast path needs SGLang's trainer-side helper (`init_custom_process_group`).
It builds a Qwen2-shaped float32 model of about `--size-gb` GiB (`weightsync_bench.saved_model`)
as checkpoint A and a perturbed copy as checkpoint B (both saved, both in the page cache), starts
stock SGLang on A with weightsync's loader (`weightsync_bench.sglang_server`, TP=1), and then,
round after round, each method in turn moves the checkpoint the server does not serve into it,
as one whole round timed end to end as a trainer sees it:

- weightsync shm / tcp: `SGLangEngine.push` (pause, begin_weight_update, update_weights_from_tensor
  with weightsync's loader alongside the push, end_weight_update, label, continue_generation).
- weightsync serve, shm: a `WeightSender` push into `weightsync serve --engine sglang` (SGLang's
  own server under weightsync's sync control, a second server started on A with `--load-format
  auto`): the same round, run by the server as the push arrives; the push returns once the
  server labelled the version.
- SGLang broadcast (per tensor): SGLang's `update_weights_from_distributed` over a gloo group
  with this process (`/init_weights_update_group` once, before the rounds): pause,
  begin_weight_update, one update call per bucket of `--bucket-mb` MiB alongside this process's
  broadcasts of its tensors, end_weight_update, continue_generation; the last call labels the
  version.
- SGLang broadcast (flattened): the same with `load_format="flattened_bucket"` (one broadcast per
  bucket, SGLang's own FlattenedTensorBucket).
- SGLang from disk: `safetensors.save_file` of the trainer's tensors into a fresh folder (page
  cache, as a trainer must write them) then `update_weights_from_disk` of it; the save and the
  load are reported apart too.

Every method must land the weights exactly: after every round SGLang's own checksums
(`/weights_checker`) of what it serves must equal those of its own load of that checkpoint from
disk (A: at start; B: its first disk load), else the run stops. The first round of each method
is a warm-up, reported as "first". Prints a table with each method's median and its ratio to
SGLang's faster broadcast; `--json FILE` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import load_file, save_file

from weightsync import SenderOptions, WeightSender
from weightsync.integrations.sglang import SGLangEngine
from weightsync.serving.process import ChildProcess
from weightsync_bench.saved_model import build_model, read_through
from weightsync_bench.sglang_server import SGLangServer

Weights = dict[str, torch.Tensor]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _post(url: str, path: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    answer = httpx.post(f"{url}{path}", json=body, timeout=timeout)
    if answer.status_code != 200:
        raise RuntimeError(f"{path}: HTTP {answer.status_code}: {answer.text[:500]}")
    return dict(answer.json())


def _checksums(url: str) -> list[dict[str, str]]:
    ranks = _post(url, "/weights_checker", {"action": "checksum"})["ranks"]
    return [dict(rank["checksums"]) for rank in ranks]


def _buckets(weights: Weights, bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in weights.items():
        if buckets[-1] and size + tensor.nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, tensor))
        size += tensor.nbytes
    return buckets


class Broadcast:
    """SGLang's update_weights_from_distributed over a gloo group with this process (rank 0)."""

    def __init__(self, url: str, bucket_bytes: int, flattened: bool) -> None:
        from sglang.srt.utils.common import init_custom_process_group

        self.url, self.bucket_bytes, self.flattened = url, bucket_bytes, flattened
        self.group_name = f"bench-{'flat' if flattened else 'tensor'}"
        port = _free_port()
        body = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": self.group_name,
            "backend": "gloo",
        }
        joined = threading.Thread(target=_post, args=(url, "/init_weights_update_group", body))
        joined.start()  # SGLang's call blocks until this process joins too
        self.group = init_custom_process_group(
            backend="gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            world_size=2,
            rank=0,
            group_name=self.group_name,
        )
        joined.join()

    def __call__(self, weights: Weights, version: int) -> dict[str, float]:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        buckets = _buckets(weights, self.bucket_bytes)
        _post(self.url, "/pause_generation", {"mode": "abort"})
        _post(self.url, "/begin_weight_update", {"selector": "all"})
        for index, bucket in enumerate(buckets):
            last = index == len(buckets) - 1
            body = {
                "names": [name for name, _ in bucket],
                "dtypes": [str(tensor.dtype).removeprefix("torch.") for _, tensor in bucket],
                "shapes": [list(tensor.shape) for _, tensor in bucket],
                "group_name": self.group_name,
                "flush_cache": last,
                "weight_version": str(version) if last else None,
                "load_format": "flattened_bucket" if self.flattened else None,
            }
            failed: list[BaseException] = []
            call = threading.Thread(
                target=_capture, args=(failed, _post, self.url, "/update_weights_from_distributed", body)
            )
            call.start()
            if self.flattened:
                flat = FlattenedTensorBucket(named_tensors=bucket).get_flattened_tensor()
                torch.distributed.broadcast(flat, src=0, group=self.group)
            else:
                for _, tensor in bucket:
                    torch.distributed.broadcast(tensor, src=0, group=self.group)
            call.join()
            if failed:
                raise failed[0]
        _post(self.url, "/end_weight_update", {})
        _post(self.url, "/continue_generation", {})
        return {}


def _capture(failed: list[BaseException], function: Callable[..., Any], *args: Any) -> None:
    try:
        function(*args)
    except BaseException as exc:
        failed.append(exc)


class FromDisk:
    """Save the trainer's tensors, then SGLang's update_weights_from_disk of them."""

    def __init__(self, url: str, template: Path, folder: Path) -> None:
        self.url, self.template, self.folder = url, template, folder
        self.count = 0

    def __call__(self, weights: Weights, version: int) -> dict[str, float]:
        self.count += 1
        target = self.folder / f"v{self.count}"
        shutil.copytree(self.template, target, ignore=shutil.ignore_patterns("*.safetensors"))
        started = time.perf_counter()
        save_file(weights, str(target / "model.safetensors"))
        saved = time.perf_counter()
        _post(self.url, "/pause_generation", {"mode": "abort"})
        body = {"model_path": str(target), "weight_version": str(version), "flush_cache": True}
        answer = _post(self.url, "/update_weights_from_disk", body)
        if not answer.get("success"):
            raise RuntimeError(f"update_weights_from_disk: {answer}")
        _post(self.url, "/continue_generation", {})
        loaded = time.perf_counter()
        if self.count > 2:  # keep the last two folders (the served one may be reread)
            shutil.rmtree(self.folder / f"v{self.count - 2}", ignore_errors=True)
        return {"save_s": saved - started, "load_s": loaded - saved}


class Push:
    """weightsync's whole round: SGLangEngine.push.

    A worker holds one receiver, for the trainer that connected last: each transport's engine
    connects again before its round (untimed; a trainer connects once)."""

    def __init__(self, url: str, transport: str) -> None:
        options = SenderOptions(timeout=120)
        self.engine = SGLangEngine(url, transport=transport, options=options)

    def prepare(self) -> None:
        self.engine.connect()

    def __call__(self, weights: Weights, version: int) -> dict[str, float]:
        report = self.engine.push(weights, version)
        times = report.outcomes[0].times
        assert times is not None
        # the worker's receiver: bytes into its standby copy, then SGLang's load_weights
        return {
            "push_s": report.seconds,
            "transfer_s": times.transfer_s,
            "landing_s": times.landing_s,
            "load_s": times.load_s,
        }


class ServePush:
    """A push into `weightsync serve --engine sglang`, started on `model` (its own server, at
    `url`): the server runs the round as the push arrives."""

    START_S = 600.0

    def __init__(self, model: Path, log: Path) -> None:
        command = [sys.executable, "-m", "weightsync", "serve", "--engine", "sglang", "--model", str(model)]
        command += ["--load-format", "auto", "--port", "0", "--transport", "shm", "--log-level", "warning"]
        self.child = ChildProcess(command, log_path=log)
        line = self.child.wait_for_line("weightsync serve:", self.START_S)
        if line is None:
            raise SystemExit(self.child.why_not_started("weightsync serve --engine sglang", self.START_S))
        _, _, self.url, _, address = line.split()
        self.sender = WeightSender([address], timeout=120)

    def __call__(self, weights: Weights, version: int) -> dict[str, float]:
        report = self.sender.push(weights, version)
        times = report.outcomes[0].times
        assert times is not None
        return {"push_s": report.seconds, "transfer_s": times.transfer_s, "load_s": times.load_s}

    def close(self) -> None:
        self.sender.close()
        self.child.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=0.5)
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds per method, after a warm-up")
    parser.add_argument("--bucket-mb", type=int, default=256, help="SGLang broadcast's bucket size")
    parser.add_argument("--transports", default="shm,tcp")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
        root = Path(tmp)
        total_bytes = build_model(root / "a", args.size_gb, "float32")
        weights_a = load_file(str(root / "a" / "model.safetensors"))
        generator = torch.Generator().manual_seed(1)
        weights_b = {name: t + 0.01 * torch.randn(t.shape, generator=generator) for name, t in weights_a.items()}
        shutil.copytree(root / "a", root / "b", ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(weights_b, str(root / "b" / "model.safetensors"))
        for name in ("a", "b"):
            read_through(root / name)
        (root / "disk").mkdir()
        print(f"model: {total_bytes / 2**30:.2f} GiB float32, {len(weights_a)} tensors", flush=True)

        with SGLangServer(Path(sys.prefix), root / "a") as server:
            url = server.url
            reference = {"a": _checksums(url)}
            disk = FromDisk(url, root / "a", root / "disk")
            disk(weights_b, 1)
            reference["b"] = _checksums(url)
            served = "b"
            methods: dict[str, Callable[[Weights, int], dict[str, float]]] = {}
            for transport in args.transports.split(","):
                methods[f"weightsync {transport}"] = Push(url, transport)
            serve = ServePush(root / "a", root / "serve.log")
            methods["weightsync serve, shm"] = serve
            methods["SGLang broadcast (per tensor)"] = Broadcast(url, args.bucket_mb << 20, flattened=False)
            methods["SGLang broadcast (flattened)"] = Broadcast(url, args.bucket_mb << 20, flattened=True)
            methods["SGLang from disk"] = disk
            times: dict[str, list[float]] = {name: [] for name in methods}
            parts: dict[str, list[dict[str, float]]] = {name: [] for name in methods}
            serving = {url: served, serve.url: "a"}  # what each server serves
            version = 1
            for _ in range(args.repeat + 1):
                for name, method in methods.items():
                    into = serve.url if method is serve else url
                    target = "a" if serving[into] == "b" else "b"
                    version += 1
                    if isinstance(method, Push):
                        method.prepare()
                    started = time.perf_counter()
                    extra = method(weights_a if target == "a" else weights_b, version)
                    times[name].append(time.perf_counter() - started)
                    parts[name].append(extra)
                    if _checksums(into) != reference[target]:
                        raise SystemExit(f"{name}: what SGLang serves is not checkpoint {target}")
                    serving[into] = target
                    print(f"{name}: {times[name][-1]:.3f} s {extra}", flush=True)
            for method in methods.values():
                if isinstance(method, Push):
                    method.engine.close()
            serve.close()

    results = {}
    for name, series in times.items():
        steady = series[1:]
        results[name] = {
            "first_s": series[0],
            "median_s": statistics.median(steady),
            "all_s": series,
            "gb_per_s": total_bytes / statistics.median(steady) / 1e9,
            "parts": parts[name],
        }
    broadcast = min(results[name]["median_s"] for name in results if name.startswith("SGLang broadcast"))
    print(f"\n{total_bytes / 2**30:.2f} GiB float32, TP=1, {args.repeat} rounds after a warm-up (median)")
    print(f"{'method':32} {'first s':>8} {'median s':>9} {'GB/s':>6} {'x broadcast':>12}")
    for name, result in results.items():
        ratio = result["median_s"] / broadcast
        result["ratio_to_broadcast"] = ratio
        print(f"{name:32} {result['first_s']:8.3f} {result['median_s']:9.3f} {result['gb_per_s']:6.2f} {ratio:12.2f}")
    if args.json:
        meta = {
            "size_bytes": total_bytes,
            "num_tensors": len(weights_a),
            "repeat": args.repeat,
            "bucket_mb": args.bucket_mb,
            "host": platform.node(),
            "torch": torch.__version__,
            "sglang": _version("sglang"),
        }
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


def _version(package: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(package)


if __name__ == "__main__":
    main()
