"""A transformers causal LM behind the StepEngine contract: simple, exact, and CPU-friendly.

Each request keeps its own KV cache and advances one token per `step()`. It is the reference
engine: greedy outputs equal `model.generate`, and the weights live in the model's own tensors,
which the sink writes in place (the server holds no second copy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
from pathlib import Path
from typing import Any

import torch

from weightsync.errors import ConfigError, RequestError
from weightsync.hf_checkpoint import checkpoint_views
from weightsync.lora import AdapterVersion
from weightsync.serving.config import LoadFormat
from weightsync.serving.hf.base import SamplingParams, StepEngine, StepOutput, check_request
from weightsync.serving.hf.lora import LoraServing
from weightsync.serving.hf.sink import InPlaceModelSink

__all__ = ["HFEngine", "build_model"]

log = logging.getLogger(__name__)


def build_model(model_dir: str | Path, load_format: LoadFormat = "dummy") -> Any:
    """The causal LM of `model_dir`: from the checkpoint ("auto"), or from config.json with
    uninitialised weights ("dummy": no checkpoint read, no random init, ties kept)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"{model_dir} has no config.json")
    if load_format == "auto":
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    else:
        config = AutoConfig.from_pretrained(model_dir)
        dtype = getattr(config, "dtype", None) or torch.float32
        with no_init_weights():  # torch.empty only: pages stay untouched until a sync writes them
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.tie_weights()  # from_config leaves ties to loading, which dummy skips
    return model.eval().requires_grad_(False)


@dataclasses.dataclass(slots=True)
class _Request:
    request_id: str
    params: SamplingParams
    next_input: torch.Tensor  # the prompt before the first step, then the last token
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    adapter: AdapterVersion | None
    cache: Any = None
    num_generated: int = 0


class HFEngine(StepEngine):
    """A transformers causal LM stepped token by token, one KV cache per request.

    Args:
        model_dir: directory with config.json (and the safetensors checkpoint for "auto").
        load_format: "dummy" (serve nothing until a sync commits) or "auto".
        staged: land syncs in a standby copy of the weights and swap it in at commit, so a
            failed sync never touches the served weights (costs one more copy in memory).
        max_lora_rank: serve LoRA adapters pushed to it (through PEFT, in memory), of rank up
            to this; 0 refuses them.
        lora_versions: versions of each adapter kept resident (a request runs to its end on
            the version it started with, even when older).
    """

    name = "hf"

    def __init__(
        self,
        model_dir: str | Path,
        load_format: LoadFormat = "dummy",
        staged: bool = False,
        *,
        max_lora_rank: int = 0,
        lora_versions: int = 2,
    ) -> None:
        self.model = build_model(model_dir, load_format)
        self._eos_ids = _eos_ids(self.model)
        self._vocab_size = self.model.get_input_embeddings().num_embeddings
        # transformers 5.24 takes and returns the KV cache as `cache` (`past_key_values` warns
        # there, deprecated); 5.19 as `past_key_values` only
        self._cache = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.max_model_len: int = getattr(self.model.config, "max_position_embeddings", None) or 2048
        """Longest prompt + completion: the model's context (its max_position_embeddings)."""
        self._requests: dict[str, _Request] = {}
        # the base weights' names, taken before any adapter wraps a layer (PEFT renames them)
        # under the checkpoint's names, as a sync carries them (one tensor per expert: sink.py)
        views = functools.partial(checkpoint_views, self.model)
        self._sink = InPlaceModelSink(self.model.state_dict(keep_vars=True), staged=staged, views=views)
        self._lora: LoraServing | None = None
        if max_lora_rank:
            self._lora = LoraServing(self.model, keep=lora_versions, max_rank=max_lora_rank)
            self._sink.serve_adapters(self._lora.sink)

    @classmethod
    def preload(cls, model_dir: str) -> None:
        from transformers import AutoConfig
        from transformers.initialization import no_init_weights  # noqa: F401
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        config = AutoConfig.from_pretrained(model_dir)
        with contextlib.suppress(KeyError, ValueError):  # an unknown model fails in the build, with its reason
            MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # imports the model's modeling module

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_request(
            prompt_token_ids,
            params,
            vocab_size=self._vocab_size,
            max_model_len=self.max_model_len,
            known=request_id in self._requests,
        )
        generator = None
        if params.temperature > 0:
            generator = torch.Generator()
            if params.seed is not None:
                generator.manual_seed(params.seed)
            else:
                generator.seed()
        adapter = None if params.adapter is None else self._lora_serving().pin(params.adapter)
        self._requests[request_id] = _Request(
            request_id,
            params,
            torch.tensor([prompt_token_ids], dtype=torch.long),
            generator,
            self._eos_ids | frozenset(params.stop_token_ids),
            adapter,
        )

    def step(self) -> list[StepOutput]:
        return [self._advance(request) for request in list(self._requests.values())]

    @torch.inference_mode()
    def _advance(self, request: _Request) -> StepOutput:
        adapter = request.adapter
        if self._lora is not None:
            self._lora.activate(None if adapter is None else adapter.engine_id)
        out = self.model(input_ids=request.next_input, use_cache=True, **{self._cache: request.cache})
        request.cache = out[self._cache]
        logits = out.logits[0, -1].float()
        token = _sample(logits, request.params.temperature, request.generator)
        logprob, top = None, None
        if request.params.logprobs is not None:
            logprobs = torch.log_softmax(logits, dim=-1)
            logprob = logprobs[token].item()
            if request.params.logprobs > 0:
                values, ids = logprobs.topk(min(request.params.logprobs, logprobs.numel()))
                top = dict(zip(ids.tolist(), values.tolist(), strict=True)) | {token: logprob}
        request.num_generated += 1
        request.next_input = torch.tensor([[token]], dtype=torch.long)
        reason = None
        if token in request.stop_ids:
            reason = "stop"
        elif request.num_generated >= request.params.max_tokens:
            reason = "length"
        if reason is not None:
            self._drop(request.request_id)
        return StepOutput(
            request.request_id,
            [token],
            None if logprob is None else [logprob],
            reason is not None,
            reason,
            None if top is None else [top],
            None if adapter is None else adapter.version,
        )

    def abort(self, request_id: str) -> None:
        self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is not None and request.adapter is not None:
            self._lora_serving().release(request.adapter.engine_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def weight_sink(self) -> InPlaceModelSink:
        return self._sink

    def weight_bytes(self) -> int:
        seen: dict[int, int] = {}
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    @property
    def lora(self) -> LoraServing | None:
        return self._lora

    def _lora_serving(self) -> LoraServing:
        if self._lora is None:
            raise RequestError("this server serves no LoRA adapters (start it with --max-lora-rank N)")
        return self._lora

    def close(self) -> None:
        for request_id in list(self._requests):
            self._drop(request_id)


def _sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature <= 0 or generator is None:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _eos_ids(model: Any) -> frozenset[int]:
    """EOS ids from the generation config, else the model config (an int, a list, or None)."""
    ids: set[int] = set()
    for config in (getattr(model, "generation_config", None), model.config):
        value = getattr(config, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return frozenset(ids)
