"""Transfer benchmark: the same run as `weightsync-bench`, as a script.

    python benchmarks/bench_transfer.py --size-gb 4 --json > results.json

Every flag of `weightsync-bench` works here; see benchmarks/README.md.
"""

from __future__ import annotations

import sys

from weightsync_bench.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
