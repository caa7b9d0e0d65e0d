#!/usr/bin/env bash
# One GPU host run, under 8 minutes: build weightsync from this checkout, benchmark colocated
# sync over cudaipc (8 GB Qwen3-4B-shaped bf16, 1 and 4 receivers, the device copy beside it),
# then run every test marked `gpu`. Logs and JSON go to $OUT (default: ./gpu-out).
#
#   bash benchmarks/gpu/run.sh                  # from the checkout's root
#   PYTHON=.venv/bin/python bash benchmarks/gpu/run.sh   # a dry run elsewhere: GPU parts skip
#
# Packages the host lacks travel as wheels in $WHEELS (default: ../.whl beside the checkout, or
# .whl inside it) and are installed with --no-index into /tmp/site. The benchmark runs first, so
# that its figures come back even if a test hangs; the tests get what is left of the budget.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$ROOT/gpu-out}
PYTHON=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-450}
mkdir -p "$OUT"
started=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
log() { echo "run.sh [$((SECONDS - started)) s] $*"; }

wheels=${WHEELS:-}
for candidate in "$ROOT/../.whl" "$ROOT/.whl"; do
    [[ -z $wheels && -d $candidate ]] && wheels=$candidate
done
if [[ -n $wheels ]] && compgen -G "$wheels/*.whl" >/dev/null; then
    log "installing $(ls "$wheels" | tr '\n' ' ')into /tmp/site"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$ROOT/src:$ROOT/benchmarks${PYTHONPATH:+:$PYTHONPATH}

log "building the C extensions in place"
(cd "$ROOT" && "$PYTHON" setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1) || log "build failed (optional: numpy fallbacks); see build.log"
{
    "$PYTHON" - <<'EOF'
import platform, torch, weightsync
from weightsync import pack
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
print("weightsync", weightsync.__file__, "native copy", pack.STREAMING_COPY)
EOF
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 || true
} | tee "$OUT/env.txt"

log "benchmark: colocated cudaipc, 8 GB, device copy beside it"
cd "$ROOT" || exit 1
timeout 240 "$PYTHON" benchmarks/gpu/bench_colocated.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
bench_status=$?

left=$((BUDGET_S - (SECONDS - started)))
log "tests marked gpu ($left s left of the budget)"
parallel=()
"$PYTHON" -c "import xdist" 2>/dev/null && parallel=(-n 4 --dist loadscope)
timeout "$left" "$PYTHON" -m pytest -m gpu -p no:cacheprovider -p no:benchmark -q -rfEs "${parallel[@]}" \
    --junitxml="$OUT/gpu_tests.xml" \
    tests/gpu tests/transports/test_contract.py tests/transports/test_delta.py \
    tests/transports/test_verify.py tests/test_failures.py tests/transports/test_cudaipc.py 2>&1 | tee "$OUT/tests.log"
tests_status=$?

log "summary"
{
    echo "benchmark exit $bench_status, tests exit $tests_status (124: ran out of time), $((SECONDS - started)) s"
    grep -E "^(device copy|method|direct|ring) " "$OUT/bench.log" || echo "no benchmark figures"
    tail -n 1 "$OUT/tests.log"
} | tee "$OUT/summary.txt"
