#!/usr/bin/env bash
# Device calls, one stage per call (each fits the 10-minute limit), logs and
# JSON to $OUT. From the repo root, with the CuTe DSL bundle active:
#   source .gpu-bundle/activate.sh && bash scripts/device_session.sh STAGE
# Stages:
#   tests   every gpu-marked test (kernel, reliability, torch integration),
#           determinism across two processes, a short graph soak
#   tune    resume the tuner from the committed log over the whole table
#           (several calls: commit the log back between them)
#   bench   the plan the committed log gives; cold and warm start of the
#           table with it; the benchmark (independent and chain) with it
#   checks  compute-sanitizer (4 tools), the long soak, the Llama example,
#           cold and warm start of the 16-shape table
#   ab      two builds timed side by side (scripts/build_ab.py; COMPARE=
#           pdl-trigger, the default, or release)
#   verify  'tests' and the correctness half of 'checks' in one call: the GPU
#           tests, compute-sanitizer (also with the cluster split of K) and
#           the 100k soak side by side, then (alone on the GPU) host
#           overhead, determinism and the early PDL trigger's speed
#   plan-check  the torch integration and Llama tests (the shipped plan's
#           kernels) beside racecheck over the activation multicast
#   multicast  the activation multicast's per-warp stage release: its GPU
#           tests and an A/B against the per-lane release
#   pdl     what PDL and its griddepcontrol.wait cost independent calls
#           (scripts/build_ab.py --compare pdl, plan tactics)
#   llama   the Llama example's accuracy and decode-step timing
#   narrow  narrow token tiles: their GPU tests beside the sanitizer over them
#   fence   the release fence of TMA/bulk activation rings: their kernel tests,
#           the cases that raced and the reliability module side by side,
#           then the shipped plan's benchmark alone (FENCE_AB=1: also with the
#           experimental fences, uni-directional and loader-side, and none)
#   narrow-bulk  narrow token tiles with bulk rows (refused runs 45-65):
#           their GPU tests and the random legal tactics beside the
#           sanitizer over every such case; their stress alone; then the
#           tuner at M 1-4 (their twins, resuming the committed log) and the
#           bench of the plan its log gives
#   racecheck-rest  what verify's limits cut (run 63): racecheck alone over
#           the cluster split of K and over the bulk/prefetch rotations (early
#           trigger), beside every multicast GPU test and the narrow-tile
#           kernel tests (bulk rows among them)
#   x-smem  how much of the time after the dependency wait is the
#           activations' shared-memory traffic (scripts/build_ab.py
#           --compare x-smem, plan tactics with 16-byte copies, XSMEM_M)
#   x-bytes fewer x bytes per SM at M >= 16 (NOTES, "What x costs after the
#           release"): the tuner with --k-split-4 (wider tiles, K split in
#           four) at M 16-32 on the cells x-smem said would gain, resuming
#           the committed log; the bench of its log's plan at M 16 and 32;
#           then the table minimum's two tactics side by side
#           (4608x1536 M=32: the plan's and 64,32,128,9,1+early+prefetch+tma)
#   split-mbarrier the K split's mbarrier hand-over: GPU tests, sanitizer,
#           the A/B against the protocol before, the tuner on the shapes
#           whose plan splits K, and the bench of its log's plan
#   split-vector the K split's experimental vector hand-over: GPU tests and
#           sanitizer with it, and the split-reduce A/B
#   resume  the tuner resumed from the committed log (TUNE_FLAGS), the plan
#           of its log and its bench
#   split-reduce what a K split's reduction costs (build_ab.py --compare
#           split-reduce): the tactic as built, its partials kept local,
#           no cluster at all, on the K-split tactics of the cells near the
#           median and of the M = 32 cells
#   deep    rings deep enough to need the reduction buffer over them: their
#           GPU tests beside the sanitizer over every such family, then the
#           tuner (resuming the committed log) and the bench on its log
#
# EARLY_LAUNCH=1 runs any stage on the experimental early PDL trigger build
# (WARPSPLITK_EARLY_LAUNCH, docs/NOTES.md), e.g. verify + bench before it ships.
#
# At most 8 files come back from a device call's $OUT: the stages write into
# a scratch folder, and on exit everything is packed into $OUT/STAGE.tar.gz,
# with up to PACK_JSON (6) of the JSON results copied beside it.
set -u
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
[ -n "${EARLY_LAUNCH:-}" ] && export WARPSPLITK_EARLY_LAUNCH=$EARLY_LAUNCH
stage=${1:-tests}
RESULTS=${OUT:-/tmp/out}; mkdir -p "$RESULTS"
OUT=$(mktemp -d); export OUT
pack() {
  tar -czf "$RESULTS/$stage.tar.gz" -C "$OUT" .
  find "$OUT" -maxdepth 2 -name "*.json" | head -${PACK_JSON:-6} | xargs -r cp -t "$RESULTS"
}
trap pack EXIT
# summarise NAME...: for each $OUT/NAME.log, its last line (pytest's count,
# or for sanitizer-* logs the per-tool summaries), then every test failure
# resume the tuner from the committed log for TUNE_BUDGET s ($1: more tune
# flags), then the plan its log gives ($2: more `tune --from-log` flags) and
# its benchmark ($3: more bench flags)
tune_plan_bench() {
  cp docs/gpu-runs/2026-12-02-tune-log.jsonl "$OUT/tune-log.jsonl"
  timeout ${TUNE_LIMIT:-200} python3 -m warpsplitk.cli tune --log "$OUT/tune-log.jsonl" \
    --time-budget ${TUNE_BUDGET:-160} ${1:-} -o "$OUT/plan-part.json" > "$OUT/tune.log" 2>&1
  echo "tune rc=$? ($(wc -l < "$OUT/tune-log.jsonl") log records)"
  grep -E "fastest" "$OUT/tune.log" | tail -40
  python3 -m warpsplitk.cli tune --from-log ${2:-} --log "$OUT/tune-log.jsonl" \
    --gpu "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" --sm-count 132 \
    -o "$OUT/plan.json"
  timeout ${BENCH_LIMIT:-120} python3 -m warpsplitk.cli bench --plan "$OUT/plan.json" ${3:-} \
    --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; python3 scripts/bench_tables.py "$OUT/bench.json" 2>/dev/null | head -3
}
summarise() {
  local name
  for name in "$@"; do echo "$name: $(cut -c1-900 "$OUT/$name.log" | tail -${SUMMARY_LINES:-1})"; done
  for name in "$@"; do grep -hE "^(FAILED|ERROR)" "$OUT/$name.log"; done | head -20
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt"

case "$stage" in
tests)
  # one pytest per GPU test module, side by side: compiling is CPU-bound and
  # the machine has 16 cores; correctness tests do not mind sharing the GPU
  for module in gpu_kernel gpu_reliability gpu_linear gpu_llama gpu_k_split gpu_x_multicast; do
    timeout ${TESTS_LIMIT:-330} python3 -m pytest -q -m gpu "tests/test_$module.py" \
      > "$OUT/$module.log" 2>&1 &
  done
  wait
  for module in gpu_kernel gpu_reliability gpu_linear gpu_llama gpu_k_split gpu_x_multicast; do
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
  # TUNE_FLAGS: more `warpsplitk tune` flags (e.g. --no-k-split)
  # resume the tuner from the committed log over the whole table (largest
  # first) for TUNE_BUDGET seconds; commit tune-log.jsonl (in tune.tar.gz) back as
  # docs/gpu-runs/2026-12-02-tune-log.jsonl, then run it again until no shape
  # is left, then 'bench'
  cp docs/gpu-runs/2026-12-02-tune-log.jsonl "$OUT/tune-log.jsonl"
  # a shape takes up to ~90 s: start none after TUNE_BUDGET; the log is
  # flushed per candidate, so even a timeout loses at most one measurement
  timeout ${TUNE_LIMIT:-570} python3 -m warpsplitk.cli tune --log "$OUT/tune-log.jsonl" \
    --time-budget ${TUNE_BUDGET:-450} ${TUNE_FLAGS:-} -o "$OUT/plan-run.json" > "$OUT/tune.log" 2>&1
  echo "tune rc=$? ($(wc -l < "$OUT/tune-log.jsonl") log records)"
  cp "$OUT/tune-log.jsonl" "$RESULTS/"  # for a 'bench' in the same call: TUNE_LOG=$OUT/tune-log.jsonl
  grep -E "candidates to|fastest|dropped" "$OUT/tune.log" | tail -40
  ;;
