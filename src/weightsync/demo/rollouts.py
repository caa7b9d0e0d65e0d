"""Where the demo's samples come from: rollout engines, never the trainer's own model.

`LocalRollouts` (colocated): an engine in the trainer's process; weights arrive through the
`inproc` transport into the engine's own tensors. `ServerFleet` (disaggregated): N
`weightsync serve` processes, pushed to as one `ServerGroup`; prompts are spread over the live
ones, a server that stops answering or fails a push is dropped (and restarted, if asked), and a
restarted server gets the current weights before it serves: it starts on dummy weights and its
gate holds requests until a push commits. Both push with `push(tensors, version, adapter, base)`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

from weightsync.auth import resolve_token
from weightsync.client import ServerGroup
from weightsync.errors import ResourceError
from weightsync.messages import Adapter
from weightsync.options import Delta
from weightsync.receiver import WeightReceiver
from weightsync.report import SyncReport
from weightsync.sender import WeightSender
from weightsync.serving.hf.base import SamplingParams
from weightsync.serving.process import ChildProcess

__all__ = ["STARTUP_TIMEOUT_S", "FleetOptions", "LocalRollouts", "Sample", "ServerFleet"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """One completion, with what GRPO needs and the weight version that produced it (the oldest,
    should a keep-mode sync have landed mid-completion: a sample is as stale as its oldest token)."""

    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    weight_version: int


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """`group` samples of each prompt, seeded so that a run can be repeated."""

    prompts: list[list[int]]
    group: int
    max_tokens: int
    temperature: float
    seed: int
    """Sample k of prompt i is drawn with seed + i x group + k: each sample of a request has a seed
    of its own (`new_request` keeps those of different steps apart too)."""
    adapter: str | None = None
    """The LoRA adapter to generate with, by name (its newest version), or None for the base."""


class LocalRollouts:
    """An hf engine in this process, synced through `inproc` (colocated / hybrid mode)."""

    def __init__(
        self,
        model_dir: Path,
        timeout: float,
        max_lora_rank: int = 0,
        delta: Delta = False,
        cast: torch.dtype | None = None,
    ) -> None:
        from weightsync.serving.hf.engine import HFEngine

        self.engine = HFEngine(model_dir, load_format="dummy", max_lora_rank=max_lora_rank)
        self.receiver = WeightReceiver(self.engine.weight_sink(), transport="inproc", timeout=timeout).start()
        # each push's report is read by the loop (`receivers_committed`): a failure is a record, not an end
        address = [self.receiver.address]
        self._sender = WeightSender(address, timeout=timeout, delta=delta, cast=cast, raise_on_failure=False)
        self.events: list[str] = []

    def push(self, tensors: Any, version: int, adapter: Adapter | None = None, base: Any = None) -> SyncReport:
        """Push `tensors` into the engine (`base` is for servers that join a fleet: none here)."""
        return self._sender.push(tensors, version, adapter=adapter)

    def generate(self, request: Request) -> list[Sample]:
        version = self.receiver.version
        if version is None:
            raise RuntimeError("no weights pushed yet")
        samples: dict[str, tuple[int, list[int], list[int], list[float]]] = {}
        versions: dict[str, int] = {}
        for index, prompt in enumerate(request.prompts):
            for k in range(request.group):
                request_id = f"{index}-{k}"
                params = SamplingParams(
                    max_tokens=request.max_tokens,
                    temperature=request.temperature,
                    seed=request.seed + index * request.group + k,
                    logprobs=0,
                    adapter=request.adapter,
                )
                self.engine.add_request(request_id, prompt, params)
                samples[request_id] = (index, prompt, [], [])
        while self.engine.has_unfinished():
            for output in self.engine.step():
                _, _, tokens, logprobs = samples[output.request_id]
                tokens += output.new_token_ids
                logprobs += output.new_logprobs or []
                if output.adapter_version is not None:  # a request naming an adapter: its version
                    versions[output.request_id] = output.adapter_version
        return [Sample(i, p, t, lp, versions.get(key, version)) for key, (i, p, t, lp) in samples.items()]

    def check_alive(self) -> None:
        """One process: nothing can die on its own."""

    def close(self) -> None:
        self._sender.close()
        self.receiver.close()
        self.engine.close()


PROGRESS_S = 15.0
"""Seconds between the lines that say a rollout server is still starting."""

STARTUP_TIMEOUT_S = {"hf": 300.0, "vllm": 600.0, "sglang": 600.0}
"""Seconds a rollout server may take to start, by engine, unless told otherwise. Measured on the
2-core dev machine under load (1-10): one vLLM server alone took 54-90 s, two at once longer;
hf about 10 s idle. Generous: a slow start is not a failure, a server that never starts is."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FleetOptions:
    """How a `ServerFleet` starts its servers."""

    startup_timeout: float
    """Seconds each server may take to start (imports, engine, warm-up)."""
    max_lora_rank: int = 0
    """The servers serve LoRA adapters up to this rank (0: none)."""
    log_dir: Path | None = None
    """Where each server's stderr goes (`server-<index>.log`); None: onto this process's stderr."""


