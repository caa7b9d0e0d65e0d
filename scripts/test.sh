#!/usr/bin/env bash
# Set up .venv, lint, type-check, then run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# Real vLLM (CPU build) for the vllm engine tests; WEIGHTSYNC_SKIP_VLLM=1 skips them.
if [[ -z "${WEIGHTSYNC_SKIP_VLLM:-}" ]]; then
    ./scripts/install-vllm.sh
fi
# verl (the tested version, without its own requirements) for weightsync.integrations.verl and
# its tests; WEIGHTSYNC_SKIP_VERL=1 skips them.
if [[ -z "${WEIGHTSYNC_SKIP_VERL:-}" ]]; then
    ./scripts/install-verl.sh
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy  # [tool.mypy] in pyproject.toml: the package, strict on the core
exec .venv/bin/pytest -q "$@"
