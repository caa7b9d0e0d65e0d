#!/usr/bin/env bash
# Create .venv and install weightsync with its test and benchmark dependencies, one line per step.
# torch is pinned to the 2.13.0 CPU build that lies on disk on our dev/CI machines; on a GPU
# machine set WEIGHTSYNC_TORCH (e.g. WEIGHTSYNC_TORCH="torch") to take your own build.
# Durations are those measured on a fresh clone on the 2-core dev machine (packages from a local
# mirror; downloading them takes longer). A set-up already done (same pyproject.toml, setup.py and
# torch, and both are installed) is not redone: a later run takes a second. --force redoes it.
# WEIGHTSYNC_EXTRAS=nixl (scripts/test.sh's) adds extras to a fresh install: one editable build.
set -euo pipefail
cd "$(dirname "$0")/.."
install=(./scripts/install.sh .venv)  # uv, with pip's configuration
started=$SECONDS
stamp=.venv/.weightsync-setup
extras="dev${WEIGHTSYNC_EXTRAS:+,$WEIGHTSYNC_EXTRAS}"
wanted="$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1) ${WEIGHTSYNC_TORCH:-torch==2.13.0}"
if [[ "${1:-}" != "--force" && -f "$stamp" && "$(cat "$stamp")" == "$wanted" ]] \
        && .venv/bin/python -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("torch") and u.find_spec("weightsync")))' \
            >/dev/null 2>&1; then
    echo "setup: .venv is already set up (scripts/setup.sh --force redoes it)"
    exit 0
fi
echo "setup [1/3] creating .venv with $(python3 --version) (a few seconds)"
python3 -m venv .venv
echo "setup [2/3] installing ${WEIGHTSYNC_TORCH:-torch==2.13.0} into .venv (about 5 s)"
"${install[@]}" "${WEIGHTSYNC_TORCH:-torch==2.13.0}"
echo "setup [3/3] installing weightsync and its test and demo dependencies (about 10 s)"
# torch again: an extra that requires "torch" (nixl) keeps this one. One build of this checkout at
# a time (see install-sglang.sh).
flock . "${install[@]}" -e ".[$extras]" "${WEIGHTSYNC_TORCH:-torch==2.13.0}"
echo "$wanted" > "$stamp"
echo "setup: .venv ready in $((SECONDS - started)) s"
