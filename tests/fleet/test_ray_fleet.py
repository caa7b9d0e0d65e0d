"""A real local Ray cluster (CPU only): a fleet of rollout servers as actors, pushes of several
versions checked against the trainer's own greedy output on every server, a server killed
mid-fleet (reported, dropped, the next sync succeeds on the rest), a server that joins late and
serves the current version once caught up, a server Ray restarts that rejoins on the next push,
and a catch-up from a source that moved on, refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import WAIT_S, wait_until
from tests.models import save_model
from weightsync import SenderOptions, SyncFailed, WeightSyncError
from weightsync.client import RolloutClient, ServerError
from weightsync.serving.config import ServeConfig

ray = pytest.importorskip("ray")
fleet_module = pytest.importorskip("weightsync.cluster.ray_fleet")
RolloutFleet = fleet_module.RolloutFleet
Placement = fleet_module.Placement

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8], [40, 41, 42]]

START_S = 180
"""How long a fleet waits for a server actor to start and describe itself: a fresh Ray worker
imports torch and transformers, over 60 s on a loaded 2-core host."""
SENDER = SenderOptions(timeout=60, verify="bucket")
"""How the fleet pushes: the fleet's default options with the timeout these tests always used."""


@pytest.fixture(scope="module")
def cluster():  # type: ignore[no-untyped-def]
    """A local Ray cluster for this module: 4 logical CPUs (one per server), no dashboard."""
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The trainer's model and the directory its servers start from (config + tokenizer)."""
    from transformers import AutoModelForCausalLM

    path: Path = tmp_path_factory.mktemp("fleet") / "qwen2"
    save_model("qwen2", path)
    return AutoModelForCausalLM.from_pretrained(path).eval(), path


def step(model: torch.nn.Module, seed: int) -> None:
    """A stand-in for an optimizer step: every parameter moves, deterministically."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * 0.05)


def expected_tokens(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    return out[0, len(prompt) :].tolist()  # type: ignore[no-any-return]


def assert_serves(urls: list[str], model: torch.nn.Module, version: int, token: str | None = None) -> None:
    """Every server at `urls` answers like the trainer's model, labelled `version`."""
    assert urls
    for url in urls:
        with RolloutClient(url, timeout=WAIT_S * 3, auth_token=token) as client:
            for prompt in PROMPTS:
                body = client.completions(prompt, max_tokens=8, temperature=0)
                assert body["weight_version"] == version, url
                assert body["choices"][0]["token_ids"] == expected_tokens(model, prompt), url


@pytest.mark.parametrize("transport", ["collective", "tcp"])
def test_fleet_pushes_survives_a_dead_server_and_takes_a_new_one(cluster, policy, transport):
    model, path = policy
    with RolloutFleet(
        ServeConfig(model=str(path), transport=transport, ready_timeout=0.5), 2, sender=SENDER, timeout=START_S
    ) as fleet:
        assert len(fleet.servers()) == 2 and fleet.ready_urls() == [], "dummy weights: nobody is ready"
        with RolloutClient(fleet.servers()[0].url, timeout=WAIT_S) as client, pytest.raises(ServerError) as gated:
            client.completions([5, 6], max_tokens=2, temperature=0)
        assert gated.value.status == 503

        for version in (1, 2, 3):
            step(model, seed=version)
            report = fleet.push(model.state_dict(), version)
            assert report.ok, report.sync.failed
            assert report.joined == (("server-0", "server-1") if version == 1 else ())
            assert fleet.version == version and len(fleet.ready_urls()) == 2
            assert_serves(fleet.ready_urls(), model, version)

        # A server dies between steps: the next push reports and drops it, the rest commit.
        ray.kill(fleet.actor("server-0"))
        step(model, seed=4)
        report = fleet.push(model.state_dict(), 4)
        assert list(report.dropped) == ["server-0"] and report.ok
        assert [info.name for info in fleet.servers()] == ["server-1"]
        assert_serves(fleet.ready_urls(), model, 4)

        # A new server joins: not ready (and gated) until it holds the fleet's version.
        (name,) = fleet.add(1)
        assert name == "server-2" and len(fleet.ready_urls()) == 1
        newcomer = next(info for info in fleet.servers() if info.name == name)
        caught = fleet.catch_up(model.state_dict())
        assert caught is not None and caught.ok and caught.sync.version == 4
        assert [o.address for o in caught.sync.outcomes] == list(newcomer.addresses), "only the one behind"
        assert newcomer.url in fleet.ready_urls() and len(fleet.ready_urls()) == 2
        assert_serves(fleet.ready_urls(), model, 4)
        assert fleet.catch_up(model.state_dict()) is None, "nobody is behind any more"

        step(model, seed=5)
        report = fleet.push(model.state_dict(), 5)
        assert report.ok and report.dropped == {} and report.joined == ()
        assert_serves(fleet.ready_urls(), model, 5)


