#!/usr/bin/env bash
# The GPU check, on a machine with a CUDA GPU, from the repository root:
#   bash scripts/gpu_check.sh [tests] [sanitize] [bench]     (default: all three)
# writes its records into $RESULTS (default bench/results), named for the GPU
# ($GPU_NAME, default h200):
#   tests     every GPU test module (pytest -m gpu), side by side, each in its
#             own process with its own time limit ($TEST_LIMIT s, default 300)
#             -> $GPU_NAME-gpu-tests.json
#   sanitize  compute-sanitizer memcheck, racecheck, synccheck and initcheck
#             over every tactic of the built-in plan and the default
#             heuristic (scripts/sanitize.sh, SUBSET=shipped)
#             -> $GPU_NAME-sanitizer.json
#   bench     the built-in plan over the shape table x M 1,4,8,16,32 and its
#             dependent chains, against cuBLAS, with the plot
#             -> $GPU_NAME-bench-plan.json, $GPU_NAME-bench-chain.json
# Then `python3 scripts/make_benchmarks.py` regenerates BENCHMARKS.md and the
# README's table from the records.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
RESULTS=${RESULTS:-bench/results}; GPU_NAME=${GPU_NAME:-h200}
mkdir -p "$RESULTS"
stages=${*:-tests sanitize bench}
status=0
for stage in $stages; do
  case $stage in
    tests)
      reports=$(mktemp -d)
      # the modules side by side (correctness does not mind a shared GPU;
      # compiling is CPU-bound), each in its own process and time limit
      for module in tests/test_gpu_*.py; do
        name=$(basename "$module" .py)
        ( timeout -k 5 "${TEST_LIMIT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider \
            --junitxml "$reports/$name.xml" "$module" > "$reports/$name.log" 2>&1
          echo $? > "$reports/$name.rc" ) &
      done
      wait
      for log in "$reports"/*.log; do
        echo "$(basename "$log" .log): $(tail -1 "$log")"
        [ "$(cat "${log%.log}.rc")" = 0 ] || status=1
      done
      python3 scripts/gpu_record.py tests "$reports" \
        --command "bash scripts/gpu_check.sh tests" --out "$RESULTS/$GPU_NAME-gpu-tests.json" ;;
    sanitize)
      logs=$(mktemp -d)
      SUBSET=shipped SHARDS=${SHARDS:-4} LOGS_DIR=$logs/logs OUT=$logs bash scripts/sanitize.sh \
        || status=1
      python3 scripts/gpu_record.py sanitizer "$logs/logs" \
        --command "bash scripts/gpu_check.sh sanitize" --out "$RESULTS/$GPU_NAME-sanitizer.json" ;;
    bench)
      python3 -m warpsplitk.cli bench --plan h200 --m 1,4,8,16,32 \
        --json "$RESULTS/$GPU_NAME-bench-plan.json" --plot docs/bench-$GPU_NAME.png || status=1
      python3 -m warpsplitk.cli bench --plan h200 --m 1,4,8,16,32 --chain \
        --json "$RESULTS/$GPU_NAME-bench-chain.json" || status=1 ;;
    *) echo "gpu_check.sh: unknown stage '$stage' (tests, sanitize, bench)" >&2; exit 2 ;;
  esac
done
exit $status
