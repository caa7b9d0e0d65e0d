"""A fleet of rollout servers as Ray actors, and one `push` to all of them.

    trainer --push(source, v)--> RolloutFleet --ServerGroup--> server actors (one per GPU/node)
                                      |                               ^
                                      +-- describe/ping each push ----+

Each actor is a whole rollout server (engine, weight receiver, HTTP API) in its own process,
placed by Ray. Before every push the fleet asks each actor who it is: one that died is dropped
and reported; one that Ray restarted (a new process) counts as a new member. The members are
pushed to as one `ServerGroup` (client.py), which learns their receivers over HTTP. New members start
on dummy weights and are ready only once they hold the fleet's version: the next `push`
brings them there, or `catch_up` does at once when the trainer still holds that version.

What the servers run is one `ServeConfig`, what the trainer pushes with one `SenderOptions`, and
where Ray puts each server one `Placement`: the fleet takes them as they are.

Needs `pip install -e '.[ray]'` (from a weightsync checkout); Ray is imported only when a fleet is built.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from weightsync.client import ServerGroup
from weightsync.errors import ConfigError, ResourceError, SyncFailed, WeightSyncError, one_line
from weightsync.options import SenderOptions
from weightsync.report import SyncReport
from weightsync.serving.config import ServeConfig

__all__ = ["FleetReport", "Placement", "RolloutFleet", "ServerActor", "ServerInfo"]

log = logging.getLogger(__name__)

NODE_IP = "node"
"""`host` value for a fleet spread over several machines: each server listens on its node's IP."""


class ServerActor:
    """One rollout server in a Ray actor's process (the class Ray instantiates remotely).

    Args:
        serve: what the server runs. Its `host` is this actor's listening address, its
            receiver's too; "node" means the node's IP.
    """

    def __init__(self, serve: ServeConfig) -> None:
        from weightsync.serving.background import BackgroundServer

        host = serve.host
        if host == NODE_IP:
            import ray

            host = ray.util.get_node_ip_address()
        receiver = dataclasses.replace(serve.receiver, host=host)
        self._server = BackgroundServer(dataclasses.replace(serve, host=host, receiver=receiver))

    def describe(self) -> dict[str, Any]:
        """Who this server is right now: its URLs, process and weight version."""
        info = self._server.weight_info()
        return {
            "url": self._server.url,
            "addresses": self._server.addresses,
            "pid": os.getpid(),
            "version": info["version"],
            "state": info["state"],
            "content_digest": info["content_digest"],
        }

    def stop(self) -> None:
        self._server.close()


@dataclasses.dataclass(slots=True)
class ServerInfo:
    """A fleet member as the trainer sees it."""

    name: str
    url: str
    addresses: tuple[str, ...]
    """Its receivers (one per vLLM worker; one for hf): a push reaches all of them."""
    pid: int
    version: int | None
    """The version it holds intact, as of the last push or describe."""
    ready: bool = False
    """True when it holds the fleet's current version (and so should get rollouts)."""


@dataclasses.dataclass(frozen=True, slots=True)
class FleetReport:
    """What one fleet push did."""

    sync: SyncReport
    dropped: dict[str, str]
    """Servers found dead before or during the push, name -> why; they are gone from the fleet."""
    joined: tuple[str, ...]
    """Servers this push reached for the first time (new, or restarted by Ray)."""
    dropped_addresses: frozenset[str] = frozenset()
    """The weight addresses of servers that died during the push (their outcomes failed)."""

    @property
    def ok(self) -> bool:
        """Every live member committed (dropped servers are reported, not failures)."""
        return all(o.committed or o.address in self.dropped_addresses for o in self.sync.outcomes)

    def summary(self) -> str:
        """The push on one line: `SyncReport.summary`, then the servers dropped (and why) and the
        ones that joined."""
        line = self.sync.summary()
        if self.dropped:
            line += "; dropped: " + ", ".join(f"{name} ({one_line(why)})" for name, why in self.dropped.items())
        if self.joined:
            line += "; joined: " + ", ".join(self.joined)
        return line


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """What each server of a fleet reserves from Ray, and where Ray puts it.

    Attributes:
        num_cpus, num_gpus, resources: Ray's reservation per server (e.g. num_gpus=1 for one
            server per GPU, or a custom per-node resource for one per node).
        scheduling_strategy: Ray's placement for the actors ("SPREAD": across nodes).
        max_restarts: how often Ray restarts a server that dies; a restarted one rejoins.
    """

    num_cpus: float = 1
    num_gpus: float = 0
    resources: Mapping[str, float] = dataclasses.field(default_factory=dict)
    scheduling_strategy: Any = "SPREAD"
    max_restarts: int = 0

    def actor_options(self) -> dict[str, Any]:
        options = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        # While Ray restarts a server, calls to it wait for the new process instead of failing,
        # so a restarting server is re-learned, not dropped.
        return options | {"resources": dict(self.resources), "max_task_retries": -1 if self.max_restarts else 0}


