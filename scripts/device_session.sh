#!/usr/bin/env bash
# Device calls, one stage per call (each fits the 10-minute limit), logs and
# JSON to $OUT. From the repo root, with the CuTe DSL bundle active:
#   source .gpu-bundle/activate.sh && bash scripts/device_session.sh STAGE
# Stages:
#   tests   every gpu-marked test (kernel, reliability, torch integration),
#           determinism across two processes, a short graph soak
#   tune    resume the tuner from the committed log over the whole table,
#           then the benchmark (independent and chain) with that plan
#   checks  compute-sanitizer (4 tools), the long soak, the Llama example,
#           cold and warm start of the 16-shape table
#   verify  'tests' and the correctness half of 'checks' in one call: the GPU
#           tests, compute-sanitizer and the 100k soak side by side, then
#           (alone on the GPU) host overhead, determinism and the Llama example
set -u
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt"
stage=${1:-tests}

case "$stage" in
tests)
  # one pytest per GPU test module, side by side: compiling is CPU-bound and
  # the machine has 16 cores; correctness tests do not mind sharing the GPU
  for module in gpu_kernel gpu_reliability gpu_linear gpu_llama; do
    timeout ${TESTS_LIMIT:-330} python3 -m pytest -q -m gpu "tests/test_$module.py" \
      > "$OUT/$module.log" 2>&1 &
  done
  wait
  for module in gpu_kernel gpu_reliability gpu_linear gpu_llama; do
    echo "$module: $(tail -1 "$OUT/$module.log")"
  done
  timeout 45 python3 scripts/host_overhead.py --json "$OUT/host-overhead.json" \
    > "$OUT/host-overhead.log" 2>&1
  echo "host overhead rc=$?"; cat "$OUT/host-overhead.log" | tail -4
  for i in 1 2; do timeout 45 python3 scripts/reliability.py digest; done > "$OUT/digest.log" 2>&1
  echo "digests: $(sort -u "$OUT/digest.log" | wc -l) distinct of $(wc -l < "$OUT/digest.log")"
  timeout 60 python3 scripts/reliability.py soak --replays ${SOAK_REPLAYS:-20000} \
    --check-every 5000 --json "$OUT/soak.json" > "$OUT/soak.log" 2>&1
  echo "soak rc=$? $(tail -1 "$OUT/soak.log")"
  grep -hE "^(FAILED|ERROR)" "$OUT"/gpu_*.log | head -20
  ;;
tune)
  cp docs/gpu-runs/2026-12-02-tune-log.jsonl "$OUT/tune-log.jsonl" 2>/dev/null
  timeout ${TB_LIMIT:-480} python3 scripts/tune_and_bench.py --out "$OUT" \
    --tune-budget ${TUNE_BUDGET:-300} > "$OUT/tune-bench.log" 2>&1
  echo "tune+bench rc=$?"
  timeout 90 python3 -m warpsplitk.cli bench --chain --m 1,8,32 --plan "$OUT/plan-h200.json" \
    --json "$OUT/chain.json" > "$OUT/chain.log" 2>&1
  echo "chain rc=$?"
  grep -E "candidates to|time budget|tuned in|dropped" "$OUT/tune-bench.log" | head -12
  grep -A84 "ours us" "$OUT/tune-bench.log"
  cat "$OUT/chain.log"
  ;;
checks)
  timeout ${SANITIZER_LIMIT:-300} bash scripts/sanitize.sh
  echo "sanitizer rc=$?"
  timeout 120 python3 scripts/reliability.py soak --replays 100000 --json "$OUT/soak-100k.json" \
    > "$OUT/soak-100k.log" 2>&1
  echo "soak 100k rc=$? $(tail -1 "$OUT/soak-100k.log")"
  timeout 150 python3 examples/llama_decode.py --batch 1 8 32 --json "$OUT/llama.json" \
    > "$OUT/llama.log" 2>&1
  echo "llama rc=$?"; tail -15 "$OUT/llama.log"
  for run in cold warm; do
    timeout 120 python3 scripts/cold_start.py --json "$OUT/start-$run.json" 2>&1 | tail -1
  done
  ;;
verify)
  LIMIT=${PHASE1_LIMIT:-300}
  # -rP: the captured prints of passed tests too (the error per K, run 2026-12-02 onwards)
  for module in gpu_kernel gpu_reliability gpu_linear gpu_llama; do
    timeout -k 5 $LIMIT python3 -m pytest -q -rP -m gpu "tests/test_$module.py" > "$OUT/$module.log" 2>&1 &
  done
  CASE_LIMIT=$LIMIT bash scripts/sanitize.sh > "$OUT/sanitizer.log" 2>&1 &
  timeout -k 5 $LIMIT python3 scripts/reliability.py soak --replays 100000 \
    --json "$OUT/soak-100k.json" > "$OUT/soak-100k.log" 2>&1 &
  wait
  for module in gpu_kernel gpu_reliability gpu_linear gpu_llama; do
    echo "$module: $(tail -1 "$OUT/$module.log")"
  done
  grep -A30 "relative error vs fp64" "$OUT/gpu_reliability.log" | grep "K=" | head -20
  cat "$OUT/sanitizer.log"
  echo "soak 100k: $(tail -1 "$OUT/soak-100k.log")"
  timeout 40 python3 scripts/host_overhead.py --json "$OUT/host-overhead.json" \
    > "$OUT/host-overhead.log" 2>&1
  echo "host overhead rc=$?"; tail -4 "$OUT/host-overhead.log"
  for i in 1 2; do timeout 35 python3 scripts/reliability.py digest; done > "$OUT/digest.log" 2>&1
  echo "digests: $(sort -u "$OUT/digest.log" | wc -l) distinct of $(wc -l < "$OUT/digest.log")"
  timeout 140 python3 examples/llama_decode.py --batch 1 8 32 --json "$OUT/llama.json" \
    > "$OUT/llama.log" 2>&1
  echo "llama rc=$?"; tail -12 "$OUT/llama.log"
  grep -hE "^(FAILED|ERROR)" "$OUT"/gpu_*.log | head -20
  ;;
sanitize)
  # compute-sanitizer alone (TOOLS, SHARDS as scripts/sanitize.sh), beside the
  # reliability tests; prints the report's head
  timeout -k 5 ${PHASE1_LIMIT:-300} python3 -m pytest -q -m gpu tests/test_gpu_reliability.py \
    > "$OUT/gpu_reliability.log" 2>&1 &
  CASE_LIMIT=${PHASE1_LIMIT:-300} bash scripts/sanitize.sh
  echo "sanitizer rc=$?"
  wait
  echo "gpu_reliability: $(tail -1 "$OUT/gpu_reliability.log")"
  head -c 9000 "$OUT/sanitizer-report.txt"
  ;;
*)
  echo "unknown stage $stage (tests | tune | checks | verify | sanitize)"; exit 2 ;;
esac
