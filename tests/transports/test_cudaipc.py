"""cudaipc where there is no GPU: a clear error at once, on either side (tests/gpu covers the rest)."""

from __future__ import annotations

import pytest
import torch

from weightsync import WeightReceiver, WeightSender
from weightsync.errors import ConfigError


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cudaipc_without_a_gpu_is_refused_at_once_on_both_sides():
    with pytest.raises(ConfigError, match="cudaipc transport needs CUDA on the receiver"):
        WeightReceiver({"w": torch.zeros(2)}, transport="cudaipc").start()
    with pytest.raises(ConfigError, match="cudaipc transport needs CUDA on the sender"):
        WeightSender(["cudaipc://@somewhere"])
    with pytest.raises(ConfigError, match=r"must look like cudaipc://@NAME"):
        WeightSender(["cudaipc://nowhere"])
