"""The atheris fuzzer over the wire decoder and the plan check, for a bounded time, seeded with
real frames (tests/fuzz/wire_target.py). Failing means atheris found an input that crashes or
over-allocates; it prints the input, and `python -m tests.fuzz.wire_target FILE` replays it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from weightsync.messages import Abort, Accept, BucketReady, Commit, Hello, Offer, Welcome
from weightsync.plan import build_plan, plan_id, wire_specs
from weightsync.source import as_source
from weightsync.transports.collective import Group
from weightsync.transports.shm import Ring
from weightsync.transports.tcp import BucketData
from weightsync.wire import encode

pytest.importorskip("atheris")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
FUZZ_SECONDS = int(os.environ.get("WEIGHTSYNC_FUZZ_SECONDS", "20"))


def seeds() -> list[bytes]:
    """One valid frame of every kind a receiver reads, plans chunked and not."""
    tensors = {"embed": torch.zeros(64, 8), "norm": torch.zeros(8), "ids": torch.zeros(3, dtype=torch.int64)}
    specs = wire_specs(as_source(tensors).metas(), None)
    frames = []
    for bucket_bytes in (128, 4096):
        plan = build_plan(specs, bucket_bytes)
        frames.append(encode(Offer(1, plan, plan_id(plan), "bucket")))
    return frames + [
        encode(Hello(2, "sender", "nonce")),
        encode(Welcome(2, "receiver", 1 << 20, 3, "off", "n", "p")),
        encode(Ring(("weightsync-1-0123456789ab-0",), 4096)),
        encode(Group("127.0.0.1", 29500, "prefix", 1, 2, "gloo")),
        encode(Accept(1)),
        encode(BucketReady(0, 12345, 1)),
        encode(BucketData(0, 128, 0)),
        encode(Commit(1, "digest", "content", (1, 2))),
        encode(Abort(1, "reason")),
    ]


def test_fuzzing_the_decoder_and_plan_check_finds_nothing(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for index, frame in enumerate(seeds()):
        (corpus / f"seed-{index}").write_bytes(frame)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.fuzz.wire_target",
            str(corpus),
            f"-max_total_time={FUZZ_SECONDS}",
            "-rss_limit_mb=4096",
            "-max_len=4096",
            "-seed=1",
            f"-artifact_prefix={tmp_path}/",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=FUZZ_SECONDS + 120,
        env=os.environ | {"PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    runs = re.findall(r"#(\d+)\s+DONE", log) or re.findall(r"Done (\d+) runs", log)
    assert runs and int(runs[-1]) > 1000, log[-2000:]