def test_catch_up_from_a_source_that_moved_on_is_refused(cluster, policy):
    """Also: a fleet with a token hands it to every actor (they do not see the trainer's
    environment); pushes prove it, and HTTP calls without it are refused."""
    model, path = policy
    token = "fleet-token-" + "x" * 16
    with RolloutFleet(
        ServeConfig(model=str(path), transport="tcp", auth_token=token), 1, sender=SENDER, timeout=START_S
    ) as fleet:
        step(model, seed=10)
        assert fleet.push(model.state_dict(), 10).ok
        with RolloutClient(fleet.ready_urls()[0], timeout=WAIT_S) as anonymous, pytest.raises(ServerError) as refused:
            anonymous.completions([5, 6], max_tokens=2, temperature=0)
        assert refused.value.status == 401
        # a live server that refuses a push raises, once the fleet has done its bookkeeping
        with pytest.raises(SyncFailed, match="unknown tensor 'extra.weight'") as failed:
            fleet.push(model.state_dict() | {"extra.weight": torch.zeros(4)}, 11)
        assert isinstance(failed.value.report, fleet_module.FleetReport) and not failed.value.report.ok
        assert "\n" not in str(failed.value) and fleet.version == 10 and len(fleet.ready_urls()) == 1
        (name,) = fleet.add(1)
        step(model, seed=11)  # the trainer stepped: its weights are no longer version 10
        with pytest.raises(WeightSyncError, match="is not version 10"):
            fleet.catch_up(model.state_dict())
        assert len(fleet.ready_urls()) == 1 and name not in {info.name for info in fleet.servers() if info.ready}
        # the next real push brings everyone to the new version
        report = fleet.push(model.state_dict(), 11)
        assert report.ok and len(fleet.ready_urls()) == 2
        assert_serves(fleet.ready_urls(), model, 11, token)


def test_a_server_ray_restarts_rejoins_on_the_next_push(cluster, policy):
    model, path = policy
    serve = ServeConfig(model=str(path), transport="tcp")
    with RolloutFleet(serve, 1, placement=Placement(max_restarts=1), sender=SENDER, timeout=START_S) as fleet:
        step(model, seed=20)
        assert fleet.push(model.state_dict(), 20).ok
        (before,) = fleet.servers()
        ray.kill(fleet.actor("server-0"), no_restart=False)  # the process dies; Ray starts a new one
        # (a push racing the kill may still reach the dying process: that push reports it failed)

        def restarted() -> bool:
            try:
                return ray.get(fleet.actor("server-0").describe.remote(), timeout=60)["pid"] != before.pid
            except ray.exceptions.RayError:  # caught between the two processes
                return False

        assert wait_until(restarted, 60), "Ray did not restart the server"
        step(model, seed=21)
        report = fleet.push(model.state_dict(), 21)
        assert report.ok and report.dropped == {} and report.joined == ("server-0",)
        (after,) = fleet.servers()
        assert after.pid != before.pid and after.url != before.url
        assert_serves(fleet.ready_urls(), model, 21)


def test_fleet_refuses_in_process_transport_and_a_missing_ray(cluster, policy, monkeypatch):
    from weightsync import ConfigError

    with pytest.raises(ConfigError, match="transport must be one of .*; got 'inproc'"):  # its servers' own check
        RolloutFleet(ServeConfig(model=str(policy[1]), transport="inproc"), 1)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(ConfigError, match="ray.init"):
        RolloutFleet(ServeConfig(model=str(policy[1])), 1)