bench)
  # the plan the committed log gives, then the benchmark with it and chains
  # TUNE_LOG: another log than the committed one (a 'tune' earlier in the same call)
  # PLAN_FLAGS: more `tune --from-log` flags (e.g. --narrow-tiles)
  python3 -m warpsplitk.cli tune --from-log ${PLAN_FLAGS:-} --log "${TUNE_LOG:-docs/gpu-runs/2026-12-02-tune-log.jsonl}" \
    --gpu "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
    --sm-count "$(python3 -c 'import torch; print(torch.cuda.get_device_properties(0).multi_processor_count)')" \
    -o "$OUT/plan-h200.json"
  # preparing the whole table with that plan: cold (empty disk cache, the
  # kernels compiled in parallel worker processes), then warm (all loaded);
  # the benchmark then loads its plan kernels from the same cache
  export WARPSPLITK_CACHE_DIR=$(mktemp -d)
  for run in cold warm; do
    [ -n "${SKIP_START:-}" ] && break  # SKIP_START=1: no start-time measurement
    timeout 150 python3 scripts/cold_start.py --plan "$OUT/plan-h200.json" \
      --json "$OUT/start-$run.json" 2>&1 | tail -1
  done
  timeout ${BENCH_LIMIT:-420} python3 -m warpsplitk.cli bench --plan "$OUT/plan-h200.json" \
    --json "$OUT/bench.json" --plot "$OUT/bench-h200.png" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"
  timeout ${CHAIN_LIMIT:-120} python3 -m warpsplitk.cli bench --chain --m 1,8,32 --plan "$OUT/plan-h200.json" \
    --json "$OUT/chain.json" > "$OUT/chain.log" 2>&1
  echo "chain rc=$?"
  tail -90 "$OUT/bench.log"
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
  export WARPSPLITK_CACHE_DIR=$(mktemp -d)
  for run in cold warm; do
    timeout 120 python3 scripts/cold_start.py --json "$OUT/start-$run.json" 2>&1 | tail -1
  done
  ;;
