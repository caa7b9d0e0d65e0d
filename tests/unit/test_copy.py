"""copy_bytes: the native streaming copy must be byte-exact at every size and alignment."""

from __future__ import annotations

import platform
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync import pack

STREAM_MIN = 1 << 20
BLOCK = 4 * 4096  # the native routine copies whole 4-page blocks, then the tail

# Sizes around every edge of the routine: below streaming, exactly at it, whole blocks, odd tails.
edge_sizes = st.sampled_from(
    [0, 1, 63, 64, 65, STREAM_MIN - 1, STREAM_MIN, STREAM_MIN + 1, STREAM_MIN + BLOCK - 1, 3 * STREAM_MIN + 4097]
)


@pytest.fixture(scope="module")
def buffers() -> tuple[np.ndarray, np.ndarray]:
    source = np.random.default_rng(0).integers(0, 256, 4 * STREAM_MIN, dtype=np.uint8)
    return source, np.zeros_like(source)


@settings(max_examples=60, deadline=None)
@given(nbytes=edge_sizes | st.integers(0, 3 * STREAM_MIN), src_at=st.integers(0, 127), dst_at=st.integers(0, 127))
def test_copy_bytes_is_exact_at_any_alignment(buffers, nbytes: int, src_at: int, dst_at: int) -> None:
    source, target = buffers
    target[:] = 0
    pack.copy_bytes(target[dst_at : dst_at + nbytes], source[src_at : src_at + nbytes])
    assert np.array_equal(target[dst_at : dst_at + nbytes], source[src_at : src_at + nbytes])
    # Not a byte outside the destination is touched.
    assert not target[:dst_at].any()
    assert not target[dst_at + nbytes :].any()


def test_numpy_fallback_is_exact(monkeypatch, buffers) -> None:
    monkeypatch.setattr(pack, "_stream_copy", None)
    source, target = buffers
    pack.copy_bytes(target[5 : STREAM_MIN + 5], source[:STREAM_MIN])
    assert np.array_equal(target[5 : STREAM_MIN + 5], source[:STREAM_MIN])


@pytest.mark.skipif(not pack.STREAMING_COPY, reason="native copy not built")
def test_native_copy_refuses_mismatched_or_read_only_buffers() -> None:
    source = np.ones(STREAM_MIN, dtype=np.uint8)
    with pytest.raises(ValueError, match="holds"):
        pack.copy_bytes(np.zeros(STREAM_MIN - 1, dtype=np.uint8), source)
    read_only = np.zeros(STREAM_MIN, dtype=np.uint8)
    read_only.flags.writeable = False
    with pytest.raises((TypeError, BufferError, ValueError)):
        pack.copy_bytes(read_only, source)


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None,
    reason="the streaming routine is built for x86-64, with a C compiler",
)
def test_native_copy_is_built_on_x86_64() -> None:
    # setup.py builds it whenever a C compiler is present (it is, wherever our CI runs); a silent
    # build failure would halve same-host sync speed, so it is a test failure here.
    assert pack.STREAMING_COPY
