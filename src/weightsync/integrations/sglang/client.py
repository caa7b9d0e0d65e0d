"""SGLang's HTTP routes that a weightsync round calls, each with a timeout; any failure is a
`ServerError` (the HTTP status, or 0 when no answer came).

Checked against SGLang 0.5.23 (docs/integrations/sglang.md): the update routes answer
`{"success": bool, "message": str}`, with HTTP 400 when `success` is false.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

import httpx

from weightsync.errors import ServerError

__all__ = ["PauseMode", "SGLangClient"]

PauseMode: TypeAlias = Literal["abort", "retract", "in_place"]
"""SGLang's `/pause_generation` modes: abort the requests running (they return what they have),
retract them to the queue (they run again on the new weights), or hold them where they are
(they go on with the KV cache the old weights made)."""


class SGLangClient:
    """One SGLang server's control routes.

    Args:
        url: the server, e.g. "http://127.0.0.1:30000".
        timeout: seconds any call may take, unless the call says otherwise.
        api_key: SGLang's `--api-key` (or `--admin-api-key`), sent as a bearer token.
    """

    def __init__(self, url: str, *, timeout: float, api_key: str | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def server_info(self) -> dict[str, Any]:
        return self._call("GET", "/server_info")

    def weight_version(self) -> str | None:
        version = self._call("GET", "/model_info").get("weight_version")
        return None if version is None else str(version)

    def pause(self, mode: PauseMode) -> None:
        self._call("POST", "/pause_generation", {"mode": mode})

    def resume(self) -> None:
        self._call("POST", "/continue_generation", {})

    def begin_update(self) -> None:
        self._update("/begin_weight_update", {"selector": "all"})

    def end_update(self) -> None:
        self._update("/end_weight_update", {})

    def end_stale_update(self) -> bool:
        """End an update session left open (by a trainer that died inside a round); whether one was."""
        return self._call("POST", "/end_weight_update", {}, ok=(200, 400)).get("success") is True

    def update_from_tensor(
        self, payload: list[str], *, load_format: str, flush_cache: bool, timeout: float | None = None
    ) -> None:
        """SGLang's `update_weights_from_tensor` with no weight version: weightsync labels a
        version only once it landed everywhere (`label`)."""
        body = {"serialized_named_tensors": payload, "load_format": load_format, "flush_cache": flush_cache}
        self._update("/update_weights_from_tensor", body, timeout)

    def label(self, version: str) -> None:
        """Name the weights served `version` (requests running are not aborted: generation is paused)."""
        self._call("POST", "/update_weight_version", {"new_version": version, "abort_all_requests": False})

    def close(self) -> None:
        self._http.close()

    def _update(self, path: str, body: dict[str, Any], timeout: float | None = None) -> None:
        answer = self._call("POST", path, body, timeout)
        if answer.get("success") is False:
            raise ServerError(400, f"{path}: {answer.get('message')}")

    def _call(
        self, method: str, path: str, body: Any = None, timeout: float | None = None, ok: tuple[int, ...] = (200,)
    ) -> dict[str, Any]:
        try:
            response = self._http.request(method, path, json=body, timeout=timeout or self.timeout)
        except httpx.HTTPError as exc:
            raise ServerError(0, f"SGLang at {self.url}{path}: {type(exc).__name__}: {exc}") from exc
        try:
            answer = response.json()
        except ValueError:
            answer = response.text
        if response.status_code not in ok:
            message = answer.get("message", answer) if isinstance(answer, dict) else answer
            raise ServerError(response.status_code, f"SGLang {path}: {message}")
        return answer if isinstance(answer, dict) else {"answer": answer}
