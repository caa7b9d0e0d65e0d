"""A small client for one rollout server (httpx): health, weight info, completions, pause.

Every failure to get a weightsync answer is a `ServerError`: an error status (`status` is it),
or no answer from a weightsync server at all (`status` 0: no connection, a timeout, a body that
is not a JSON object).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from weightsync.auth import resolve_token
from weightsync.errors import ConfigError, ServerError

__all__ = ["RolloutClient", "ServerError"]

STARTING_POLL_S = 0.5
"""How often `wait_until_up` asks a server that is starting."""
REFUSED_GRACE_S = 10.0
"""How long `wait_until_up` retries a port that refuses connections: a server process binds its
port within seconds of starting (before its engine loads), so a port still closed after this is
no server at all."""


class RolloutClient:
    """Talks to one server at `base_url` (e.g. "http://127.0.0.1:8000").

    Args:
        base_url: the server's URL.
        timeout: seconds for each HTTP call.
        auth_token: the server's token (default $WEIGHTSYNC_AUTH_TOKEN), sent as a Bearer header.
    """

    def __init__(self, base_url: str, timeout: float = 60.0, auth_token: str | None = None) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"server URL must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        token = resolve_token(auth_token)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers)

    def health(self) -> dict[str, Any]:
        """The /health body; 503 is not an error here (it carries the reason)."""
        response = self._request("GET", "/health")
        if response.status_code not in (200, 503):
            raise ServerError(response.status_code, self._body(response, "/health", allow_text=True))
        return self._body(response, "/health")

    def weight_info(self) -> dict[str, Any]:
        info = self._call("GET", "/weight_info")
        if not {"version", "addresses", "content_digest", "last_sync"} <= info.keys():
            raise ServerError(0, f"{self.base_url}/weight_info is not a weightsync rollout server's answer")
        return info

    def wait_until_up(self, timeout: float, waiting: Callable[[str], None] | None = None) -> dict[str, Any]:
        """The server's /weight_info once it is up. A server that answers 503 (it is starting, its
        engine loads) is asked again every half second for up to `timeout` seconds, and a port
        that refuses connections (a server process that has not bound it yet) for up to
        `REFUSED_GRACE_S` of them; `waiting(why)` hears once what it is waiting for.

        Raises:
            ServerError: any other answer at once; else the last answer once the wait is over.
        """
        started = time.monotonic()
        ends = started + timeout
        told = False
        while True:
            try:
                return self.weight_info()
            except ServerError as exc:
                refused = exc.status == 0 and isinstance(exc.__cause__, httpx.ConnectError)
                if not (exc.status == 503 or refused):
                    raise
                now = time.monotonic()
                if now >= ends or (refused and now >= started + REFUSED_GRACE_S):
                    raise ServerError(exc.status, f"not up after {now - started:.0f} s: {exc}") from exc
                if waiting is not None and not told:
                    waiting(str(exc))
                    told = True
                time.sleep(max(0.0, min(STARTING_POLL_S, ends - time.monotonic())))

    def models(self) -> dict[str, Any]:
        """GET /v1/models: the served model, and the LoRA adapters it serves."""
        return self._call("GET", "/v1/models")

    def completions(self, prompt: Any, **fields: Any) -> dict[str, Any]:
        """POST /v1/completions; each choice lists its token ids (vLLM's server only when asked)."""
        return self._call("POST", "/v1/completions", json={"prompt": prompt, "return_token_ids": True, **fields})

    def pause(self, mode: str = "wait", timeout: float = 60.0) -> dict[str, Any]:
        return self._call("POST", "/pause", params={"mode": mode, "timeout": timeout})

    def resume(self) -> dict[str, Any]:
        return self._call("POST", "/resume")

    def metrics(self) -> str:
        response = self._request("GET", "/metrics")
        if response.status_code >= 400:
            raise ServerError(response.status_code, self._body(response, "/metrics", allow_text=True))
        return response.text

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = self._request(method, path, **kwargs)
        if response.status_code >= 400:
            raise ServerError(response.status_code, self._body(response, path, allow_text=True))
        return self._body(response, path)

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ServerError(0, f"{method} {self.base_url}{path} failed: {exc}") from exc

    def _body(self, response: httpx.Response, path: str, allow_text: bool = False) -> Any:
        """The response's JSON object; a body that is not one means no weightsync server answered."""
        try:
            body = response.json()
        except ValueError:  # json.JSONDecodeError, or bytes that are not text
            body = None
        if isinstance(body, dict):
            return body
        if allow_text:  # an error status from a proxy or another service: say what it said
            return " ".join(response.text.split())[:200] or response.reason_phrase
        raise ServerError(
            0,
            f"{self.base_url}{path} answered HTTP {response.status_code} without a JSON object: is it a weightsync server?",
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
