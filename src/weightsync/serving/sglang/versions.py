"""Which weight version produced each choice of an HTTP request, recorded as SGLang's outputs pass.

SGLang's OpenAI handlers call `tokenizer_manager.generate_request(...)` and turn its outputs (one
dict per choice, or a list of them) into responses; they keep the versions of the first choice
only. `record_versions` wraps the manager's `generate_request` so that every output is noted in
the `Recorder` of the HTTP request being served (serving/labels.py) before SGLang's handler
formats it:

    newest      the version of the output's newest token (`meta_info["weight_version"]`)
    spans[i]    choice i's spans over its output tokens once it finished: SGLang's own
                (`meta_info["weight_versions"]`), or one span of `weight_version` when SGLang
                recorded no change

A streamed output names its choice (`index`); a batch answers every choice at once, in order.
weightsync labels SGLang's versions itself, with its own numbers (`update_weight_version`): a
label that is not one (SGLang's "default", before the first sync) is None.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

from weightsync.serving.labels import RECORDER, Recorder, Span

__all__ = ["record_versions", "version_number"]


def version_number(label: Any) -> int | None:
    """weightsync's int version from SGLang's string label (None: not one of weightsync's)."""
    try:
        return int(label)
    except (TypeError, ValueError):
        return None


def record_versions(manager: Any) -> None:
    """Note every output of `manager.generate_request` in the HTTP request's recorder (module
    docstring): SGLang's tokenizer manager, this server's own instance."""
    generate = manager.generate_request

    @functools.wraps(generate)
    def generate_request(obj: Any, request: Any = None) -> AsyncIterator[Any]:
        outputs = generate(obj, request)
        recorder = RECORDER.get()
        return outputs if recorder is None else _follow(recorder, outputs)

    manager.generate_request = generate_request


async def _follow(recorder: Recorder, outputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
    try:
        async for output in outputs:
            for index, one in _choices(output):
                _note(recorder, index, one)
            yield output
    finally:  # a client gone or a handler failing: SGLang aborts the request when its generator closes
        aclose: Callable[[], Any] | None = getattr(outputs, "aclose", None)
        if aclose is not None:
            await aclose()


def _choices(output: Any) -> list[tuple[int, dict[str, Any]]]:
    if isinstance(output, list):
        return [(index, one) for index, one in enumerate(output) if isinstance(one, dict)]
    if isinstance(output, dict):
        return [(int(output.get("index", 0) or 0), output)]
    return []


def _note(recorder: Recorder, index: int, output: dict[str, Any]) -> None:
    meta = output.get("meta_info") or {}
    version = version_number(meta.get("weight_version"))
    if version is not None:
        recorder.newest = version
    if meta.get("finish_reason") is None:
        return
    spans = meta.get("weight_versions")
    tokens = int(meta.get("completion_tokens") or 0)
    choice: list[Span] = (
        [{"version": version_number(s["version"]), "start": int(s["start"]), "end": int(s["end"])} for s in spans]
        if spans
        else [{"version": version, "start": 0, "end": tokens}]
    )
    recorder.spans[index] = choice
    if choice and choice[-1]["version"] is not None:
        recorder.newest = choice[-1]["version"]
