#!/usr/bin/env bash
# Set up .venv and vLLM, then run the main job: `weightsync demo`, a GRPO run whose weights are
# pushed to two vLLM rollout servers after every step; writes runs/demo/ (the servers' logs too). A
# set-up already done is not redone. A progress bar counts the steps. Extra arguments go to
# `weightsync demo`:
#   ./scripts/demo.sh --engine hf              # transformers servers: no vLLM to install, quicker
#   ./scripts/demo.sh --mode colocated          # the engine in the trainer's process (hf)
# WEIGHTSYNC_SKIP_VLLM=1 skips installing vLLM (the demo then runs on hf).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
args=" $* "
if [[ -n "${WEIGHTSYNC_SKIP_VLLM:-}" || "$args" == *" --engine hf "* || "$args" == *" --engine=hf "* \
      || "$args" == *" --mode colocated "* || "$args" == *" --mode=colocated "* ]]; then
    echo "demo: not installing vLLM (hf engine)"
else
    ./scripts/install-vllm.sh
fi
echo "demo: running .venv/bin/weightsync demo $*"
exec .venv/bin/weightsync demo "$@"
