"""A real link of a chosen rate on one host: a private network namespace whose loopback is shaped.

Over the host's own loopback, "the wire" is a memory copy by the same cores that run both ends.
`run_links` instead runs the sender and its receivers in a network namespace of their own, made
for the run by one child process (`unshare`), whose loopback `tc` shapes to each link in turn: a
token bucket (`tbf`) for the rate, under `netem` for a one-way delay when one is asked for. The
namespace holds only its own loopback, so no byte leaves it, and it ends with that child: nothing
to tear down, whatever way the run ends.

In the namespace, per link: a plain socket stream measures the link's own rate (one process
`sendall`s a buffer, another `recv_into`s it), then `weightsync_bench.delta.run_delta` pushes
RL-like updates over every networked transport, delta and full, step by step. nixl goes over
UCX's tcp transport (`UCX_TLS=tcp`): shared memory would bypass the link.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import multiprocessing
import os
import re
import shutil
import socket
import subprocess
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from weightsync.errors import BenchError, ConfigError, ResourceError

__all__ = ["LINK_TRANSPORTS", "Link", "LinkResult", "enter_namespace", "run_links", "shape", "stream_gbps"]

LINK_TRANSPORTS = ("tcp", "collective", "nixl")
"""The transports that cross a network, in the order a link run measures them."""

_UNITS = {"mbit": 10**6, "gbit": 10**9}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3}
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    """A link's rate, in bits per second, and one-way delay, in seconds."""

    rate_bits: int
    delay_s: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Link:
        """ "10gbit", "500mbit" or "10gbit,1ms" (rate, then an optional one-way delay in ms or us)."""
        rate, comma, delay = text.strip().lower().partition(",")
        matched = re.fullmatch(r"(\d+(?:\.\d+)?)(mbit|gbit)", rate.strip())
        timed = re.fullmatch(r"(\d+(?:\.\d+)?)(us|ms)", delay.strip()) if comma else None
        if matched is None or (comma and timed is None):
            raise ConfigError(f"a link looks like 10gbit, 500mbit or 10gbit,1ms; got {text!r}")
        bits = round(float(matched[1]) * _UNITS[matched[2]])
        delay_s = float(timed[1]) * _DELAY_UNITS[timed[2]] if timed else 0.0
        if not 10**6 <= bits <= 400 * 10**9 or delay_s > 1.0:
            raise ConfigError(f"a link's rate must be 1mbit-400gbit and its delay at most 1 s; got {text!r}")
        return cls(bits, delay_s)

    @property
    def gbps(self) -> float:
        """The nominal rate in GB/s (10**9 bytes)."""
        return self.rate_bits / 8e9

    @property
    def label(self) -> str:
        rate = f"{self.rate_bits / 1e9:g}gbit" if self.rate_bits >= 10**9 else f"{self.rate_bits / 1e6:g}mbit"
        if not self.delay_s:
            return rate
        return rate + (f",{self.delay_s * 1e3:g}ms" if self.delay_s >= 1e-3 else f",{self.delay_s * 1e6:g}us")


def _run(command: Sequence[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode:
        raise ResourceError(f"{' '.join(command)} failed: {(done.stderr or done.stdout).strip()}")


def enter_namespace() -> None:
    """Move this process into a new network namespace of its own, its loopback up.

    Its children (and threads started from now on) are in it too; it ends with the last of them.
    As root, a network namespace alone; otherwise inside a user namespace of its own, where
    unprivileged user namespaces are allowed.

    Raises:
        ResourceError: the namespace cannot be made here, or `ip`/`tc` (iproute2) are missing.
    """
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ResourceError(f"a shaped link needs iproute2 ({' and '.join(missing)} not found): apt install iproute2")
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.geteuid(), os.getegid()
    flags = CLONE_NEWNET if uid == 0 else CLONE_NEWUSER | CLONE_NEWNET
    if libc.unshare(flags) != 0:
        error = os.strerror(ctypes.get_errno())
        need = "" if uid == 0 else " (needs root, or unprivileged user namespaces)"
        raise ResourceError(f"cannot make a private network namespace here: unshare: {error}{need}")
    if uid != 0:  # be root inside the user namespace, where tc may shape our own loopback
        for path, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{path}", "w") as file:
                file.write(text)
    _run(["ip", "link", "set", "lo", "up"])


def shape(link: Link) -> None:
    """Shape this namespace's loopback to `link` (replacing any earlier shape)."""
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True, timeout=30, check=False)
    # the bucket must hold a 64 KiB loopback packet and a timer tick's worth of bytes
    burst = max(4 << 20, math.ceil(link.rate_bits / 8 / 250))
    tbf = ["tbf", "rate", f"{link.rate_bits}bit", "burst", str(burst), "latency", "50ms"]
    if link.delay_s:
        delay = ["netem", "delay", f"{link.delay_s * 1e6:.0f}us", "limit", "100000"]
        try:
            _run(["tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", *delay])
        except ResourceError as exc:
            if "unknown" in str(exc):
                raise ResourceError(
                    "a link with a delay needs the kernel's netem qdisc (sch_netem), not here"
                ) from None
            raise
        _run(["tc", "qdisc", "add", "dev", "lo", "parent", "1:1", "handle", "10:", *tbf])
    else:
        _run(["tc", "qdisc", "add", "dev", "lo", "root", *tbf])


def _stream_receiver(conn: Connection, nbytes: int, rounds: int, timeout: float) -> None:
    import numpy as np

    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(timeout)
        conn.send(server.getsockname()[1])
        peer, _ = server.accept()
        with peer:
            peer.settimeout(timeout)
            buffer = np.ones(nbytes, dtype=np.uint8).data  # touched: no page faults timed
            for _ in range(rounds):
                received = 0
                while received < nbytes:
                    received += peer.recv_into(buffer[received:], nbytes - received)
                peer.sendall(b"\x01")


def stream_gbps(nbytes: int, rounds: int = 3, timeout: float = 600.0) -> list[float]:
    """A plain socket stream of `nbytes` from this process to another, `rounds` times over one
    connection; GB/s of each round, from the first byte sent to the receiver's reply."""
    import numpy as np

    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_stream_receiver, args=(child, nbytes, rounds, timeout), daemon=True)
    process.start()
    try:
        if not parent.poll(timeout):
            raise BenchError("the stream receiver did not start")
        port = parent.recv()
        source = np.ones(nbytes, dtype=np.uint8).data
        rates = []
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            for _ in range(rounds):
                started = time.perf_counter()
                sock.sendall(source)
                if sock.recv(1) != b"\x01":
                    raise BenchError("the stream receiver closed early")
                rates.append(nbytes / (time.perf_counter() - started) / 1e9)
        return rates
    finally:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()


