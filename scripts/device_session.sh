#!/usr/bin/env bash
# One device call, in priority order, each step with its own time limit:
# tune + bench, torch-integration GPU tests, determinism across processes.
set -u
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt"
timeout ${TB_LIMIT:-450} python3 scripts/tune_and_bench.py --out "$OUT" --tune-budget ${TUNE_BUDGET:-270} > "$OUT/tune-bench.log" 2>&1
echo "tune+bench rc=$?"
timeout ${LINEAR_LIMIT:-70} python3 -m pytest -q -x tests/test_gpu_linear.py > "$OUT/gpu-linear.log" 2>&1
echo "linear gpu tests rc=$? $(tail -1 "$OUT/gpu-linear.log")"
for i in 1 2; do timeout 40 python3 scripts/reliability.py digest; done > "$OUT/digest.log" 2>&1
echo "digests: $(sort -u "$OUT/digest.log" | wc -l) distinct of $(wc -l < "$OUT/digest.log")"
grep -E "candidates to|time budget|tuned in|dropped" "$OUT/tune-bench.log" | head -12
grep -A100 "ours us" "$OUT/tune-bench.log" | tail -84
