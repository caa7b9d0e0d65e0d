# The types of the C extension built from streamcopy.c: mypy cannot read a compiled module.
# Either argument is any C-contiguous buffer; numpy arrays are named because numpy's stubs make
# them buffers only from Python 3.12 on.
from typing import Any

import numpy as np
from typing_extensions import Buffer

STREAMING: int
"""1 when this CPU has AVX2, so large copies use streaming (non-temporal) stores, else 0."""

def copy(dst: Buffer | np.ndarray[Any, Any], src: Buffer | np.ndarray[Any, Any], /) -> None:
    """Copy src's bytes into dst (same length), with streaming stores when large."""
