#!/usr/bin/env bash
# Set up .venv, then run the main job: the transfer benchmark (`weightsync bench`).
# Extra arguments go to `weightsync bench`, e.g. ./scripts/demo.sh --size-gb 1
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/weightsync bench "$@"
