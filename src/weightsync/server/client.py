"""A small client for one rollout server (httpx): health, weight info, completions, pause."""

from __future__ import annotations

from typing import Any

import httpx

from weightsync.auth import resolve_token
from weightsync.errors import ConfigError, WeightSyncError

__all__ = ["RolloutClient", "ServerError"]


class ServerError(WeightSyncError):
    """The server answered with an error status; `status` and `body` say what it said."""

    def __init__(self, status: int, body: Any) -> None:
        message = body.get("error", {}).get("message") if isinstance(body, dict) and "error" in body else body
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.body = body


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
        body: dict[str, Any] = self._http.get("/health").json()
        return body

    def weight_info(self) -> dict[str, Any]:
        return self._call("GET", "/weight_info")

    def completions(self, prompt: Any, **fields: Any) -> dict[str, Any]:
        return self._call("POST", "/v1/completions", json={"prompt": prompt, **fields})

    def pause(self, mode: str = "wait", timeout: float = 60.0) -> dict[str, Any]:
        return self._call("POST", "/pause", params={"mode": mode, "timeout": timeout})

    def resume(self) -> dict[str, Any]:
        return self._call("POST", "/resume")

    def metrics(self) -> str:
        response = self._http.get("/metrics")
        response.raise_for_status()
        return response.text

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ServerError(0, f"{method} {self.base_url}{path} failed: {exc}") from exc
        body: dict[str, Any] = response.json()
        if response.status_code >= 400:
            raise ServerError(response.status_code, body)
        return body

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
