"""LoRA adapter benchmark: from the trainer's push to the first response served with the new
adapter, against the path users take today (save the adapter to disk, then have the engine load
it), on the same server, with the same adapter, in one run.

    python benchmarks/bench_lora.py --json lora.json            # hf, and vllm where installed
    python benchmarks/bench_lora.py --engine vllm --size-gb 1 --rank 16

For a Qwen2-shaped model of about `--size-gb` (saved with random weights) and a PEFT LoRA adapter
of `--rank` on every linear layer, each round changes the adapter's values (a training step) and
times, back to back:
- weightsync: `push(tensors, version, adapter=...)` over shm into `weightsync serve
  --max-lora-rank R`, then one request naming the adapter (1 token); its response must carry the
  new version;
- vLLM's path from disk: `save_pretrained` into a fresh folder, `POST /v1/load_lora_adapter` under
  a new name (what TRL does every step), then the same request naming that name, on the same vLLM
  server (`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`); the previous disk adapter is unloaded after the
  round, untimed;
- PEFT's path from disk (hf): `save_pretrained`, then `load_adapter` and `set_adapter` into a
  PEFT model over the same base in this process, then one generated token. It runs in the
  trainer's process, with no HTTP and no process boundary: the cheapest form this path can take.

Both paths answer the same first token (checked and reported). The first round is reported apart
from the median of the others (steady state).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from weightsync import WeightSender, adapter_from_peft
from weightsync_bench.saved_model import PROMPT, build_model
from weightsync_bench.served import Served

NAME = "bench"


class Server(Served):
    """`weightsync serve --max-lora-rank R` on the saved model, in its own process."""

    def __init__(self, model: Path, engine: str, rank: int, timeout: float) -> None:
        extra = ["--load-format", "auto", "--max-lora-rank", str(rank), "--log-level", "warning"]
        super().__init__(model, engine, timeout, extra, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
        self.wait_healthy(timeout)
        self.addresses: list[str] = self.client.get("/weight_info").json()["addresses"]

    def first_token(self, model: str) -> tuple[int, Any]:
        """One greedy token from the adapter served as `model`: (token id, weight_version)."""
        body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
        response = self.client.post("/v1/completions", json=body)
        response.raise_for_status()
        answer = response.json()
        return answer["choices"][0]["token_ids"][0], answer.get("weight_version")


def new_adapter(model_dir: Path, rank: int) -> Any:
    """The trainer's PEFT model: the saved base under a LoRA adapter on every linear layer, with
    random (non-zero) B, so that it changes what the model answers."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(base, config)


def train_step(model: Any) -> None:
    """A stand-in for an optimizer step: every LoRA tensor moves a little."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_" in name:
                parameter.add_(torch.randn_like(parameter) * parameter.std() * 0.1)


def push_to_served(server: Server, sender: WeightSender, trainer: Any, version: int) -> dict[str, Any]:
    started = time.perf_counter()
    tensors, adapter = adapter_from_peft(trainer, NAME)
    report = sender.push(tensors, version, adapter=adapter)
    pushed = time.perf_counter()
    token, served_version = server.first_token(NAME)
    if served_version != version:
        raise RuntimeError(f"the first response after pushing version {version} came from {served_version}")
    return {
        "seconds": time.perf_counter() - started,
        "push_seconds": pushed - started,
        "first_response_seconds": time.perf_counter() - pushed,
        "adapter_bytes": report.total_bytes,
        "token": token,
    }


def vllm_from_disk(server: Server, trainer: Any, folder: Path, version: int) -> dict[str, Any]:
    name = f"{NAME}-disk-v{version}"
    started = time.perf_counter()
    trainer.save_pretrained(folder)
    saved = time.perf_counter()
    server.client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)}).raise_for_status()
    loaded = time.perf_counter()
    token, _ = server.first_token(name)
    done = time.perf_counter()
    server.client.post("/v1/unload_lora_adapter", json={"lora_name": name}).raise_for_status()  # untimed
    return {
        "seconds": done - started,
        "save_seconds": saved - started,
        "load_seconds": loaded - saved,
        "first_response_seconds": done - loaded,
        "token": token,
    }


class PeftFromDisk:
    """PEFT's `load_adapter` into a model over the same base, in this process."""

    def __init__(self, model_dir: Path, trainer: Any, folder: Path) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        trainer.save_pretrained(folder)
        base = AutoModelForCausalLM.from_pretrained(model_dir)
        self.model = PeftModel.from_pretrained(base, folder, adapter_name="start").eval()

    def __call__(self, trainer: Any, folder: Path, version: int) -> dict[str, Any]:
        name = f"v{version}"
        started = time.perf_counter()
        trainer.save_pretrained(folder)
        saved = time.perf_counter()
        self.model.load_adapter(folder, adapter_name=name)
        self.model.set_adapter(name)
        loaded = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=torch.tensor([PROMPT]), max_new_tokens=1, do_sample=False)
        done = time.perf_counter()
        self.model.delete_adapter(f"v{version - 1}" if version > 1 else "start")  # untimed
        return {
            "seconds": done - started,
            "save_seconds": saved - started,
            "load_seconds": loaded - saved,
            "first_response_seconds": done - loaded,
            "token": int(out[0, -1]),
        }


