"""The one place weightsync reaches into vLLM's internals: the weight version of streamed tokens.

vLLM labels every batch of outputs with the engine's weight version and records, per request,
where each version's tokens start (`RequestState.weight_version_starts` in
`vllm/v1/engine/output_processor.py`). Its public API hands the spans out only on a request's
final output (`CompletionOutput.weight_versions`), and its OpenAI responses not at all. A
streamed chunk needs the version of its newest token before the request ends, which only that
per-request record holds. Everything else weightsync does with vLLM goes through public entry
points (build_app, init_app_state, AsyncLLM, worker_extension_cls, collective_rpc).

`tests/integrations/vllm/test_internals_guard.py` fails loudly when an upgrade moves any of this:
`TESTED_VLLM` is the release it was checked against.
"""

from __future__ import annotations

from typing import Any

from weightsync.errors import ConfigError

__all__ = ["TESTED_VLLM", "token_version"]

TESTED_VLLM = "0.32."
"""The vLLM release line these attribute paths were read from."""


def token_version(engine: Any, request_id: str, index: int, position: int) -> str | None:
    """The weight version that produced output token `position` of choice `index` of the
    request `request_id` (the id given to `AsyncLLM.generate`), while the request runs; None when
    vLLM holds no record of it (finished, or no token labelled yet).

    Raises:
        ConfigError: the installed vLLM keeps its per-request records elsewhere (an upgrade past
            `TESTED_VLLM`): re-check this module against it.
    """
    try:
        processor = engine.output_processor
        internal_ids = processor.external_req_ids.get(request_id, ())
        states = processor.request_states
    except AttributeError as exc:
        raise ConfigError(f"vLLM's output processor changed ({exc}); see {__name__}") from exc
    for internal_id in list(internal_ids):
        state = states.get(internal_id)
        if state is None:
            continue
        try:
            if state.request_index != index:
                continue
            starts: list[tuple[str, int]] = list(state.weight_version_starts)
        except AttributeError as exc:
            raise ConfigError(f"vLLM's RequestState changed ({exc}); see {__name__}") from exc
        version = None
        for label, start in starts:
            if start <= position:
                version = label
        return version
    return None