verify)
  LIMIT=${PHASE1_LIMIT:-300}
  # -rP: the captured prints of passed tests too (the error per K, run 2026-12-02 onwards)
  for module in gpu_reliability gpu_linear gpu_llama; do
    timeout -k 5 $LIMIT python3 -m pytest -q -rP -m gpu "tests/test_$module.py" > "$OUT/$module.log" 2>&1 &
  done
  # the experimental cluster split alone, shorter limit: a barrier fault hangs
  timeout -k 5 ${K_SPLIT_LIMIT:-150} python3 -m pytest -q -m gpu tests/test_gpu_k_split.py \
    > "$OUT/gpu_k_split.log" 2>&1 &
  # the kernel tests compile ~150 kernels: three processes (~280 s as one)
  for part in "default_tactics" "random_legal" "not (default_tactics or random_legal)"; do
    timeout -k 5 $LIMIT python3 -m pytest -q -m gpu tests/test_gpu_kernel.py -k "$part" \
      > "$OUT/gpu_kernel-${part//[^a-z]/_}.log" 2>&1 &
  done
  CASE_LIMIT=$LIMIT bash scripts/sanitize.sh > "$OUT/sanitizer.log" 2>&1 &
  # the cluster split of K under the sanitizer too (every family's k_split
  # 2; one ring variant each), and the activation multicast (x_multicast 2
  # to 4) without racecheck, in which its ring refills never finish (runs
  # 20, 23: it would time out the k_split cases with it)
  OUT=$OUT/clusters K_SPLIT=1 SUBSET=rotate CASE_LIMIT=$LIMIT \
    bash scripts/sanitize.sh > "$OUT/sanitizer-clusters.log" 2>&1 &
  OUT=$OUT/multicast X_MULTICAST=1 CLUSTERS_ONLY=1 TOOLS="memcheck synccheck initcheck" \
    SUBSET=rotate CASE_LIMIT=$LIMIT bash scripts/sanitize.sh > "$OUT/sanitizer-multicast.log" 2>&1 &
  # the early PDL trigger (the shipped plan's "+early" tactics) under the
  # sanitizer too: every family built with it, one ring variant each
  WARPSPLITK_EARLY_LAUNCH=1 OUT=$OUT/early SUBSET=rotate CASE_LIMIT=$LIMIT \
    bash scripts/sanitize.sh > "$OUT/sanitizer-early.log" 2>&1 &
  # bulk activation copies and the L2 prefetch (the plan's "+bulk" and
  # "+prefetch"), also with k_split 2, built early as the plan mostly has them
  WARPSPLITK_EARLY_LAUNCH=1 OUT=$OUT/x-copies K_SPLIT=1 BULK_X=1 L2_PREFETCH=1 X_COPIES_ONLY=1 \
    SUBSET=rotate CASE_LIMIT=$LIMIT bash scripts/sanitize.sh > "$OUT/sanitizer-x-copies.log" 2>&1 &
  # the experimental activation multicast alone, short limit: a protocol
  # fault hangs
  timeout -k 5 ${MULTICAST_LIMIT:-150} python3 -m pytest -q -m gpu tests/test_gpu_x_multicast.py \
    > "$OUT/gpu_x_multicast.log" 2>&1 &
  timeout -k 5 $LIMIT python3 scripts/reliability.py soak --replays 100000 \
    --json "$OUT/soak-100k.json" > "$OUT/soak-100k.log" 2>&1 &
  wait
  for log in "$OUT"/gpu_*.log; do
    echo "$(basename "$log" .log): $(tail -1 "$log")"
  done
  grep -A30 "relative error vs fp64" "$OUT/gpu_reliability.log" | grep "K=" | head -20
  cat "$OUT/sanitizer.log"
  echo "with k_split 2: $(cut -c1-1200 "$OUT/sanitizer-clusters.log")"
  echo "x_multicast 2-4: $(cut -c1-900 "$OUT/sanitizer-multicast.log")"
  echo "early PDL trigger: $(cut -c1-1200 "$OUT/sanitizer-early.log")"
  echo "bulk_x, l2_prefetch: $(cut -c1-1200 "$OUT/sanitizer-x-copies.log")"
  echo "soak 100k: $(tail -1 "$OUT/soak-100k.log")"
  timeout 40 python3 scripts/host_overhead.py --json "$OUT/host-overhead.json" \
    > "$OUT/host-overhead.log" 2>&1
  echo "host overhead rc=$?"; tail -4 "$OUT/host-overhead.log"
  for i in 1 2; do timeout 35 python3 scripts/reliability.py digest; done > "$OUT/digest.log" 2>&1
  echo "digests: $(sort -u "$OUT/digest.log" | wc -l) distinct of $(wc -l < "$OUT/digest.log")"
  grep -hE "^(FAILED|ERROR)" "$OUT"/gpu_*.log | head -20
  ;;
