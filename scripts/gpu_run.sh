#!/usr/bin/env bash
# One device call: GPU tests, then the benchmark; logs and JSON to $OUT.
# usage (on the GPU host, repo root): bash scripts/gpu_run.sh [pytest args...]
set -o pipefail
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, cutlass; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -m gpu -x tests "$@" 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 -m warpsplitk.cli bench --m "${BENCH_M:-1,4,8,16,32}" ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
fi
