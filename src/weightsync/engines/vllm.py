"""vLLM behind the Engine contract: the V1 `LLMEngine`, run in this process and stepped by the
server's loop thread; weights land through vLLM's own layerwise reload (`vllm_sink.py`).

In-process is what makes the contract hold: the engine core, its scheduler and the one worker
all live in the caller's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the "uni" executor), so
`step()` runs exactly one scheduler step on the caller's thread, and a weight sync can run while
that thread is parked, with no RPC and no second copy of any tensor.

    add_request -> LLMEngine.add_request (token ids in, DELTA outputs: only the new tokens)
    step        -> LLMEngine.step, RequestOutputs turned into StepOutputs
    weight_sink -> ReloadSink: worker.reload_weights(iterator, is_checkpoint_format=True)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

from weightsync.engines.base import Engine, LoadFormat, SamplingParams, StepOutput, check_request
from weightsync.engines.malloc import return_large_frees_to_os
from weightsync.engines.vllm_sink import ReloadSink
from weightsync.errors import ConfigError, RequestError, SinkError
from weightsync.integrations.vllm.layout import CheckpointLayout, checkpoint_layout, reprocess_tied_layers
from weightsync.sink import StagedSink, WeightSink

__all__ = ["DEFAULT_KV_CACHE_BYTES", "VLLMEngine", "config_dtype"]

log = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 1 << 30
"""KV cache the engine reserves unless told otherwise (vLLM on CPU would take most of RAM)."""

PRELOADED_MODULES = (
    "vllm.engine.arg_utils",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.model_executor.model_loader",
)
"""What building the engine imports on its way, imported by `preload` before the server listens."""


class VLLMEngine(Engine):
    """A vLLM model in this process, stepped by one thread, synced through vLLM's reload.

    Args:
        model_dir: directory with config.json (and the safetensors checkpoint for "auto").
        load_format: "dummy" (no checkpoint read; serve nothing until a sync commits) or "auto".
        dtype: the weights' dtype in vLLM; syncs must send this dtype. "auto" is the dtype
            config.json names (vLLM's own "auto" would run a float32 checkpoint in bfloat16 on
            CPU, and a push of that checkpoint would then be refused).
        max_model_len: longest prompt + completion (None: the model's own limit).
        kv_cache_bytes: memory for the KV cache (the env var VLLM_CPU_KVCACHE_SPACE, in GiB,
            overrides it on CPU).
        seed: vLLM's global seed.
        load_timeout: seconds a sync may wait on vLLM's loader (queue room, final join).
        staged: land syncs in a standby copy in host memory and reload vLLM from it at commit:
            a sync that fails in transfer never touches vLLM, and the engine keeps serving
            during the transfer (costs one more copy of the weights in host memory).
        **vllm_kwargs: more `vllm.EngineArgs` fields (e.g. `enable_prefix_caching`).
    """

    name = "vllm"

    def __init__(
        self,
        model_dir: str | Path,
        load_format: LoadFormat = "dummy",
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        seed: int = 0,
        load_timeout: float = 300.0,
        staged: bool = False,
        **vllm_kwargs: Any,
    ) -> None:
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise ConfigError(f"{model_dir} has no config.json")
        if load_format not in ("dummy", "auto"):
            raise ConfigError(f"load_format must be 'dummy' or 'auto', got {load_format!r}")
        return_large_frees_to_os()  # each reload frees a model's worth of layer temporaries
        self._llm = _build_llm_engine(
            model_dir,
            load_format=load_format,
            dtype=config_dtype(model_dir) if dtype == "auto" else dtype,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_cache_bytes,
            seed=seed,
            **vllm_kwargs,
        )
        model_config = self._llm.model_config
        self._vocab_size: int = model_config.get_vocab_size()
        self._max_model_len: int = model_config.max_model_len
        self._eos_ids = _eos_ids(model_config.hf_config, model_dir)
        self.layout: CheckpointLayout = checkpoint_layout(model_dir, model_config.dtype)
        self._requests: set[str] = set()
        self._dirty = False
        # vLLM's CPU worker plans attention for the OpenMP thread count it set at build time, and
        # checks it when the kernel runs. That count is per calling thread, and the server steps
        # from its own loop thread: each new stepping thread gets the build-time count. (vLLM
        # replaces torch.set_num_threads with a no-op after binding, hence the C entry point.)
        self._num_threads = torch.get_num_threads()
        self._threads_set_for: int | None = None
        self._loader = ReloadSink(self.layout, self._reload, self._after_reload, self._set_dirty, load_timeout)
        self._sink: WeightSink = StagedSink(self._loader) if staged else self._loader

    @classmethod
    def preload(cls, model_dir: str) -> None:
        import importlib
        import importlib.metadata

        from vllm.model_executor.models import ModelRegistry

        for name in PRELOADED_MODULES:
            importlib.import_module(name)
        importlib.metadata.entry_points()  # vLLM scans them for plugins; cached from now on
        config = json.loads((Path(model_dir) / "config.json").read_text())
        for architecture in config.get("architectures") or []:  # the model's module, as the build imports it
            model_module = getattr(ModelRegistry.models.get(architecture), "module_name", None)
            with contextlib.suppress(Exception):  # an unsupported model fails in the build, with vLLM's reason
                importlib.import_module(model_module or "")

    # --- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        if self._dirty:
            raise SinkError("the weights are incomplete after a failed sync; push a new version")
        check_request(
            prompt_token_ids,
            params,
            vocab_size=self._vocab_size,
            max_model_len=self._max_model_len,
            known=request_id in self._requests,
        )
        try:
            sampling = VLLMSamplingParams(
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                seed=params.seed,
                logprobs=params.logprobs,
                stop_token_ids=sorted(self._eos_ids | set(params.stop_token_ids)),
                detokenize=False,
                output_kind=RequestOutputKind.DELTA,
            )
            self._llm.add_request(request_id, {"prompt_token_ids": list(prompt_token_ids)}, sampling)
        except ValueError as exc:
            raise RequestError(f"vLLM refused request {request_id!r}: {exc}") from exc
        self._requests.add(request_id)

    def step(self) -> list[StepOutput]:
        if self._threads_set_for != threading.get_ident():
            torch._C.set_num_threads(self._num_threads)
            self._threads_set_for = threading.get_ident()
        if self._loader.loading:
            raise SinkError("step() called while a weight sync is loading into vLLM")
        if self._dirty:
            return self._abort_all()
        outputs = []
        for output in self._llm.step():
            if output.request_id not in self._requests:
                continue
            outputs.append(_step_output(output))
            if output.finished:
                self._requests.discard(output.request_id)
        return outputs

    def abort(self, request_id: str) -> None:
        if request_id in self._requests:
            self._requests.discard(request_id)
            self._llm.abort_request([request_id])

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def _abort_all(self) -> list[StepOutput]:
        """Weights are dirty: end every request without stepping (no token from mixed weights)."""
        ids = sorted(self._requests)
        self._requests.clear()
        if ids:
            self._llm.abort_request(ids)
        return [StepOutput(request_id, [], None, True, "abort") for request_id in ids]

    # --- weights --------------------------------------------------------------------------------

    def weight_sink(self) -> WeightSink:
        return self._sink

    def weight_bytes(self) -> int:
        """Bytes of the model's weights in vLLM's dtype. Counted from the checkpoint layout: the
        CPU backend keeps repacked linear weights outside `named_parameters()`."""
        return self.layout.total_bytes

    def parameter_bytes(self) -> int:
        """Bytes of the tensors `named_parameters()` and buffers of vLLM's model show, shared
        storages counted once (on CPU this leaves out the repacked linear weights)."""

        def count(worker: Any) -> int:
            model = worker.model_runner.get_model()
            seen: dict[int, int] = {}
            for tensor in [*model.parameters(), *model.buffers()]:
                storage = tensor.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
            return sum(seen.values())

        return int(self._on_worker(count))

    def _reload(self, weights: Any) -> None:
        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})

    def _after_reload(self) -> None:
        self._on_worker(lambda worker: reprocess_tied_layers(worker.model_runner.get_model()))
        # KV computed with the old weights must never be reused; requests kept in flight
        # across the sync ("keep" pauses) are preempted and recompute their prefix.
        self._llm.reset_prefix_cache(reset_running_requests=True)

    def _set_dirty(self, dirty: bool) -> None:
        self._dirty = dirty

    def _on_worker(self, fn: Any) -> Any:
        """Run `fn(worker)` on the (in-process) worker and return its result."""
        return self._llm.collective_rpc(fn)[0]

    def close(self) -> None:
        if self._requests:
            self._llm.abort_request(sorted(self._requests))
        self._requests.clear()
        core = getattr(self._llm, "engine_core", None)
        if core is not None:
            core.shutdown()


def _build_llm_engine(model_dir: Path, **engine_kwargs: Any) -> Any:
    """vLLM's V1 LLMEngine with its core and worker in this process."""
    # Read by vLLM when it builds its config: "0" keeps engine core and worker in-process (the
    # "uni" executor); anything else would put them in child processes this engine cannot step.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if hasattr(torch.cpu, "_init_amx"):
        # bf16 on AMX CPUs crashed with SIGILL on the first forward unless AMX tiles were
        # requested from the kernel first; a no-op elsewhere.
        torch.cpu._init_amx()
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    engine_kwargs.setdefault("enforce_eager", True)
    args = EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,  # token ids in and out: the server owns the tokenizer
        distributed_executor_backend="uni",
        disable_log_stats=True,
        **engine_kwargs,
    )
    return LLMEngine.from_engine_args(args)