class _Server:
    """One `weightsync serve` process, tied to this one (it stops when we do, however we end);
    its stderr goes to `log_dir/server-<index>.log`."""

    ANNOUNCEMENT = "weightsync serve: http://"

    def __init__(self, index: int, model_dir: Path, engine: str, timeout: float, options: FleetOptions) -> None:
        self.index = index
        self.timeout = timeout
        self.startup_timeout = options.startup_timeout
        command = [sys.executable, "-m", "weightsync", "serve", "--engine", engine, "--model", str(model_dir)]
        command += ["--port", "0", "--load-format", "dummy", "--ready-timeout", str(timeout), "--log-level", "warning"]
        if options.max_lora_rank:
            command += ["--max-lora-rank", str(options.max_lora_rank)]
        env = {"PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning"}  # vLLM's, not ours
        cores = sorted(os.sched_getaffinity(0))  # the cores this process may use, not all the host's
        if engine == "vllm":  # each server's worker on a core of its own (vLLM's "auto" puts all on one)
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[index % len(cores)])
        if engine == "sglang":  # the same for SGLang's CPU path (its default binds a whole NUMA node)
            env["SGLANG_CPU_OMP_THREADS_BIND"] = str(cores[index % len(cores)])
        log_path = None if options.log_dir is None else options.log_dir / f"server-{index}.log"
        self.child = ChildProcess(command, env=env | os.environ | {"OMP_NUM_THREADS": "1"}, log_path=log_path)
        self.started = time.monotonic()
        self.url = ""
        self.client: httpx.Client | None = None

    def wait_ready(self) -> None:
        """Wait for the server's announcement (its URL), up to `startup_timeout` seconds from
        its start; every `PROGRESS_S` of them, a line (logged) says it is still starting.

        Raises:
            ResourceError: it exited or did not announce itself within the start-up timeout:
                one line with the flag that waits longer and how its log ends.
        """
        if self.client is not None:
            return
        ends = self.started + self.startup_timeout
        line = None
        while line is None and self.child.alive() and (left := ends - time.monotonic()) > 0:
            line = self.child.wait_for_line(self.ANNOUNCEMENT, min(PROGRESS_S, left))
            if line is None and self.child.alive() and time.monotonic() < ends:
                log.info(
                    "rollout server %d still starting after %.0f s (at most %.0f s: --startup-timeout)",
                    self.index,
                    time.monotonic() - self.started,
                    self.startup_timeout,
                )
        if line is None:
            raise ResourceError(
                self.child.why_not_started(f"rollout server {self.index}", self.startup_timeout, "--startup-timeout")
            )
        self.url = line.split()[2]
        token = resolve_token(None)  # the servers inherit $WEIGHTSYNC_AUTH_TOKEN, if set
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(base_url=self.url, timeout=self.timeout, headers=headers)

    def complete(self, request: Request, prompts: list[tuple[int, list[int]]]) -> list[Sample]:
        """`request.group` samples of each of `prompts` ((index, token ids) pairs), one request
        per prompt, all at once. One request for several prompts would not do: the servers (as
        vLLM's) seed sample k of every prompt of a request with its seed + k, so its prompts
        would all be sampled with the same random numbers."""
        client = self.client
        if client is None:
            raise ResourceError(f"rollout server {self.index} has not started")
        with ThreadPoolExecutor(len(prompts), thread_name_prefix="weightsync-demo-request") as pool:
            per_prompt = list(pool.map(lambda pair: complete_one(client, request, *pair), prompts))
        return [sample for samples in per_prompt for sample in samples]

    def alive(self) -> bool:
        return self.child.alive()

    def kill(self) -> None:
        self.child.kill()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        self.child.close()