@dataclasses.dataclass(slots=True)
class LinkResult:
    """One link: its measured rate and every transport's delta and full pushes on it."""

    link: str
    nominal_gbps: float
    stream_gbps: list[float]
    """The plain socket stream's rate, per round (GB/s)."""
    steps: list[Any]
    """`bench.delta.DeltaStep`s, every transport's, in order."""

    @property
    def link_gbps(self) -> float:
        """The link's measured rate: the median stream round."""
        return _median(self.stream_gbps)

    def to_json(self) -> dict[str, Any]:
        return {
            "link": self.link,
            "nominal_gbps": self.nominal_gbps,
            "stream_gbps": self.stream_gbps,
            "link_gbps": self.link_gbps,
            "transports": [
                {
                    **dataclasses.asdict(row),
                    "steady_full_s": row.steady_full_s,
                    "steady_delta_s": row.steady_delta_s,
                    "full_to_link": row.full_to_link,
                    "delta_to_full": row.delta_to_full,
                }
                for row in summarize(self)
            ],
            "steps": [dataclasses.asdict(step) for step in self.steps],
        }


def _inside(conn: Connection, links: Sequence[Link], options: dict[str, Any]) -> None:
    """The child that owns the namespace: shape, measure, push; one message per link."""
    try:
        enter_namespace()
        os.environ["UCX_TLS"] = "tcp"  # nixl over UCX's tcp: its shared-memory paths skip the link
        os.environ["UCX_NET_DEVICES"] = "lo"
        from weightsync_bench.delta import run_delta

        for link in links:
            shape(link)
            rates = stream_gbps(options["stream_bytes"], timeout=options["timeout"])
            steps = run_delta(
                options["transports"],
                options["size_bytes"],
                options["lr"],
                options["steps"],
                options["seed"],
                options["bucket_bytes"],
                options["memcpy_bytes"],
            )
            conn.send(("link", LinkResult(link.label, link.gbps, rates, steps)))
        conn.send(("done", None))
    except ResourceError as exc:
        conn.send(("refused", str(exc)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def run_links(
    links: Sequence[Link],
    transports: Sequence[str] = LINK_TRANSPORTS,
    *,
    size_bytes: int,
    lr: float = 1e-6,
    steps: int = 8,
    seed: int = 0,
    bucket_bytes: int | str = "auto",
    memcpy_bytes: int = 1 << 30,
    stream_bytes: int = 512 << 20,
    timeout: float = 3600.0,
) -> list[LinkResult]:
    """Measure every link in turn, in one private network namespace made for this call.

    Raises:
        ResourceError: no namespace can be made here (the reason, on one line).
        BenchError: a measurement failed (with the child's traceback).
    """
    unknown = sorted(set(transports) - set(LINK_TRANSPORTS))
    if unknown or not transports or not links:
        raise ConfigError(f"a link run measures some of {', '.join(LINK_TRANSPORTS)} on at least one link")
    options = {
        "transports": tuple(transports),
        "size_bytes": size_bytes,
        "lr": lr,
        "steps": steps,
        "seed": seed,
        "bucket_bytes": bucket_bytes,
        "memcpy_bytes": memcpy_bytes,
        "stream_bytes": stream_bytes,
        "timeout": timeout,
    }
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_inside, args=(child, tuple(links), options))
    process.start()
    child.close()
    results: list[LinkResult] = []
    try:
        while True:
            if not parent.poll(timeout):
                raise BenchError(f"the link run gave nothing for {timeout:g} s")
            kind, value = parent.recv()
            if kind == "link":
                results.append(value)
            elif kind == "done":
                return results
            elif kind == "refused":
                raise ResourceError(value)
            else:
                raise BenchError(f"the link run failed:\n{value}")
    except EOFError:
        raise BenchError(f"the link run's process died (exit code {process.exitcode})") from None
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
            process.join()


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else math.nan


@dataclasses.dataclass(frozen=True, slots=True)
class TransportOnLink:
    """One transport's figures on one link: first, second and steady-state syncs, full and delta."""

    transport: str
    link_gbps: float
    full_bytes: int
    full_s: tuple[float, ...]
    delta_s: tuple[float, ...]
    patch_bytes: float
    changed_fraction: float

    @property
    def steady_full_s(self) -> float:
        """Median full push from the third step on (the first two pay for connecting and mapping)."""
        return _median(self.full_s[2:] or self.full_s[1:])

    @property
    def steady_delta_s(self) -> float:
        return _median(self.delta_s[2:] or self.delta_s[1:])

    @property
    def full_to_link(self) -> float:
        """The steady full push's rate over the link's, both measured in this run."""
        return self.full_bytes / self.steady_full_s / 1e9 / self.link_gbps

    @property
    def delta_to_full(self) -> float:
        """Median over steps 1.. of delta time over full time, each pair pushed back to back."""
        return _median([d / f for d, f in zip(self.delta_s[1:], self.full_s[1:], strict=True)])


def summarize(result: LinkResult) -> list[TransportOnLink]:
    """Each transport's figures on the link of `result`."""
    rows = []
    for transport in dict.fromkeys(step.transport for step in result.steps):
        steps = [step for step in result.steps if step.transport == transport]
        later = [step for step in steps if step.step > 0] or steps
        rows.append(
            TransportOnLink(
                transport,
                result.link_gbps,
                steps[0].full_wire_bytes,
                tuple(step.full_s for step in steps),
                tuple(step.delta_s for step in steps),
                _median([step.delta_wire_bytes for step in later]),
                _median([step.changed_fraction for step in later]),
            )
        )
    return rows


def crossover_gbit(results: Sequence[LinkResult], transport: str) -> float | None:
    """The link rate, in Gbit/s, above which a delta push of `transport` stops beating a full one,
    from its figures on the fastest link measured: a push spends `bytes / (efficiency * rate)`
    on the wire (the efficiency that link showed) and a delta push the rest of its time on the
    CPU (diff, apply, hashes), the same at any rate. None without a delta push on that link."""
    rows = [row for result in results for row in summarize(result) if row.transport == transport]
    if not rows:
        return None
    row = max(rows, key=lambda row: row.link_gbps)
    wire_gbps = row.full_bytes / row.steady_full_s / 1e9  # what the full push got from the link
    cpu_s = row.steady_delta_s - row.patch_bytes / 1e9 / wire_gbps
    if cpu_s <= 0:
        return None
    efficiency = wire_gbps / row.link_gbps
    return (row.full_bytes - row.patch_bytes) / 1e9 / (efficiency * cpu_s) * 8


def format_link_table(results: Sequence[LinkResult]) -> str:
    """Per link: its measured rate, then per transport the full and delta pushes (first, second,
    steady state) and their ratios to the link and to each other."""
    lines = []
    for result in results:
        rounds = " ".join(f"{rate:.3f}" for rate in result.stream_gbps)
        lines.append(
            f"link {result.link}: plain socket stream {result.link_gbps:.3f} GB/s "
            f"({result.link_gbps / result.nominal_gbps:.2f}x nominal; rounds {rounds})"
        )
        lines.append(
            "  transport    full s: first  second  steady  full/link   delta s: first  second  steady"
            "  delta/full  changed  patch MB"
        )
        for row in summarize(result):
            lines.append(
                f"  {row.transport:<11} {row.full_s[0]:>14.3f} {_at(row.full_s, 1):>7} {row.steady_full_s:>7.3f}"
                f" {row.full_to_link:>10.2f} {row.delta_s[0]:>16.3f} {_at(row.delta_s, 1):>7}"
                f" {row.steady_delta_s:>7.3f} {row.delta_to_full:>11.2f} {row.changed_fraction:>8.4f}"
                f" {row.patch_bytes / 1e6:>9.1f}"
            )
    for transport in dict.fromkeys(row.transport for result in results for row in summarize(result)):
        rate = crossover_gbit(results, transport)
        if rate is not None:
            lines.append(f"{transport}: a delta push stops paying above about {rate:.0f} Gbit/s on this CPU")
    return "\n".join(lines)


def _at(values: Sequence[float], index: int) -> str:
    return f"{values[index]:.3f}" if index < len(values) else "-"
