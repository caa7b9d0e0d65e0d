"""A ring that cannot be had says why: the constructor's error path used to hide a good
ResourceError ("cannot reserve ... in /dev/shm") under AttributeError: no attribute 'pinned'."""

from __future__ import annotations

import pytest

from tests.helpers import shm_segments
from weightsync.errors import ResourceError
from weightsync.transports.shm import ShmRing


def test_a_ring_larger_than_dev_shm_is_a_resource_error_and_leaves_nothing(tmp_path) -> None:
    before = shm_segments()
    with pytest.raises(ResourceError, match="cannot reserve .* in /dev/shm.*lower bucket_bytes"):
        ShmRing(2, 1 << 50)
    assert shm_segments() - before == set()
