#!/usr/bin/env bash
# Create .venv and install weightsync with its test and benchmark dependencies, one line per step.
# torch is pinned to the 2.13.0 CPU build that lies on disk on our dev/CI machines; on a GPU
# machine set WEIGHTSYNC_TORCH (e.g. WEIGHTSYNC_TORCH="torch") to take your own build.
# Durations are those measured on a fresh clone on the 2-core dev machine (packages from a local
# mirror; downloading them takes longer); a later run takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
started=$SECONDS
echo "setup [1/3] creating .venv with $(python3 --version) (a few seconds)"
python3 -m venv .venv
echo "setup [2/3] installing ${WEIGHTSYNC_TORCH:-torch==2.13.0} into .venv (about 20 s)"
"${pip[@]}" "${WEIGHTSYNC_TORCH:-torch==2.13.0}"
echo "setup [3/3] installing weightsync and its test and demo dependencies (about 40 s)"
"${pip[@]}" -e ".[dev]"
echo "setup: .venv ready in $((SECONDS - started)) s"
