"""`weightsync-bench --link`: links parsed, shaped in a namespace of the run's own, and measured."""

from __future__ import annotations

import multiprocessing
import subprocess

import pytest

from weightsync.errors import ConfigError, ResourceError
from weightsync_bench.link import Link, LinkResult, enter_namespace, format_link_table, run_links, summarize


@pytest.mark.parametrize(
    ("text", "bits", "delay"),
    [
        ("10gbit", 10**10, 0.0),
        ("500mbit", 5 * 10**8, 0.0),
        ("2.5gbit,1ms", 25 * 10**8, 1e-3),
        ("1gbit,50us", 10**9, 5e-5),
    ],
)
def test_a_link_is_a_rate_and_a_delay(text, bits, delay):
    link = Link.parse(text)
    assert (link.rate_bits, link.delay_s) == (bits, pytest.approx(delay))
    assert Link.parse(link.label) == link


@pytest.mark.parametrize("text", ["10", "10gb", "fast", "10gbit,1s", "0mbit", "1000gbit", "10gbit,"])
def test_a_bad_link_is_refused_with_its_form(text):
    with pytest.raises(ConfigError, match="a link"):
        Link.parse(text)


def test_the_crossover_is_where_a_full_push_would_take_as_long_as_a_delta_push():
    from weightsync_bench.delta import DeltaStep
    from weightsync_bench.link import crossover_gbit

    # 1 GB over a 1 GB/s (8 Gbit/s) link at full efficiency: a full push takes 1 s; a delta push
    # 0.1 s on the wire (100 MB) plus 0.4 s of CPU. Full = delta where 0.9 GB / rate = 0.4 s.
    steps = [DeltaStep("tcp", step, 0.03, 10**8, 10**9, 0.5, 1.0, "delta", 0.1) for step in range(4)]
    result = LinkResult("8gbit", 1.0, [1.0, 1.0, 1.0], steps)
    assert crossover_gbit([result], "tcp") == pytest.approx(0.9 / 0.4 * 8)
    assert crossover_gbit([result], "nixl") is None
    assert "tcp: a delta push stops paying above about 18 Gbit/s" in format_link_table([result])


def _namespace_refusal() -> str | None:
    """Why no namespace can be made here, or None: tried in a child, this process is untouched."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        return pool.apply(_try_namespace)


def _try_namespace() -> str | None:
    try:
        enter_namespace()
    except ResourceError as exc:
        return str(exc)
    return None


def test_the_namespace_is_the_runs_own(tmp_path):
    refusal = _namespace_refusal()
    if refusal is not None:
        pytest.skip(refusal)
    # the host's loopback keeps its queueing discipline: only the namespace's is shaped
    before = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True, check=True).stdout
    results = run_links(
        [Link.parse("2gbit")], ("tcp",), size_bytes=16 << 20, steps=2, memcpy_bytes=1 << 20, stream_bytes=8 << 20
    )
    after = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True, check=True).stdout
    assert before == after and "tbf" not in after
    (result,) = results
    assert isinstance(result, LinkResult) and result.link == "2gbit"
    # the link is the bottleneck: a plain stream gets close to 2 Gbit/s, never far above it
    assert 0.5 * 0.25 < result.link_gbps < 1.3 * 0.25
    (row,) = summarize(result)
    assert row.transport == "tcp" and len(row.full_s) == len(row.delta_s) == 3
    assert [step.delta_mode for step in result.steps] == ["full", "delta", "delta"]  # delta pushes are verified
    assert 0 < row.changed_fraction < 0.1 and row.patch_bytes < 0.5 * row.full_bytes
    # 16 MiB cannot cross a 2 Gbit/s link in less than 67 ms; the shaper's burst lets the first
    # bytes through at once (a run measured 53 ms), and unshaped loopback takes under 10 ms
    assert min(row.full_s) > 0.5 * row.full_bytes / 0.25e9
    table = format_link_table(results)
    assert table.startswith("link 2gbit: plain socket stream") and "\n  tcp " in table
    assert result.to_json()["transports"][0]["transport"] == "tcp"