plan-check)
  # the shipped plan's kernels in the torch integration and the Llama
  # example, beside racecheck over the activation multicast alone (slow
  # under racecheck: 8 shards, a progress line per case)
  for module in gpu_linear gpu_llama; do
    timeout -k 5 ${PHASE1_LIMIT:-200} python3 -m pytest -q -m gpu "tests/test_$module.py" \
      > "$OUT/$module.log" 2>&1 &
  done
  OUT=$OUT/multicast-racecheck TOOLS=racecheck SHARDS=8 X_MULTICAST=1 CLUSTERS_ONLY=1 \
    SUBSET=rotate CASE_LIMIT=${PHASE1_LIMIT:-200} bash scripts/sanitize.sh \
    > "$OUT/multicast-racecheck.log" 2>&1 &
  wait
  for log in "$OUT"/gpu_*.log; do echo "$(basename "$log" .log): $(tail -1 "$log")"; done
  cut -c1-1500 "$OUT/multicast-racecheck.log"
  echo "multicast cases started under racecheck: $(tar -xzOf "$OUT/multicast-racecheck/sanitizer-logs.tar.gz" \
    --wildcards '*.log' 2>/dev/null | grep -c '^case')"
  ;;
narrow-bulk)
  timeout -k 5 ${PHASE1_LIMIT:-150} python3 -m pytest -q -m gpu tests/test_gpu_kernel.py \
    -k "narrow or random_legal" > "$OUT/gpu_kernel-narrow.log" 2>&1 &
  OUT=$OUT/narrow-bulk NARROW_ONLY=1 BULK_X=1 X_COPIES_ONLY=1 K_SPLIT=1 SUBSET=rotate \
    CASE_LIMIT=${PHASE1_LIMIT:-150} bash scripts/sanitize.sh > "$OUT/sanitizer-narrow-bulk.log" 2>&1 &
  wait
  summarise gpu_kernel-narrow
  SUMMARY_LINES=4 summarise sanitizer-narrow-bulk
  # alone on the GPU: run 45's failing picks, many rounds (run 52's unfenced
  # races showed 26-153 wrong outputs in 40 rounds)
  { timeout ${STRESS_LIMIT:-50} python3 scripts/stress_tactics.py 2112,7168 1,2 \
      16,1,256,12,1+early+bulk --rounds ${ROUNDS:-150}
    timeout ${STRESS_LIMIT:-50} python3 scripts/stress_tactics.py 768,7168 1,3,4 \
      64,1,128,13,1+early+bulk 32,4,128,23,1+early+prefetch+bulk --rounds ${ROUNDS:-150}
  } > "$OUT/stress-narrow-bulk.log" 2>&1
  cat "$OUT/stress-narrow-bulk.log"
  TUNE_LIMIT=${TUNE_LIMIT:-180} TUNE_BUDGET=${TUNE_BUDGET:-150} tune_plan_bench "--m 1-4"
  ;;
