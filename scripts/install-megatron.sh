#!/usr/bin/env bash
# Install megatron-core 0.16.1 (the newest for Python 3.11: 0.17 needs 3.12) into the project's
# venv (or the venv given as $1), for weightsync.integrations.megatron's tests and benchmark. Its
# requirements (torch, numpy, packaging) are the project's own: installed without them, so that
# torch, transformers and vLLM stay as they are. Run scripts/setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
./scripts/install.sh "$venv" --no-deps "megatron-core==0.16.1"
"$venv/bin/python" -c "import megatron.core as m; print('megatron-core', m.__version__)"  # fails here if broken