def _step_output(output: Any) -> StepOutput:
    completion = output.outputs[0]
    token_ids = list(completion.token_ids)
    logprobs, tops = None, None
    if completion.logprobs is not None:
        # vLLM returns, per position, the requested top alternatives plus the sampled token.
        logprobs = [float(top[token].logprob) for token, top in zip(token_ids, completion.logprobs, strict=True)]
        tops = [{int(t): float(lp.logprob) for t, lp in top.items()} for top in completion.logprobs]
    reason = completion.finish_reason if output.finished else None
    return StepOutput(output.request_id, token_ids, logprobs, bool(output.finished), reason, tops)


def config_dtype(model_dir: Path) -> str:
    """The dtype config.json names ("dtype", or the older "torch_dtype"), else vLLM's "auto"."""
    config = json.loads((model_dir / "config.json").read_text())
    value = config.get("dtype") or config.get("torch_dtype")
    return str(value) if isinstance(value, str) else "auto"


def _eos_ids(hf_config: Any, model_dir: Path) -> frozenset[int]:
    """EOS ids from generation_config.json, else config.json (an int, a list, or None)."""
    ids: set[int] = set()
    configs = [hf_config]
    try:
        from transformers import GenerationConfig

        configs.insert(0, GenerationConfig.from_pretrained(model_dir))
    except OSError:
        pass
    for config in configs:
        value = getattr(config, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return frozenset(ids)