def complete_one(client: httpx.Client, request: Request, index: int, prompt: list[int]) -> list[Sample]:
    """`request.group` samples of prompt `index` from the server `client` talks to."""
    body = {
        "prompt": [prompt],
        "n": request.group,
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "seed": request.seed + index * request.group,  # sample k: + k (Request.seed)
        "logprobs": 0,
        "return_token_ids": True,  # vLLM's server lists token ids only when asked; weightsync's hf server always does
    }
    if request.adapter is not None:
        body["model"] = request.adapter  # the adapter's newest version, for the whole request
    response = client.post("/v1/completions", json=body)
    response.raise_for_status()
    samples = []
    for choice in response.json()["choices"]:
        logprobs = choice["logprobs"]["token_logprobs"]
        version = min((span["version"] for span in choice["weight_versions"]), default=choice["weight_version"])
        samples.append(Sample(index, prompt, choice["token_ids"], logprobs, version))
    return samples


class ServerFleet:
    """N rollout servers in their own processes (disaggregated mode).

    Args:
        model_dir: the policy's directory (config.json and tokenizer; no weights are read).
        size: servers to start.
        engine: "hf", "vllm" or "sglang".
        timeout: seconds any request or push may take.
        options: how the servers start (their start-up timeout, LoRA rank, logs; default: the
            engine's `STARTUP_TIMEOUT_S`, no LoRA, logs on stderr).
        restart: start a replacement for a server that died (it rejoins after the next push).
        delta: `WeightSender`'s `delta` for the pushes.
        cast: the dtype every push casts to (None: as the policy holds it).
    """

    def __init__(
        self,
        model_dir: Path,
        size: int,
        engine: str,
        timeout: float,
        options: FleetOptions | None = None,
        restart: bool = True,
        delta: Delta = False,
        cast: torch.dtype | None = None,
    ) -> None:
        self._model_dir, self._engine, self._timeout, self._restart = model_dir, engine, timeout, restart
        self._options = options or FleetOptions(startup_timeout=STARTUP_TIMEOUT_S[engine])
        # each push's report is read: a server that failed it is dropped, the run goes on
        self._group = ServerGroup(timeout=timeout, delta=delta, cast=cast, raise_on_failure=False)
        self._lock = threading.RLock()  # generation (a background thread) and pushes both drop servers
        self._closed = False
        self.joining: list[_Server] = []
        """Restarted servers: they get the current weights at the next push, then serve."""
        self.events: list[str] = []
        self.servers: list[_Server] = []
        try:
            for index in range(size):  # every server starts at once; then wait for each
                self.servers.append(_Server(index, model_dir, engine, timeout, self._options))
            for server in self.servers:
                server.wait_ready()
        except BaseException:
            self.close()
            raise

    def push(self, tensors: Any, version: int, adapter: Adapter | None = None, base: Any = None) -> SyncReport:
        """Push `tensors` as `version` (of `adapter`, if given) to every server, restarted ones
        included once they are up; under an adapter, `base` (the weights it sits on) goes to
        those first, as version 0. A server that does not commit is dropped (and restarted).
        """
        newcomers = self._join_newcomers()
        if newcomers and base is not None:  # a server that fails it fails the adapter too
            self._group.push(base, 0, to=newcomers)
        report = self._group.push(tensors, version, adapter=adapter)
        self._settle(version)
        return report

    def _join_newcomers(self) -> list[str]:
        """Add the servers the group does not push to yet (every one at the first push, then
        restarted ones) once they are up; returns their URLs."""
        with self._lock:
            live = {client.base_url for client in self._group.live}
            newcomers = [server for server in self.servers + self.joining if server.url not in live]
        for server in newcomers:  # outside the lock: a start-up wait must not hold up close()
            server.wait_ready()
        infos, _ = self._group.join(server.url for server in newcomers)
        return list(infos)

    def _settle(self, version: int) -> None:
        """After a push: drop the servers that left the group, and move restarted servers that
        committed it into the fleet."""
        with self._lock:
            live = {client.base_url for client in self._group.live}
            for server in list(self.servers):
                if server.url not in live:
                    self.drop(server, f"failed the push of version {version}")
            for server in list(self.joining):
                if server.url in live:
                    self.joining.remove(server)
                    self.servers.append(server)
                    self.events.append(f"server {server.index} rejoined with the current weights")

    def generate(self, request: Request) -> list[Sample]:
        """Spread the prompts over the live servers; a server that fails is dropped and its
        prompts go to the others."""
        todo = list(enumerate(request.prompts))
        samples: list[Sample] = []
        while todo:
            with self._lock:
                if self._closed:
                    raise ResourceError("the rollout servers were stopped")
                live = [server for server in self.servers if server.alive()]
            if not live:
                raise ResourceError("every rollout server is down")
            shares = [todo[i :: len(live)] for i in range(len(live))]
            with ThreadPoolExecutor(len(live)) as pool:
                results = list(
                    pool.map(lambda pair: self._try(pair[0], request, pair[1]), zip(live, shares, strict=True))
                )
            todo = []
            for server, share, result in zip(live, shares, results, strict=True):
                if result is None:
                    self.drop(server, "stopped answering")
                    todo += share
                else:
                    samples += result
        return samples

    def _try(self, server: _Server, request: Request, share: list[tuple[int, list[int]]]) -> list[Sample] | None:
        if not share:
            return []
        try:
            return server.complete(request, share)
        except httpx.HTTPError as exc:
            if not self._closed:  # stopping the fleet fails requests in flight: not news
                log.warning("rollout server %d failed: %s", server.index, exc)
            return None

    def drop(self, server: _Server, why: str) -> None:
        """Take `server` out of the fleet; start a replacement if restarting is on."""
        with self._lock:
            if self._closed or server not in self.servers:
                return
            self.servers.remove(server)
            self._group.drop(server.url, why)
            server.close()
            self.events.append(f"server {server.index} {why}; continuing on {len(self.servers)}")
            if self._restart:
                replacement = _Server(server.index, self._model_dir, self._engine, self._timeout, self._options)
                self.joining.append(replacement)
                self.events.append(f"server {server.index} restarted; it serves after the next push")

    def check_alive(self) -> None:
        with self._lock:
            for server in list(self.servers):
                if not server.alive():
                    self.drop(server, "died")

    def kill(self, index: int) -> None:
        """SIGKILL one server (to show the loop survives it)."""
        for server in self.servers:
            if server.index == index:
                server.kill()
                self.events.append(f"server {index} killed (SIGKILL)")

    def __iter__(self) -> Iterator[_Server]:
        with self._lock:
            return iter(list(self.servers))

    def close(self) -> None:
        """Stop every server (each waits at most `STOP_TIMEOUT_S`, then is killed)."""
        with self._lock:
            self._closed = True
            servers = self.servers + self.joining
        for server in servers:  # all at once, then reap each
            server.child.stop()
        for server in servers:
            server.close()
        self._group.close()
