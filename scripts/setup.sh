#!/usr/bin/env bash
# Create .venv and install weightsync with its test and benchmark dependencies.
# torch is pinned to the 2.13.0 CPU build that lies on disk on our dev/CI machines; on a GPU
# machine set WEIGHTSYNC_TORCH (e.g. WEIGHTSYNC_TORCH="torch") to take your own build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check "${WEIGHTSYNC_TORCH:-torch==2.13.0}"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
