#!/usr/bin/env bash
# Set up .venv, then run the main job: `weightsync demo`, a GRPO run whose weights are pushed to
# two rollout servers after every step (about a minute here; writes runs/demo/).
# Extra arguments go to `weightsync demo`, e.g. ./scripts/demo.sh --mode colocated --steps 40
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/weightsync demo "$@"
