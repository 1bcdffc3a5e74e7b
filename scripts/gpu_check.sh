#!/usr/bin/env bash
# The GPU check, on a machine with a CUDA GPU, from the repository root:
#   bash scripts/gpu_check.sh [tests] [sanitize] [bench] [default] [layer]   (default: all)
#   (or any of default's stages: heldout, layers, tuned, quick)
# writes its records into $RESULTS (default bench/results), named for the GPU
# ($GPU_NAME, default its model: h200, h100, b200; warpsplitk.runtime.timing.record_name):
#   tests     every GPU test module (pytest -m gpu), side by side, each in its
#             own process with its own time limit ($TEST_LIMIT s, default 600: test_gpu_kernel alone takes 5-6 min on an H200);
#             $TESTS names a subset of the modules (default: all)
#             -> $GPU_NAME-gpu-tests.json
#   sanitize  compute-sanitizer memcheck, racecheck, synccheck and initcheck
#             over every tactic of the built-in plan and the default
#             heuristic (scripts/sanitize.sh, SUBSET=shipped), and those
#             again with the SwiGLU epilogue (SWIGLU=1)
#             -> $GPU_NAME-sanitizer.json, $GPU_NAME-sanitizer-swiglu.json
#   bench     the built-in plan over the shape table x M 1,4,8,16,32 and its
#             dependent chains, against cuBLAS, with the plot
#             -> $GPU_NAME-bench-plan.json, $GPU_NAME-bench-chain.json
#   default   the four stages below, each short enough for one 10-minute job:
#     heldout   the default (no plan) on the shapes held out of the cost
#               model's fit -> $GPU_NAME-bench-heldout.json
#     layers    their layers as dependent chains -> $GPU_NAME-bench-layers.json
#     tuned     the default against a quick tune of eight of those shapes
#               -> $GPU_NAME-bench-heldout-tuned.json
#     quick     the quick tune against the exhaustive one, plan="auto" start
#               times -> $GPU_NAME-tune-quick.json
#   layer     one decode layer's GEMM path (bench --layer: merged with the
#             SwiGLU epilogue, unmerged, cuBLAS) of Llama-3-8B and of a
#             Llama-3-70B TP-8 rank, M 1, 8, 32
#             -> $GPU_NAME-bench-layer-path.json
# Then `python3 scripts/make_benchmarks.py` regenerates BENCHMARKS.md and the
# README's table from the records.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
# every stage needs the GPU, and an H100's or B200's records must not replace the H200's
gpu=$(python3 -c 'import torch, warpsplitk.runtime.timing as t
print(t.record_name(torch.cuda.get_device_name()) if torch.cuda.is_available() else "")' \
  2>/dev/null)
if [ -z "$gpu" ]; then
  echo "gpu_check.sh: torch sees no CUDA GPU; the checks run on one" >&2
  exit 2
fi
RESULTS=${RESULTS:-bench/results}; GPU_NAME=${GPU_NAME:-$gpu}
mkdir -p "$RESULTS"
stages=${*:-tests sanitize bench default layer}
stages=$(echo " $stages " | sed 's/ default / heldout layers tuned quick /g')
status=0
for stage in $stages; do
  case $stage in
    tests)
      reports=$(mktemp -d)
      # the modules side by side (correctness does not mind a shared GPU;
      # compiling is CPU-bound), each in its own process and time limit
      for module in ${TESTS:-tests/test_gpu_*.py}; do
        name=$(basename "$module" .py)
        ( timeout -k 5 "${TEST_LIMIT:-600}" python3 -m pytest -q -m gpu -p no:cacheprovider \
            --junitxml "$reports/$name.xml" "$module" > "$reports/$name.log" 2>&1
          echo $? > "$reports/$name.rc" ) &
      done
      wait
      for log in "$reports"/*.log; do
        echo "$(basename "$log" .log): $(tail -1 "$log")"
        if [ "$(cat "${log%.log}.rc")" != 0 ]; then status=1; tail -40 "$log"; fi
      done
      python3 scripts/gpu_record.py tests "$reports" \
        --command "${TESTS:+TESTS=\"$TESTS\" }bash scripts/gpu_check.sh tests" \
        --out "$RESULTS/$GPU_NAME-gpu-tests.json" ;;
    sanitize)
      logs=$(mktemp -d)
      SUBSET=shipped SHARDS=${SHARDS:-4} LOGS_DIR=$logs/logs OUT=$logs bash scripts/sanitize.sh \
        || status=1
      python3 scripts/gpu_record.py sanitizer "$logs/logs" \
        --command "bash scripts/gpu_check.sh sanitize" --out "$RESULTS/$GPU_NAME-sanitizer.json"
      SWIGLU=1 SUBSET=shipped SHARDS=${SHARDS:-4} LOGS_DIR=$logs/swiglu OUT=$logs/swiglu-out \
        bash scripts/sanitize.sh || status=1
      python3 scripts/gpu_record.py sanitizer "$logs/swiglu" \
        --command "bash scripts/gpu_check.sh sanitize (SWIGLU=1)" \
        --out "$RESULTS/$GPU_NAME-sanitizer-swiglu.json" ;;
    bench)
      python3 -m warpsplitk.cli bench --plan h200 --m 1,4,8,16,32 \
        --json "$RESULTS/$GPU_NAME-bench-plan.json" --plot docs/bench-$GPU_NAME.png || status=1
      python3 -m warpsplitk.cli bench --plan h200 --m 1,4,8,16,32 --chain \
        --json "$RESULTS/$GPU_NAME-bench-chain.json" || status=1 ;;
    heldout)
      python3 -m warpsplitk.cli bench --plan none --m 1,4,8,16,32 \
        --shapes $(python3 scripts/fit_cost_model.py --held-out-shapes) \
        --json "$RESULTS/$GPU_NAME-bench-heldout.json" || status=1 ;;
    layers)
      layers=$(mktemp -d)
      for shard in "gemma-3-12b 1" "gemma-3-12b 8" "llama-3.2-3b 1" "llama-3.2-3b 4" \
                   "qwen3-4b 2" "gemma-2-27b 4"; do
        set -- $shard
        python3 -m warpsplitk.cli bench --plan none --m 1,8,32 --model "$1" --tp "$2" --chain \
          --json "$layers/$1-tp$2.json" || status=1
      done
      python3 scripts/gpu_record.py layers "$layers" \
        --command "bash scripts/gpu_check.sh layers" --out "$RESULTS/$GPU_NAME-bench-layers.json" ;;
    tuned)
      # eight held-out shapes of 9-170 MB: attention and MLP of each model
      tuned=$(mktemp -d)
      held="8192,3840 3840,15360 5120,3072 3072,8192 2560,2048 9728,2560 4608,1024 18432,4608"
      WARPSPLITK_CACHE_DIR=$tuned/cache python3 -m warpsplitk.cli tune --shapes $held \
        --m 1,4,8,16,32 -o "$tuned/plan.json" --log "$tuned/log.jsonl" || status=1
      python3 -m warpsplitk.cli bench --plan "$tuned/plan.json" --shapes $held --m 1,4,8,16,32 \
        --json "$RESULTS/$GPU_NAME-bench-heldout-tuned.json" || status=1 ;;
    quick)
      python3 scripts/quick_tune_record.py "$RESULTS/$GPU_NAME-tune-quick.json" || status=1 ;;
    layer)
      paths=$(mktemp -d)
      for shard in "llama-3-8b 1" "llama-3-70b 8"; do
        set -- $shard
        python3 -m warpsplitk.cli bench --model "$1" --tp "$2" --layer --m 1,8,32 \
          --json "$paths/$1-tp$2.json" || status=1
      done
      python3 scripts/gpu_record.py layer-paths "$paths" --command "bash scripts/gpu_check.sh layer" \
        --out "$RESULTS/$GPU_NAME-bench-layer-path.json" ;;
    *) echo "gpu_check.sh: unknown stage '$stage' (tests, sanitize, bench, default, heldout," \
            "layers, tuned, quick, layer)" >&2
       exit 2 ;;
  esac
done
exit $status