class RolloutFleet:
    """Start `num_servers` rollout servers as Ray actors and push weights to all of them.

    Args:
        serve: what every server runs. Its model directory must be at that path on every node
            (and on the trainer's, where `serve` is checked); its transport "tcp" or
            "collective" for a fleet across nodes ("shm" on one node only); its `host`
            "127.0.0.1" (one node) or "node" (each server on its node's IP, which needs an auth
            token: SECURITY.md). Its `auth_token` (resolved in the trainer's environment: actors
            do not see it) is handed to each actor through Ray, and is the pushes' too.
        num_servers: servers to start now; `add` starts more later.
        sender: how the fleet pushes (default: verify "bucket", this `timeout`). With
            `raise_on_failure=False`, `push` and `catch_up` return their report when a live
            server did not commit, instead of raising `SyncFailed`.
        placement: what each server reserves from Ray and where Ray puts it.
        timeout: seconds the fleet waits for a server's start or a describe.
    """

    def __init__(
        self,
        serve: ServeConfig,
        num_servers: int,
        *,
        sender: SenderOptions | None = None,
        placement: Placement | None = None,
        timeout: float = 120.0,
    ) -> None:
        import ray

        if not ray.is_initialized():
            raise ConfigError("Ray is not initialised: call ray.init() (or ray.init(address=...)) first")
        if not isinstance(serve, ServeConfig):
            raise ConfigError(f"serve must be a ServeConfig, got {serve!r}")
        if not isinstance(num_servers, int) or num_servers < 0:
            raise ConfigError(f"num_servers must be a non-negative integer, got {num_servers!r}")
        self._serve = serve
        self._actor_class = ray.remote(ServerActor).options(**(placement or Placement()).actor_options())
        options = sender or SenderOptions(timeout=timeout, verify="bucket")
        self._raise_on_failure = options.raise_on_failure
        # the fleet reads every report first (who committed, who died), then raises if asked to
        self._group = ServerGroup(dataclasses.replace(options, raise_on_failure=False, auth_token=serve.auth_token))
        self._timeout = timeout
        self._actors: dict[str, Any] = {}
        self._members: dict[str, ServerInfo] = {}
        self._digests: dict[int, str] = {}
        self._count = 0
        self._synced: set[tuple[str, int]] = set()
        """(name, pid) of every server incarnation a push or catch-up has reached."""
        self._lock = threading.Lock()
        self.version: int | None = None
        """The version the last push committed somewhere; ready servers hold it."""
        self.add(num_servers)

    # --- membership -----------------------------------------------------------------------

    def add(self, num_servers: int = 1) -> list[str]:
        """Start more servers; they are ready once they hold the fleet's version (`catch_up`,
        or the next `push`). Returns their names."""
        import ray

        names = [f"server-{self._count + i}" for i in range(num_servers)]
        self._count += num_servers
        actors = {name: self._actor_class.remote(self._serve) for name in names}
        described = self._describe(actors)
        for name in names:
            if name in described:
                self._actors[name] = actors[name]
                self._members[name] = described[name]
            else:
                ray.kill(actors[name])  # type: ignore[arg-type]  # ray's stubs: .remote() may be a class
        failed = [name for name in names if name not in described]
        if failed:
            raise ResourceError(f"servers {failed} did not start within {self._timeout} s (see the Ray logs)")
        return names

    def remove(self, name: str) -> None:
        """Stop one server and drop it from the fleet."""
        import ray

        actor = self._actors.pop(name)
        self._members.pop(name, None)
        try:
            ray.get(actor.stop.remote(), timeout=self._timeout)
        except Exception as exc:  # already dead, or stuck: kill it either way
            log.info("stopping %s: %s", name, exc)
        ray.kill(actor)

    def servers(self) -> list[ServerInfo]:
        """Every member, in start order."""
        return list(self._members.values())

    def ready_urls(self) -> list[str]:
        """URLs of the servers that hold the fleet's current version: where rollouts go."""
        return [info.url for info in self._members.values() if info.ready]

    def actor(self, name: str) -> Any:
        """The Ray actor handle of server `name` (e.g. to kill it in a drill)."""
        return self._actors[name]

    # --- syncs ----------------------------------------------------------------------------

    def push(self, source: Any, version: int) -> FleetReport:
        """Push `source` as `version` to every live server; dead ones are dropped first.

        Returns:
            A FleetReport: `report.sync` per server, `report.dropped`, `report.joined`. Every
            live server committed, unless the fleet's sender options say
            `raise_on_failure=False` (then `report.ok` says whether they did).

        Raises:
            SyncFailed: a server that is still alive did not commit (one that died, before or
                during the push, is dropped and reported, not raised); `.report` is the
                FleetReport, and the fleet's bookkeeping is done.
        """
        with self._lock:
            dropped, joined = self._refresh()
            members = list(self._members.values())
            report = self._group.push(source, version)
            self._record(members, report)
            if any(outcome.committed for outcome in report.outcomes):
                self.version = version
                if report.content_digest:
                    self._digests[version] = report.content_digest
            died = self._drop_dead_among(report)
            self._mark_ready()
            addresses = frozenset(a for info in members if info.name in died for a in info.addresses)
            return self._checked(FleetReport(report, dropped | died, joined, addresses))

    def _checked(self, report: FleetReport) -> FleetReport:
        if self._raise_on_failure and not report.ok:
            live = [o for o in report.sync.outcomes if o.address not in report.dropped_addresses]
            raise SyncFailed(dataclasses.replace(report.sync, outcomes=tuple(live)).failure(), report)
        return report

    def _drop_dead_among(self, report: SyncReport) -> dict[str, str]:
        """Servers whose push failed because they died meanwhile (killed between the check before
        the push and the push itself): dropped like those found dead before it."""
        failed = {outcome.address for outcome in report.failed}
        suspects = {
            name: self._actors[name] for name, info in self._members.items() if failed.intersection(info.addresses)
        }
        if not suspects:
            return {}
        alive = self._describe(suspects)
        died = {name: "died during the push" for name in suspects if name not in alive}
        for name, why in died.items():
            self._drop(name, why)
        return died

    def _drop(self, name: str, why: str) -> None:
        """Kill member `name` (a hung one must not linger half in the fleet) and forget it."""
        import ray

        ray.kill(self._actors.pop(name))
        self._members.pop(name, None)
        log.warning("fleet: dropped %s: %s", name, why)

    def catch_up(self, source: Any) -> FleetReport | None:
        """Bring every live server that lacks the fleet's version to it, from `source`, which
        must hold that version's weights (the trainer's, unchanged since that push). Raises
        `SyncFailed` as `push` does.

        With verify on (the default), the content digest of what was sent is checked against the
        one recorded at the push: a source that moved on is refused, and the servers it reached
        are not marked ready. Returns None when nobody was behind.
        """
        with self._lock:
            if self.version is None:
                raise ConfigError("the fleet has no version yet: push first")
            dropped, joined = self._refresh()
            behind = [info for info in self._members.values() if info.version != self.version]
            if not behind:
                return None
            report = self._group.push(source, self.version, to=[info.url for info in behind])
            self._record(behind, report)
            expected = self._digests.get(self.version, "")
            if expected and report.content_digest and report.content_digest != expected:
                for info in behind:
                    info.version = None  # holds bytes labelled with our version that are not it
                self._mark_ready()
                raise WeightSyncError(
                    f"catch_up: the source's content ({report.content_digest}) is not version {self.version} "
                    f"as pushed ({expected}); the servers it reached are not ready"
                )
            self._mark_ready()
            return self._checked(FleetReport(report, dropped, joined))

    def _refresh(self) -> tuple[dict[str, str], tuple[str, ...]]:
        """Describe every member: drop the dead, re-learn the restarted (new process)."""
        described = self._describe(self._actors)
        dropped: dict[str, str] = {}
        joined = []
        for name in list(self._actors):
            info = described.get(name)
            if info is None:
                dropped[name] = f"did not answer within {self._timeout} s (the actor or its node died)"
                self._drop(name, dropped[name])
                continue
            if (name, info.pid) not in self._synced:
                joined.append(name)  # new, or restarted by Ray (a new process that holds nothing)
            self._members[name] = info
        self._regroup(joined)
        return dropped, tuple(joined)

    def _regroup(self, joined: list[str]) -> None:
        """Push to the members as they are now: servers gone (or on a new URL) leave the group;
        new and restarted members, and live ones that failed a push, join it again."""
        urls = [info.url for info in self._members.values()]
        for client in list(self._group.live):
            if client.base_url not in urls:
                self._group.drop(client.base_url, "left the fleet")
        live = {client.base_url for client in self._group.live}
        restarted = {self._members[name].url for name in joined}
        _, errors = self._group.join(url for url in urls if url not in live or url in restarted)
        for url, exc in errors.items():
            log.warning("fleet: %s gave no weight info (%s): not pushed to, not ready", url, exc)

    def _describe(self, actors: Mapping[str, Any]) -> dict[str, ServerInfo]:
        """ServerInfo of every actor that answers within the timeout."""
        import ray

        refs = {name: actor.describe.remote() for name, actor in actors.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self._timeout)
        done = set(ready)
        described = {}
        for name, ref in refs.items():
            if ref not in done:
                continue
            try:
                info = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                log.info("fleet: %s is gone: %s", name, exc)
                continue
            described[name] = ServerInfo(name, info["url"], tuple(info["addresses"]), info["pid"], info["version"])
        return described

    def _record(self, members: list[ServerInfo], report: SyncReport) -> None:
        by_address = {outcome.address: outcome for outcome in report.outcomes}
        self._synced.update((info.name, info.pid) for info in members)
        for info in members:
            outcomes = [by_address.get(address) for address in info.addresses]
            if all(outcome is not None and outcome.committed for outcome in outcomes):
                info.version = report.version

    def _mark_ready(self) -> None:
        for info in self._members.values():
            info.ready = self.version is not None and info.version == self.version

    def close(self) -> None:
        """Stop every server and release the sender."""
        self._group.close()
        for name in list(self._actors):
            self.remove(name)

    def __enter__(self) -> RolloutFleet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
