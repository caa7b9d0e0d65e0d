"""Fixtures every test shares: the transport parameter, and checks that no test leaves shared
memory or weightsync threads behind."""

from __future__ import annotations

import os
import threading

import pytest
from hypothesis import HealthCheck, settings

from tests.helpers import TRANSPORTS, shm_segments, wait_until

# Deterministic by default (same examples every run, nothing written to disk); set
# HYPOTHESIS_PROFILE=explore for fresh random examples and more of them.
settings.register_profile(
    "default",
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("explore", deadline=None, max_examples=500, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(params=TRANSPORTS, scope="session")
def transport(request: pytest.FixtureRequest) -> str:
    """Each transport in turn; inproc is the reference the others must match."""
    return request.param


@pytest.fixture(autouse=True)
def no_shm_leak():  # type: ignore[no-untyped-def]
    """No test may leave a /dev/shm/weightsync-* segment of this process behind, on any path.

    Segments of child processes are checked by the tests that start them; other processes'
    are left out so that two test runs on one host do not see each other's rings.
    """
    pid = os.getpid()
    before = shm_segments(pid)
    yield
    wait_until(lambda: not shm_segments(pid) - before)
    leaked = shm_segments(pid) - before
    assert not leaked, f"shared-memory segments leaked: {sorted(leaked)}"


@pytest.fixture(autouse=True)
def no_thread_leak():  # type: ignore[no-untyped-def]
    """Connection and inbox threads started by a test end once its senders and receivers close.

    Listener threads are left out: a module-scoped receiver outlives the test that started it.
    """
    before = set(threading.enumerate())

    def lingering() -> list[str]:
        return [
            t.name
            for t in threading.enumerate()
            if t not in before and t.name.startswith("weightsync-") and not t.name.endswith("-accept")
        ]

    yield
    wait_until(lambda: not lingering())
    assert not lingering(), f"threads still running after the test: {lingering()}"
