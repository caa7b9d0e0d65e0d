"""`python -m weightsync_bench`: the `weightsync-bench` command."""

import sys

from weightsync_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
