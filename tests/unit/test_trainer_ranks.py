"""The trainer ranks' agreement in a sharded push through vLLM's trainer API (ranks.py): a rank
that dies, or that never gets to the push, makes the others raise `CollectiveError` within the
timeout, one line naming the rank, instead of waiting out torch.distributed's 30 minutes.

Two real processes in a gloo group (the default group and the ranks' own, as in a trainer)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import free_port

RANK = textwrap.dedent(
    """
    import os, sys, time
    import torch.distributed as dist
    from weightsync.errors import CollectiveError
    from weightsync.ranks import Ranks

    rank, port, fault = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    ranks = Ranks(timeout=3.0)
    assert ranks.share(b"workers" if rank == 0 else b"") == b"workers"
    assert ranks.settle(True) and not ranks.settle(rank == 0)  # one vote against: no agreement
    if rank == 1:
        if fault == "dies":
            os._exit(0)
        time.sleep(20)  # "hangs": never gets to the next push
        os._exit(0)
    started = time.monotonic()
    try:
        ranks.settle(True)
    except CollectiveError as exc:
        print(f"raised after {time.monotonic() - started:.1f} s: {exc}", flush=True)
        os._exit(0)
    os._exit(3)
    """
)


@pytest.mark.parametrize("fault", ["dies", "hangs"])
def test_a_rank_missing_from_an_agreement_makes_the_others_raise_within_the_timeout(fault: str) -> None:
    port = str(free_port())
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rank), port, fault], stdout=subprocess.PIPE, text=True, env=env
        )
        for rank in range(2)
    ]
    try:
        out, _ = ranks[0].communicate(timeout=60)
        assert ranks[0].returncode == 0, out
        (line,) = out.splitlines()
        seconds = float(line.split()[2])
        assert seconds < 3.0 + 5.0, line  # the group's timeout, not torch.distributed's 30 minutes
        assert "trainer rank 0 of 2: the ranks could not agree (a rank died, or did not get there within 3 s)" in line
    finally:
        for process in ranks:
            process.kill()
            process.communicate(timeout=10)