x-smem)
  timeout ${XSMEM_LIMIT:-200} python3 scripts/build_ab.py --compare x-smem --tactics plan \
    --m ${XSMEM_M:-32} --json "$OUT/x-smem.json" > "$OUT/x-smem.log" 2>&1
  echo "x-smem rc=$?"; cat "$OUT/x-smem.log"
  ;;
split-mbarrier)
  # the K split's mbarrier hand-over (kernel revision 3): its GPU tests beside
  # the sanitizer over every family's split, then the A/B against the
  # cluster-barrier protocol before it, then the tuner re-measuring the
  # shapes whose plan splits K, and the bench of its log's plan
  LIMIT=${PHASE1_LIMIT:-150}
  timeout -k 5 $LIMIT python3 -m pytest -q -m gpu tests/test_gpu_k_split.py \
    > "$OUT/gpu_k_split.log" 2>&1 &
  OUT=$OUT/split K_SPLIT=1 CLUSTERS_ONLY=1 TOOLS="${SPLIT_TOOLS:-memcheck synccheck racecheck}" \
    SUBSET=rotate CASE_LIMIT=$LIMIT bash scripts/sanitize.sh > "$OUT/sanitizer-split.log" 2>&1 &
  wait
  summarise gpu_k_split
  SUMMARY_LINES=3 summarise sanitizer-split
  timeout ${SPLIT_LIMIT:-120} python3 scripts/build_ab.py --compare split-reduce \
    --json "$OUT/split-reduce.json" > "$OUT/split-reduce.log" 2>&1
  echo "split-reduce rc=$?"; cat "$OUT/split-reduce.log"
  TUNE_LIMIT=${TUNE_LIMIT:-230} TUNE_BUDGET=${TUNE_BUDGET:-190} tune_plan_bench \
    "--shapes ${SPLIT_SHAPES:-1536,7168 2112,7168 768,7168 2048,2048}"
  ;;
split-vector)
  # the K split's experimental vector hand-over (WARPSPLITK_SPLIT_REDUCE=
  # vector): its GPU tests beside the sanitizer over every family's split,
  # then the split-reduce A/B (every hand-over side by side); tune and bench
  # it with `WARPSPLITK_SPLIT_REDUCE=vector … resume` if it wins
  LIMIT=${PHASE1_LIMIT:-150}
  WARPSPLITK_SPLIT_REDUCE=vector timeout -k 5 $LIMIT python3 -m pytest -q -m gpu \
    tests/test_gpu_k_split.py > "$OUT/gpu_k_split-vector.log" 2>&1 &
  WARPSPLITK_SPLIT_REDUCE=vector OUT=$OUT/split K_SPLIT=1 CLUSTERS_ONLY=1 \
    TOOLS="${SPLIT_TOOLS:-memcheck synccheck racecheck}" SHARDS=${SHARDS:-4} SUBSET=rotate \
    CASE_LIMIT=$LIMIT bash scripts/sanitize.sh > "$OUT/sanitizer-split-vector.log" 2>&1 &
  wait
  summarise gpu_k_split-vector
  SUMMARY_LINES=3 summarise sanitizer-split-vector
  timeout ${SPLIT_LIMIT:-150} python3 scripts/build_ab.py --compare split-reduce \
    --json "$OUT/split-reduce.json" > "$OUT/split-reduce.log" 2>&1
  echo "split-reduce rc=$?"; cat "$OUT/split-reduce.log"
  ;;
resume)
  # the tuner resumed from the committed log with TUNE_FLAGS, the plan its
  # log gives and that plan's bench
  TUNE_LIMIT=${TUNE_LIMIT:-150} TUNE_BUDGET=${TUNE_BUDGET:-110} tune_plan_bench "${TUNE_FLAGS:-}"
  ;;
