#!/bin/bash
# $1: seconds before SIGTERM (0: after the announcement); runs in a private /dev/shm
mount -t tmpfs tmpfs /dev/shm || exit 9
cd /work/wt-first
export VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=0
.venv/bin/python -m weightsync serve --engine vllm --model runs/demo-load/policy --port 0 > /tmp/first-sem/out.$2 2> /tmp/first-sem/err.$2 &
pid=$!
if [[ "$1" == 0 ]]; then
  for i in $(seq 600); do grep -q "weightsync serve: http" /tmp/first-sem/out.$2 && break; sleep 1; done
else
  sleep $1
fi
echo "shm while running: $(ls /dev/shm | tr '\n' ' ')"
kill -TERM $pid; wait $pid; echo "exit $?"
sleep 5
echo "left in /dev/shm: [$(ls /dev/shm | tr '\n' ' ')]"
echo "processes left: $(pgrep -f "runs/demo-load/policy" | tr '\n' ' ')"
