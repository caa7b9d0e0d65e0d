"""`python -m weightsync` runs the `weightsync` command."""

from __future__ import annotations

import sys

from weightsync.cli import main

if __name__ == "__main__":
    sys.exit(main())
