"""Clients of rollout servers (httpx): `RolloutClient` talks to one (health, weight info,
completions, pause); `ServerGroup` pushes to several through one `WeightSender`.

Every failure to get a weightsync answer is a `ServerError`: an error status (`status` is it),
or no answer from a weightsync server at all (`status` 0: no connection, a timeout, a body that
is not a JSON object).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

import httpx

from weightsync.auth import resolve_token
from weightsync.errors import ConfigError, ResourceError, ServerError, SyncFailed, one_line
from weightsync.messages import Adapter
from weightsync.options import SenderOptions, build_options
from weightsync.report import SyncReport
from weightsync.sender import WeightSender

__all__ = ["RolloutClient", "ServerError", "ServerGroup", "Waiting"]

log = logging.getLogger(__name__)

STARTING_POLL_S = 0.5
"""How often `wait_until_up` asks a server that is starting."""


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
        """The server's /weight_info once it is up. A server that answers 503 (its engine loads)
        or whose port refuses connections (its process has not bound it yet: on a busy host its
        imports alone take 8-40 s) is asked again every half second, for the whole `timeout`;
        `waiting(why)` hears once what it is waiting for.

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
                if now >= ends:
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
        if allow_text and not _is_html(response):  # an error from a proxy or another service: what it said
            return " ".join(response.text.split())[:200] or response.reason_phrase
        if allow_text:  # a web page (another service's 404): its markup would say nothing
            return f"{self.base_url}{path} answered HTTP {response.status_code} with a web page: is it a weightsync server?"
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


def _is_html(response: httpx.Response) -> bool:
    """Whether `response` is a web page (by its type, or by its first character)."""
    return "html" in response.headers.get("content-type", "") or response.text.lstrip().startswith("<")


Waiting = Callable[[str, float, str], None]
"""Hears once of each server `ServerGroup.join` waits for: its URL, the seconds it will wait at
most, and why (the server's answer so far)."""