split-reduce)
  timeout ${SPLIT_LIMIT:-300} python3 scripts/build_ab.py --compare split-reduce \
    --json "$OUT/split-reduce.json" > "$OUT/split-reduce.log" 2>&1
  echo "split-reduce rc=$?"; cat "$OUT/split-reduce.log"
  ;;
racecheck-rest)
  LIMIT=${PHASE1_LIMIT:-420}
  OUT=$OUT/clusters K_SPLIT=1 CLUSTERS_ONLY=1 TOOLS=racecheck SUBSET=rotate CASE_LIMIT=$LIMIT \
    bash scripts/sanitize.sh > "$OUT/racecheck-clusters.log" 2>&1 &
  WARPSPLITK_EARLY_LAUNCH=1 OUT=$OUT/x-copies K_SPLIT=1 BULK_X=1 L2_PREFETCH=1 X_COPIES_ONLY=1 \
    TOOLS=racecheck SUBSET=rotate CASE_LIMIT=$LIMIT \
    bash scripts/sanitize.sh > "$OUT/racecheck-x-copies.log" 2>&1 &
  timeout -k 5 $LIMIT python3 -m pytest -q -m gpu tests/test_gpu_x_multicast.py \
    > "$OUT/gpu_x_multicast.log" 2>&1 &
  timeout -k 5 $LIMIT python3 -m pytest -q -m gpu tests/test_gpu_kernel.py -k narrow_token_tiles \
    > "$OUT/gpu_kernel-narrow.log" 2>&1 &
  wait
  summarise gpu_x_multicast gpu_kernel-narrow
  SUMMARY_LINES=2 summarise racecheck-clusters racecheck-x-copies
  ;;
x-bytes)
  TUNE_LIMIT=${TUNE_LIMIT:-260} TUNE_BUDGET=${TUNE_BUDGET:-220} tune_plan_bench \
    "--k-split-4 --m 16-32 --shapes ${XBYTES_SHAPES:-2304,1536 7168,384 2048,2048 4608,1536 768,7168 2624,6144 2112,7168}" \
    --k-split-4 "--m 16,32"
  # the table minimum: the shipped plan as is, and with the other tactic at M 25-32
  python3 - "$OUT/plan-min.json" <<'PY'
import json, sys
plan = json.load(open("src/warpsplitk/data/plan-h200.json"))
for shape in plan["shapes"]:
    if (shape["n"], shape["k"]) == (4608, 1536):
        for m in range(25, 33):
            shape["entries"][str(m)] = {"tactic": "64,32,128,9,1+early+prefetch+tma", "us": None}
json.dump(plan, open(sys.argv[1], "w"))
PY
  for which in shipped min; do
    plan=h200; [ $which = min ] && plan="$OUT/plan-min.json"
    timeout 60 python3 -m warpsplitk.cli bench --plan "$plan" --shapes 4608,1536 --m 32 --rounds 5 \
      --json "$OUT/bench-min-$which.json" > "$OUT/bench-min-$which.log" 2>&1
    python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; \
print(sys.argv[2], r['tactic'], r['ours_us'], r['ours_spread'], r['cublas_us'], r['speedup'])" \
      "$OUT/bench-min-$which.json" $which
  done
  ;;
deep)
  timeout -k 5 ${PHASE1_LIMIT:-200} python3 -m pytest -q -m gpu tests/test_gpu_kernel.py \
    -k over_the_rings > "$OUT/gpu_kernel-deep.log" 2>&1 &
  OUT=$OUT/deep DEEP_RINGS=1 ALIASED_ONLY=1 BULK_X=1 CASE_LIMIT=${PHASE1_LIMIT:-200} \
    bash scripts/sanitize.sh > "$OUT/sanitizer-deep.log" 2>&1 &
  wait
  echo "gpu_kernel (deep rings): $(tail -1 "$OUT/gpu_kernel-deep.log")"
  echo "sanitizer (deep rings): $(cut -c1-1200 "$OUT/sanitizer-deep.log")"
  grep -hE "^(FAILED|ERROR)" "$OUT"/gpu_kernel-deep.log | head
  ;;
