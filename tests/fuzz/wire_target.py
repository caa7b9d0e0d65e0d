"""Coverage-guided fuzzing (atheris) of what a peer controls on the wire: every control frame a
receiver decodes, and every plan it checks before allocating anything.

    python -m tests.fuzz.wire_target CORPUS_DIR -max_total_time=20

A crash is any exception other than the two a hostile frame may cause (ProtocolError from the
decoder, PlanError from the plan check), or an allocation a checked plan did not announce.
`tests/unit/test_fuzz.py` runs it for a bounded time in CI.
"""

from __future__ import annotations

import sys

import atheris
import msgspec  # noqa: F401  (imported first: only weightsync's own modules are instrumented)
import numpy
import psutil  # noqa: F401
import torch  # noqa: F401
import xxhash  # noqa: F401

with atheris.instrument_imports(include=["weightsync"]):
    from weightsync.errors import PlanError, ProtocolError
    from weightsync.landing import Landing
    from weightsync.messages import Offer
    from weightsync.plan import check_plan, plan_id
    from weightsync.sink import CallableSink
    from weightsync.transports.collective import Group
    from weightsync.transports.shm import Ring
    from weightsync.transports.tcp import BucketData
    from weightsync.wire import decode, encode

TRANSPORT_MESSAGES = (Ring, BucketData, Group)
"""Transports' own messages, decoded besides the core ones (as their links do)."""

MAX_BUCKET_BYTES = 1 << 30
LAND_AT_MOST = 1 << 20
"""Plans that pass the check are landed for real when they are this small (bounded memory)."""


def one_input(data: bytes) -> None:
    try:
        message = decode(data, TRANSPORT_MESSAGES)
    except ProtocolError:
        return
    assert decode(encode(message), TRANSPORT_MESSAGES) == message, "what decodes must round-trip"
    if not isinstance(message, Offer):
        return
    try:
        check_plan(message.plan, MAX_BUCKET_BYTES)
    except PlanError:
        return
    plan_id(message.plan)
    if message.plan.total_bytes > LAND_AT_MOST:
        return
    try:
        landing = Landing(message.plan, CallableSink(lambda named: None), message.version, message.plan_id)
    except PlanError:
        return
    for index, bucket in enumerate(message.plan.buckets):
        for piece in bucket:
            target = landing.target(piece)  # None: lent, the piece's bytes stay where they came
            assert target is None or target.nbytes == piece.nbytes, "a piece lands in exactly its own bytes"
            landing.copy_in(piece, numpy.zeros(piece.nbytes, dtype=numpy.uint8))
        landing.finish_bucket(index)


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