class ServerGroup:
    """Rollout servers, and one `WeightSender` to all their receivers.

    `join` asks each server's /weight_info for its receiver addresses, waiting for servers that
    are starting. `push` sends to every live server through one sender, built at the first push
    and kept while the live servers stay the same (a shared-memory ring or a collective group is
    reused), rebuilt once they change. A server any of whose receivers did not commit a push, or
    that a caller `drop`s (it failed a request), leaves `live`, and `failed` says why.

        group = ServerGroup(timeout=60.0, verify="bucket")
        up, not_up = group.join(["http://127.0.0.1:8000", "http://127.0.0.1:8001"])
        report = group.push(ModuleSource(model), 1)

    Args:
        options: the pushes' `WeightSender` options. Their `timeout` also bounds each HTTP call
            and `join`'s whole wait, and their `auth_token` goes to the servers too. With
            `raise_on_failure` (the default), `push` raises `SyncFailed` once the servers that
            failed it have left `live`.
        **kwargs: the same options as keyword arguments (not both).
    """

    def __init__(self, options: SenderOptions | None = None, **kwargs: Any) -> None:
        self.options = build_options(SenderOptions, options, kwargs)
        self.clients: list[RolloutClient] = []
        """A client for every server `join` was asked for (up or not, live or dropped), until `close`."""
        self.live: list[RolloutClient] = []
        """The servers that committed every push since they joined and were never dropped: the
        ones to push to and to send requests to."""
        self.failed: dict[str, str] = {}
        """Each server (base URL) that left `live`, and why, on one line."""
        self._addresses: dict[str, list[str]] = {}
        self._sender: WeightSender | None = None
        self._lock = threading.Lock()  # requests on several threads drop servers
        self._closed = False

    @property
    def timeout(self) -> float:
        """Seconds any single wait may last (the options' `timeout`)."""
        return self.options.timeout

    def join(
        self, urls: Iterable[str], waiting: Waiting | None = None
    ) -> tuple[dict[str, dict[str, Any]], dict[str, ServerError]]:
        """Add the servers at `urls` to `live` once they are up, with the receivers their
        /weight_info lists; a server already in the group is asked again (one restarted on the
        same URL listens on new addresses). Servers that are starting are waited for,
        `timeout` seconds in all (`RolloutClient.wait_until_up`).

        Returns:
            Each server's /weight_info, by base URL, and the error of each that gave none.

        Raises:
            ConfigError: a URL that is not http(s)://, before any server is asked.
        """
        clients = self._clients(urls)
        ends = time.monotonic() + self.timeout
        infos: dict[str, dict[str, Any]] = {}
        errors: dict[str, ServerError] = {}
        for client in clients:
            wait_s = max(0.0, ends - time.monotonic())
            heard = None if waiting is None else functools.partial(waiting, client.base_url, wait_s)
            try:
                infos[client.base_url] = client.wait_until_up(wait_s, heard)
            except ServerError as exc:
                errors[client.base_url] = exc
                continue
            self._admit(client, infos[client.base_url]["addresses"])
        return infos, errors

    def push(
        self, tensors: Any, version: int, *, adapter: Adapter | None = None, to: Collection[str] | None = None
    ) -> SyncReport:
        """Push `tensors` (a `WeightSource`, a module's `ModuleSource`, a state dict) as `version`
        (of LoRA `adapter`, if given) to every live server; a server that did not commit leaves
        `live`.

        Args:
            tensors: what to send.
            version: the weight version it becomes.
            adapter: the LoRA adapter `tensors` are, or None for base weights.
            to: only these live servers (base URLs), through a sender of their own that is
                closed after the push (a server that joins late catches up this way).

        Raises:
            ResourceError: the group is closed, or no live server is left to push to.
            SyncFailed: a server did not commit (with the options' `raise_on_failure`).
        """
        if self._closed:
            raise ResourceError("the rollout servers' sender is closed")
        servers = [client for client in list(self.live) if to is None or client.base_url in to]
        addresses = [address for client in servers for address in self._addresses[client.base_url]]
        if not addresses:
            raise ResourceError(f"no rollout server left to push version {version} to")
        if to is None:
            report = self._sender_for(addresses).push(tensors, version, adapter=adapter)
        else:
            with WeightSender(addresses, options=self._reporting()) as sender:
                report = sender.push(tensors, version, adapter=adapter)
        self._drop_failed(servers, report)
        if self.options.raise_on_failure and not report.ok:
            raise SyncFailed(report.failure(), report)
        return report

    def drop(self, url: str, why: str) -> None:
        """Send the server at `url` no more pushes or requests (a warning says why); it stays
        in `clients` until `close`, and `join` takes it back."""
        with self._lock:
            client = next((c for c in self.live if c.base_url == url.rstrip("/")), None)
            if client is None:
                return
            self.live.remove(client)
            self.failed[client.base_url] = why
        log.warning("rollout server %s %s; this group sends it nothing more until it joins again", client.base_url, why)

    def close(self) -> None:
        """Close the sender and every server's client; the servers themselves keep running."""
        self._closed = True
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        for client in self.clients:
            client.close()

    def __enter__(self) -> ServerGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _clients(self, urls: Iterable[str]) -> list[RolloutClient]:
        """A client for each distinct URL: the group's own where it has one, else a new one."""
        urls = list(dict.fromkeys(url.rstrip("/") for url in urls))
        known = {client.base_url: client for client in self.clients}
        made: list[RolloutClient] = []
        try:
            for url in urls:
                if url not in known:
                    made.append(RolloutClient(url, timeout=self.timeout, auth_token=self.options.auth_token))
        except ConfigError:
            for client in made:
                client.close()
            raise
        self.clients += made
        known.update((client.base_url, client) for client in made)
        return [known[url] for url in urls]

    def _admit(self, client: RolloutClient, addresses: list[str]) -> None:
        with self._lock:
            self._addresses[client.base_url] = list(addresses)
            self.failed.pop(client.base_url, None)
            if client not in self.live:
                self.live.append(client)

    def _reporting(self) -> SenderOptions:
        """The options with `raise_on_failure` off: `push` reads each report before it raises."""
        return dataclasses.replace(self.options, raise_on_failure=False)

    def _sender_for(self, addresses: list[str]) -> WeightSender:
        """The shared sender, rebuilt when the live servers' addresses changed."""
        if self._sender is None or self._sender.addresses != addresses:
            if self._sender is not None:
                self._sender.close()
            self._sender = WeightSender(addresses, options=self._reporting())
        return self._sender

    def _drop_failed(self, servers: list[RolloutClient], report: SyncReport) -> None:
        failed = {outcome.address: outcome for outcome in report.failed}
        for client in servers:
            missed = [failed[a] for a in self._addresses[client.base_url] if a in failed]
            if missed:
                why = "; ".join(dict.fromkeys(f"{o.kind}: {one_line(o.error)}" for o in missed))  # each once
                self.drop(client.base_url, f"did not commit version {report.version} ({why})")