tma)
  # TMA activation boxes (tma_x): the GPU tests (kernel cases, the random
  # legal tactics, the multicast module with the TMA multicast) beside the
  # sanitizer over every one-warp family with them (k_split 2 too; and the
  # TMA multicast, racecheck included), then the A/B on the plan's tactics
  timeout -k 5 ${PHASE1_LIMIT:-150} python3 -m pytest -q -m gpu tests/test_gpu_kernel.py \
    -k "tma or random_legal" > "$OUT/gpu_kernel-tma.log" 2>&1 &
  timeout -k 5 ${MULTICAST_LIMIT:-150} python3 -m pytest -q -m gpu tests/test_gpu_x_multicast.py \
    > "$OUT/gpu_x_multicast.log" 2>&1 &
  OUT=$OUT/tma TMA_X=1 K_SPLIT=1 X_COPIES_ONLY=1 SUBSET=rotate CASE_LIMIT=${PHASE1_LIMIT:-150} \
    bash scripts/sanitize.sh > "$OUT/sanitizer-tma.log" 2>&1 &
  OUT=$OUT/tma-multicast TMA_X=1 X_MULTICAST=1 CLUSTERS_ONLY=1 X_COPIES_ONLY=1 SUBSET=rotate \
    CASE_LIMIT=${PHASE1_LIMIT:-150} bash scripts/sanitize.sh > "$OUT/sanitizer-tma-multicast.log" 2>&1 &
  wait
  summarise gpu_kernel-tma gpu_x_multicast
  SUMMARY_LINES=8 summarise sanitizer-tma sanitizer-tma-multicast
  timeout ${AB_LIMIT:-280} python3 scripts/build_ab.py --compare tma --tactics plan \
    --m ${AB_MS:-1,8,32} --json "$OUT/tma-ab.json" > "$OUT/tma-ab.log" 2>&1
  echo "tma A/B rc=$?"; tail -30 "$OUT/tma-ab.log"
  ;;
mixed)
  # mixed grids (half_tiles): the GPU tests beside the sanitizer over every
  # 32/64-row case as a mixed grid (TMA boxes too); the tuner measures their
  # twins by default ('tune')
  timeout -k 5 ${PHASE1_LIMIT:-150} python3 -m pytest -q -m gpu tests/test_gpu_kernel.py \
    -k mixed > "$OUT/gpu_kernel-mixed.log" 2>&1 &
  OUT=$OUT/mixed HALF_TILES=1 TMA_X=1 X_COPIES_ONLY=1 SUBSET=rotate \
    CASE_LIMIT=${PHASE1_LIMIT:-150} bash scripts/sanitize.sh > "$OUT/sanitizer-mixed.log" 2>&1 &
  wait
  summarise gpu_kernel-mixed
  SUMMARY_LINES=8 summarise sanitizer-mixed
  ;;
narrow)
  # narrow token tiles (1, 2, 4 rows), the split of K in four and the
  # bounded L2 prefetch: their GPU tests and the random legal tactics
  # (narrow and bounded-prefetch ones among them) beside the
  # sanitizer over every narrow case (with bulk rows, the cluster split of
  # K and mixed grids too) and every k_split 4 case
  timeout -k 5 ${PHASE1_LIMIT:-150} python3 -m pytest -q -m gpu tests/test_gpu_kernel.py \
    -k "narrow or random_legal or deeper_than_16 or l2_prefetch or back_to_back" > "$OUT/gpu_kernel-narrow.log" 2>&1 &
  timeout -k 5 ${PHASE1_LIMIT:-150} python3 -m pytest -q -m gpu tests/test_gpu_k_split.py \
    > "$OUT/gpu_k_split.log" 2>&1 &
  OUT=$OUT/narrow NARROW_ONLY=1 K_SPLIT=1 BULK_X=1 HALF_TILES=1 SUBSET=rotate \
    CASE_LIMIT=${PHASE1_LIMIT:-150} bash scripts/sanitize.sh > "$OUT/sanitizer-narrow.log" 2>&1 &
  OUT=$OUT/split4 SPLIT_FOUR_ONLY=1 K_SPLIT=1 SUBSET=rotate \
    CASE_LIMIT=${PHASE1_LIMIT:-150} bash scripts/sanitize.sh > "$OUT/sanitizer-split4.log" 2>&1 &
  # rings past 16 stages (narrow tiles and 16-row 8-token stages reach them)
  OUT=$OUT/past16 DEEP_RINGS=1 PAST_16_ONLY=1 BULK_X=1 SUBSET=rotate \
    CASE_LIMIT=${PHASE1_LIMIT:-150} bash scripts/sanitize.sh > "$OUT/sanitizer-past16.log" 2>&1 &
  wait
  summarise gpu_kernel-narrow gpu_k_split
  SUMMARY_LINES=8 summarise sanitizer-narrow sanitizer-split4 sanitizer-past16
  ;;
