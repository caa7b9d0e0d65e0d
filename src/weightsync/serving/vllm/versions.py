"""Which weight version produced each choice of an HTTP request, recorded as vLLM's outputs pass.

vLLM's OpenAI handlers call `engine_client.generate(...)` once per prompt and turn its outputs
into responses; they drop the weight version. `VersionedEngine` is the engine client handed to
vLLM's `init_app_state`: it forwards everything to `AsyncLLM`, and wraps `generate` so that each
output is noted in the `Recorder` of the HTTP request being served (serving/labels.py), before
vLLM's handler formats it:

    newest      the version of the newest token of the request (a streamed chunk's weight_version)
    spans[i]    choice i's spans {"version", "start", "end"} over its output tokens, from vLLM's
                final output (`CompletionOutput.weight_versions`)

Choice i is numbered as vLLM's completions handler numbers it: prompt p's output k is
p * n + k (chat has one prompt).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from weightsync.integrations.vllm.internals import MEMORY_SCHEME, token_version
from weightsync.serving.labels import RECORDER, Recorder

__all__ = ["LoraUse", "VersionedEngine", "follow", "memory_adapter", "version_number"]


def version_number(label: str | None) -> int | None:
    """weightsync's int version from vLLM's string label (None: vLLM's "default", never set)."""
    if label is None:
        return None
    try:
        return int(label)
    except ValueError:
        return None


def memory_adapter(lora_request: Any) -> tuple[int, int] | None:
    """(version, LoRA id) of a LoRA adapter weightsync holds in memory, from the `lora_request`
    vLLM's handler passes to `generate` (its path: weightsync://NAME/VERSION/ID); None for any other."""
    path = str(getattr(lora_request, "lora_path", "") or "")
    if not path.startswith(MEMORY_SCHEME):
        return None
    parts = path.removeprefix(MEMORY_SCHEME).split("/")
    if len(parts) != 3 or not (parts[1].isdigit() and parts[2].isdigit()):
        return None
    return int(parts[1]), int(parts[2])


class LoraUse:
    """How many requests run on each LoRA adapter held in memory, by LoRA id: an adapter
    version leaves vLLM (and the workers' memory) only once none does."""

    def __init__(self) -> None:
        self._running: dict[int, int] = {}

    def busy(self, lora_id: int) -> bool:
        return self._running.get(lora_id, 0) > 0

    async def follow(self, lora_id: int, outputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """Yield `outputs`, counting the request as running on `lora_id` meanwhile."""
        self._running[lora_id] = self._running.get(lora_id, 0) + 1
        try:
            async for output in outputs:
                yield output
        finally:
            left = self._running.pop(lora_id) - 1
            if left:
                self._running[lora_id] = left
            aclose = getattr(outputs, "aclose", None)
            if aclose is not None:
                await aclose()


async def follow(
    recorder: Recorder, outputs: AsyncIterator[Any], engine: Any, ordinal: int, n: int, delta: bool
) -> AsyncIterator[Any]:
    """Yield vLLM's `outputs` for the `ordinal`-th prompt of a request unchanged, noting each
    one's versions in `recorder` first."""
    counts: dict[int, int] = {}
    try:
        async for output in outputs:
            for completion in output.outputs:
                _note(recorder, engine, output.request_id, ordinal * n, completion, counts, delta)
            yield output
    finally:  # a client gone or a handler failing: vLLM aborts the request when its generator closes
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:
            await aclose()


def _note(
    recorder: Recorder, engine: Any, request_id: str, first: int, completion: Any, counts: dict[int, int], delta: bool
) -> None:
    index = completion.index
    count = counts.get(index, 0) + len(completion.token_ids) if delta else len(completion.token_ids)
    counts[index] = count
    spans = completion.weight_versions
    if spans is not None:  # the final output: vLLM's own spans
        choice: list[dict[str, int | None]] = [
            {"version": version_number(s.version), "start": s.start, "end": s.end} for s in spans
        ]
        recorder.spans[first + index] = choice
        if choice:
            recorder.newest = choice[-1]["version"]
    elif count:
        label = token_version(engine, request_id, index, count - 1)
        if label is not None:
            recorder.newest = version_number(label)


class VersionedEngine:
    """`AsyncLLM` as vLLM's handlers see it, with `generate` noting versions in the request's
    recorder. Every other attribute is the engine's own."""

    def __init__(self, engine: Any, loras: LoraUse) -> None:
        self._engine = engine
        self._loras = loras

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any) -> AsyncIterator[Any]:
        from vllm.sampling_params import RequestOutputKind

        outputs = self._engine.generate(prompt, sampling_params, request_id, **kwargs)
        adapter = memory_adapter(kwargs.get("lora_request"))
        if adapter is not None:
            outputs = self._loras.follow(adapter[1], outputs)
        recorder = RECORDER.get()
        if recorder is None:
            return outputs
        recorder.adapter_version = None if adapter is None else adapter[0]
        delta = sampling_params.output_kind == RequestOutputKind.DELTA
        return follow(recorder, outputs, self._engine, recorder.next_call(), sampling_params.n or 1, delta)
