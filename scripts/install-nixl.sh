#!/usr/bin/env bash
# Install NIXL (the [nixl] extra, for transport="nixl" and its tests) into the project's venv, or
# the venv given as $1. Run scripts/setup.sh first: torch must already be installed.
#
# - nixl 1.5.1 is a meta package that pulls nixl-cu12 and nixl-cu13 (about 470 MB, UCX and its
#   plugins bundled: no system package needed). They require "torch" (any build) and numpy; with
#   our CPU torch already installed, the installer keeps it. Pinning torch to the installed
#   version in the same command makes sure it never swaps in a CUDA build.
# - It imports without CUDA and runs over UCX's shared-memory and tcp transports on a CPU host.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
if ! "$venv/bin/python" -c 'import nixl' >/dev/null 2>&1; then # setup.sh may have (WEIGHTSYNC_EXTRAS)
    flock . ./scripts/install.sh "$venv" -e ".[nixl]" "torch==$("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
fi
# Fail here, not in the tests, if the venv is broken.
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
import torch
from weightsync.transports.nixl import NixlAgent
NixlAgent("install-check").close()
print("nixl", md.version("nixl"), "torch", torch.__version__)
PY