multicast)
  # the activation multicast with one remote stage release per warp
  # (WARPSPLITK_THREAD_ARRIVE=lane0) against one per lane: GPU tests of the
  # lane-0 build, then both timed on the multicast's best tactics
  WARPSPLITK_THREAD_ARRIVE=lane0 timeout -k 5 ${MULTICAST_LIMIT:-150} python3 -m pytest -q -m gpu \
    tests/test_gpu_x_multicast.py > "$OUT/gpu_x_multicast-lane0.log" 2>&1
  echo "gpu_x_multicast (lane-0 release): $(tail -1 "$OUT/gpu_x_multicast-lane0.log")"
  timeout ${AB_LIMIT:-200} python3 scripts/build_ab.py --compare mc-release \
    --json "$OUT/mc-release-ab.json" 2>&1 | tail -10
  ;;
pdl)
  # what PDL and its dependency wait cost independent calls, plan tactics
  timeout ${AB_LIMIT:-300} python3 scripts/build_ab.py --compare pdl --tactics plan \
    --json "$OUT/pdl-ab.json" 2>&1 | tail -20
  ;;
llama)
  timeout 300 python3 examples/llama_decode.py --batch 1 8 32 --json "$OUT/llama.json" \
    > "$OUT/llama.log" 2>&1
  echo "llama rc=$?"; tail -12 "$OUT/llama.log"
  ;;
ab)
  timeout 200 python3 scripts/build_ab.py --compare "${COMPARE:-pdl-trigger}" \
    --json "$OUT/ab.json" 2>&1 | tail -16
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
fence)
  # the release fence (activation rings refilled by TMA boxes or bulk copies):
  # the kernel tests over those rings and the cases that raced without it,
  # beside the reliability module and the stress of the racing cases; then,
  # alone on the GPU, the shipped plan benchmarked (FENCE_AB=1: also the
  # unfenced diagnostic build, for the fence's cost)
  P="timeout -k 5 ${PHASE1_LIMIT:-240} python3 -m pytest -q -m gpu --tb=short -rf"
  $P tests/test_gpu_kernel.py -k "back_to_back or tma or bulk" > "$OUT/gpu_kernel-async.log" 2>&1 &
  $P tests/test_gpu_kernel.py -k "random_legal" > "$OUT/gpu_kernel-random.log" 2>&1 &
  $P tests/test_gpu_reliability.py > "$OUT/gpu_reliability.log" 2>&1 &
  STRESS="scripts/stress_tactics.py 7168,384 17,25,32 16,8,128,2,1+tma 16,8,128,2,1+bulk
    64,8,128,3,1+early+bulk --rounds 40 --where"
  timeout ${PHASE1_LIMIT:-240} python3 $STRESS > "$OUT/stress.log" 2>&1 &
  # the experimental fences (compile.RELEASE_FENCES) on the same cases
  for fence in release loader; do
    WARPSPLITK_RELEASE_FENCE=$fence timeout ${PHASE1_LIMIT:-240} python3 $STRESS \
      > "$OUT/stress-$fence.log" 2>&1 &
  done
  wait
  summarise gpu_kernel-async gpu_kernel-random gpu_reliability
  grep "rounds x" "$OUT/stress.log"
  for fence in release loader; do echo "fence $fence:"; grep "rounds x" "$OUT/stress-$fence.log"; done
  timeout ${BENCH_LIMIT:-120} python3 -m warpsplitk.cli bench --plan h200 \
    --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; python3 scripts/bench_tables.py "$OUT/bench.json" | head -3
  if [ -n "${FENCE_AB:-}" ]; then
    for fence in release loader none; do
      WARPSPLITK_RELEASE_FENCE=$fence timeout ${BENCH_LIMIT:-120} python3 -m warpsplitk.cli \
        bench --plan h200 --json "$OUT/bench-fence-$fence.json" > "$OUT/bench-fence-$fence.log" 2>&1
      echo "fence $fence:"; python3 scripts/bench_tables.py "$OUT/bench-fence-$fence.json" | head -3
    done
  fi
  ;;
*)
  echo "unknown stage $stage (tests | tune | bench | checks | verify | ab | plan-check | narrow | multicast | pdl | llama | sanitize | fence)"; exit 2 ;;
esac