def run_engine(engine: str, model_dir: Path, rank: int, rounds: int, timeout: float, work: Path) -> dict[str, Any]:
    trainer = new_adapter(model_dir, rank)
    server = Server(model_dir, engine, rank, timeout)
    peft_path = PeftFromDisk(model_dir, trainer, work / "start") if engine == "hf" else None
    rows: list[dict[str, Any]] = []
    try:
        with WeightSender(server.addresses, timeout=timeout) as sender:
            for version in range(1, rounds + 1):
                train_step(trainer)
                ours = push_to_served(server, sender, trainer, version)
                folder = work / f"{engine}-v{version}"
                if peft_path is not None:
                    theirs = peft_path(trainer, folder, version)
                else:
                    theirs = vllm_from_disk(server, trainer, folder, version)
                shutil.rmtree(folder, ignore_errors=True)
                rows.append({"version": version, "weightsync": ours, "from_disk": theirs})
                print(
                    f"  {engine} round {version}: push -> served {ours['seconds'] * 1e3:.1f} ms, "
                    f"save -> load -> served {theirs['seconds'] * 1e3:.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        server.close()
    return {"engine": engine, "rounds": rows} | summarize(rows)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def median(path: str, key: str) -> float:
        return statistics.median(row[path][key] for row in rows[1:] or rows)

    ours, theirs = median("weightsync", "seconds"), median("from_disk", "seconds")
    disk_sync = statistics.median(
        row["from_disk"]["save_seconds"] + row["from_disk"]["load_seconds"] for row in rows[1:] or rows
    )
    return {
        "adapter_bytes": rows[0]["weightsync"]["adapter_bytes"],
        "first_weightsync_seconds": rows[0]["weightsync"]["seconds"],
        "first_from_disk_seconds": rows[0]["from_disk"]["seconds"],
        "weightsync_seconds": ours,
        "weightsync_push_seconds": median("weightsync", "push_seconds"),
        "from_disk_seconds": theirs,
        "from_disk_save_seconds": median("from_disk", "save_seconds"),
        "from_disk_load_seconds": median("from_disk", "load_seconds"),
        "ratio": ours / theirs,
        "sync_ratio": median("weightsync", "push_seconds") / disk_sync,
        "weightsync_first_response_seconds": median("weightsync", "first_response_seconds"),
        "from_disk_first_response_seconds": median("from_disk", "first_response_seconds"),
        "same_first_token": all(row["weightsync"]["token"] == row["from_disk"]["token"] for row in rows),
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"LoRA rank {result['rank']} on every linear layer of a {result['model_bytes'] / 2**30:.2f} GiB "
        f"{result['dtype']} model; {result['rounds']} rounds; steady state = median of rounds 2..N",
        "| engine | adapter MiB | weightsync push -> served ms (first / steady) | from disk: save + load + "
        "served ms (first / steady) | ratio (steady) | steady: push vs save + load ms | steady: first response ms "
        "(weightsync / from disk) | same token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["engines"]:
        lines.append(
            f"| {r['engine']} | {r['adapter_bytes'] / 2**20:.1f} | {r['first_weightsync_seconds'] * 1e3:.1f} / "
            f"{r['weightsync_seconds'] * 1e3:.1f} | {r['first_from_disk_seconds'] * 1e3:.1f} / "
            f"{r['from_disk_seconds'] * 1e3:.1f} | {r['ratio']:.2f}x | {r['weightsync_push_seconds'] * 1e3:.1f} vs "
            f"{r['from_disk_save_seconds'] * 1e3:.1f} + {r['from_disk_load_seconds'] * 1e3:.1f} "
            f"({r['sync_ratio']:.2f}x) | {r['weightsync_first_response_seconds'] * 1e3:.1f} / "
            f"{r['from_disk_first_response_seconds'] * 1e3:.1f} | {r['same_first_token']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    vllm = importlib.util.find_spec("vllm") is not None
    parser.add_argument(
        "--engine", default="hf,vllm" if vllm else "hf", help="comma list (default hf, and vllm where installed)"
    )
    parser.add_argument("--size-gb", type=float, default=0.25, help="base model size in GiB (default 0.25)")
    parser.add_argument("--dtype", default="float32", help="the model's dtype (default float32)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16; vLLM takes 1, 8, 16, 32, 64, ...)")
    parser.add_argument("--rounds", type=int, default=10, help="adapter versions pushed per engine (default 10)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any step may take")
    parser.add_argument("--json", type=Path, help="also write the result as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the server has the other core
    with tempfile.TemporaryDirectory(prefix="weightsync-bench-lora-") as tmp:
        work = Path(tmp)
        model_bytes = build_model(work / "model", args.size_gb, args.dtype)
        engines = [
            run_engine(engine, work / "model", args.rank, args.rounds, args.timeout, work)
            for engine in args.engine.split(",")
        ]
    result = {
        "rank": args.rank,
        "model_bytes": model_bytes,
        "dtype": args.dtype,
        "rounds": args.rounds,
        "engines": engines,
    }
    print(table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
