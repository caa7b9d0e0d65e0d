"""Fixtures every test shares: the transport parameter, and checks that no test leaves shared
memory or weightsync threads behind. Tests marked `gpu` are skipped where torch sees no CUDA, and
cases of a transport whose optional package is not installed (nixl) are skipped too."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import psutil
import pytest
import torch
from hypothesis import HealthCheck, settings

from tests.helpers import TRANSPORTS, missing_package, shm_segments, wait_until

# NIXL's UCX stays on loopback in tests (read by UCX when the first agent starts).
os.environ.setdefault("UCX_NET_DEVICES", "lo")

# torch.compile runs eagerly in tests and in every process they start. vLLM compiles a few sampler
# helpers with inductor (logprobs counts, top-k/top-p), a C++ build, at an engine's first request
# that needs them; in CI one such request outlasted its 30 s bound. The tests check weights and
# versions, not vLLM's kernels.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

# Under pytest-xdist (scripts/test.sh runs two workers) each worker, and every process it starts,
# has a temporary folder of its own, so that the leftover checks (tests/leftovers.py) see only
# what their own run made there (vLLM names its rendezvous files, and its segments after them).
if worker := os.environ.get("PYTEST_XDIST_WORKER"):
    _tmp = Path(tempfile.gettempdir()) / f"pytest-tmp-{worker}"
    _tmp.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = tempfile.tempdir = str(_tmp)

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


# --- the fault table: tests marked `fault` fill docs/fault-table.md ------------------------------
#
# WEIGHTSYNC_FAULT_TABLE=docs/fault-table.md pytest -m fault   writes one row per fault case: what
# was injected, what we expect, what the test observed (from its own measurements), and whether it
# passed. Without the variable nothing is written. A case this host skips (a `gpu` case without
# CUDA) is listed as "not run here" with the reason, never as passed or failed.

_FAULT_ROWS: dict[str, dict[str, str]] = {}


@pytest.fixture
def observe(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Call with what the test saw; it goes into the fault table's "observed" column.

    Also checks that the fault case leaves no child process and no listening port of its own
    behind (shared memory and threads are checked for every test, above).
    """
    me = psutil.Process()

    def children() -> set[int]:
        return {child.pid for child in me.children(recursive=True) if child.status() != psutil.STATUS_ZOMBIE}

    def listening() -> set[tuple[str, int]]:
        return {tuple(c.laddr) for c in me.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}

    before_children, before_ports = children(), listening()

    def record(text: str) -> None:
        _FAULT_ROWS.setdefault(request.node.nodeid, {})["observed"] = text

    yield record
    wait_until(lambda: not (children() - before_children) and not (listening() - before_ports))
    assert not children() - before_children, f"child processes left running: {children() - before_children}"
    assert not listening() - before_ports, f"ports left listening: {listening() - before_ports}"


NOT_RUN_HERE = "not run here"
"""The result of a fault case this host skipped (a GPU case without CUDA): listed, never passed."""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    row = _FAULT_ROWS.get(report.nodeid)
    if row is None:
        return
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        row["result"], row["observed"] = NOT_RUN_HERE, reason.removeprefix("Skipped: ")
    elif report.when == "call" or report.outcome != "passed":
        row["result"] = "pass" if report.outcome == "passed" and row.get("result") != "FAIL" else "FAIL"


GPU_ONLY = "GPU only: torch sees no CUDA device on this host"

SLOWEST_FIRST = (
    "server/test_stop_leaves_nothing.py",
    "integrations/test_vllm_backend.py",
    "integrations/test_vllm_sharded.py",
    "integrations/test_vllm_megatron.py",
    "server/test_vllm_serve_tp.py",
    "demo/test_demo_loop.py",
    "integrations/test_trl.py",
    "server/test_engine_patches.py",
    "server/test_lora.py",
    "server/test_vllm_server.py",
    "transports/test_sharded.py",
    "server/test_vllm_openai.py",
    "demo/test_demo_process.py",
    "integrations/test_megatron.py",
    "integrations/test_sglang_megatron.py",
    "server/test_sync_modes.py",
    "server/test_sglang_serve.py",
    "server/test_always_answering.py",
    "integrations/test_verl.py",
    "fleet/test_ray_fleet.py",
    "integrations/test_one_round.py",
    "demo/test_demo_sglang.py",
    "server/test_push_cli.py",
    "unit/test_benchmark_scripts.py",
    "integrations/test_sglang_backend.py",
)
"""The test modules that took longest in a full run (221 to 821 s each, 2026-12-04), longest
first. They run first, the rest after in their own order: on scripts/test.sh's two xdist workers
(`--no-loadscope-reorder`: a module at a time, in this order) no long module is left to start
once the other worker has run out of work. A module missing here only runs later."""


def _slowest_first(item: pytest.Item) -> int:
    path = Path(str(item.path)).relative_to(Path(__file__).parent).as_posix()
    return SLOWEST_FIRST.index(path) if path in SLOWEST_FIRST else len(SLOWEST_FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_slowest_first)  # stable: each module's own tests keep their order
    cuda = None
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            cuda = torch.cuda.is_available() if cuda is None else cuda
            if not cuda:
                item.add_marker(pytest.mark.skip(reason=GPU_ONLY))
        case = getattr(item, "callspec", None)
        for value in case.params.values() if case is not None else ():
            package = missing_package(value) if isinstance(value, str) else None
            if package is not None:
                item.add_marker(
                    pytest.mark.skip(reason=f"{package} is not installed: pip install 'weightsync[{value}]'")
                )
        marker = item.get_closest_marker("fault")
        if marker is not None:
            case = getattr(item, "callspec", None)
            name = marker.args[0] + (f" [{case.id}]" if case else "")
            _FAULT_ROWS[item.nodeid] = {"fault": name, "expected": marker.kwargs["expected"], "result": "not run"}


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("WEIGHTSYNC_FAULT_TABLE")
    rows = [row for row in _FAULT_ROWS.values() if row["result"] != "not run"]
    if not path or not rows:
        return
    lines = [
        "# Fault table",
        "",
        "Written by the test suite: `WEIGHTSYNC_FAULT_TABLE=docs/fault-table.md pytest -m fault`. Every",
        "row is a test that injects the fault into real senders, receivers or servers. The observed",
        "column is the test's own record of what happened. Every test also checks that no /dev/shm",
        "segment and no weightsync thread is left behind, and that the next push commits.",
        "",
    ]
    if any(row["result"] == NOT_RUN_HERE for row in rows):
        lines += [
            f"Rows whose result is `{NOT_RUN_HERE}` were skipped on the host that wrote this table (the cudaipc",
            "cases need CUDA on both sides); the observed column says why. Run the suite on a GPU host for them.",
            "",
        ]
    lines += ["| fault | expected | observed | result |", "|---|---|---|---|"]
    for row in rows:
        observed = row.get("observed", "(the test failed before recording)").replace("|", "/")
        lines.append(f"| {row['fault']} | {row['expected']} | {observed} | {row['result']} |")
    with open(path, "w", encoding="utf-8") as out:
        out.write("\n".join(lines) + "\n")
