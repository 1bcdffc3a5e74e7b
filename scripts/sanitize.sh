#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over the
# cases of scripts/reliability.py: SUBSET=shipped every tactic the built-in
# plan and the default heuristic use; SUBSET=all (the default) every tactic
# family with each ring variant; SUBSET=rotate one variant per family and tool. Every tool's cases are
# split into SHARDS processes and all processes run at once: compiling is
# CPU-bound and correctness does not mind a shared GPU. One summary line per
# tool on stdout; $OUT/sanitizer-report.txt has, per log, its summary lines,
# the kinds of error reported with counts, and the first errors in full; the
# logs themselves go to $OUT/sanitizer-logs.tar.gz.
#   SANITIZER_FLAGS  extra compute-sanitizer flags (e.g. --report-api-errors no:
#                    memcheck otherwise also counts failed host API calls, such
#                    as the driver-symbol probing of cuGetProcAddress)
#   MEMCHECK_FLAGS   memcheck's own flags, default "--report-api-errors no":
#                    the CUDA driver's start-up symbol probing makes 34 failed
#                    cuGetProcAddress calls per process, which memcheck counts
#                    as errors though no kernel is involved; MEMCHECK_FLAGS=
#                    counts them again
#   K_SPLIT=1        add every family's cluster split of K (k_split 2)
#   CLUSTERS_ONLY=1  only the cases with k_split > 1 (with K_SPLIT: every family's)
#   BULK_X=1         add every one-warp family with bulk activation copies
#   TMA_X=1          add every one-warp family with TMA activation boxes
#   HALF_TILES=1     add every 32/64-row case as a mixed grid (half_tiles 3)
#   L2_PREFETCH=1    add the L2 prefetch of every case whose ring is shorter than K
#   X_COPIES_ONLY=1  with BULK_X / TMA_X / HALF_TILES / L2_PREFETCH: only those cases
#   NARROW_ONLY=1    only the cases with a narrow token tile (1, 2 or 4 rows)
#   PAST_16_ONLY=1   with DEEP_RINGS: only the rings deeper than 16 stages
#   DEEP_RINGS=1     add each family's deepest ring, whose reduction buffer
#                    lies over the rings; ALIASED_ONLY=1: only those cases
#   SWIGLU=1         every case (but mixed grids) with the SwiGLU epilogue
#   FP8=KIND         every case an e4m3 weight with KIND scales takes (tensor,
#                    channel, block128); with SUBSET=shipped the FP8 default's
#                    (with SWIGLU=1: the epilogue's cases on e4m3 weights)
#   CASE_LIMIT       seconds each tool's shard may run (default 600)
set -u
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOGS=${LOGS_DIR:-$(mktemp -d)}; mkdir -p "$LOGS"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
TOOLS=${TOOLS:-memcheck racecheck synccheck initcheck}
SHARDS=${SHARDS:-2}
subset=${SUBSET:-all}
split_flag=""; [ "${K_SPLIT:-0}" = 1 ] && split_flag=--k-split
[ "${CLUSTERS_ONLY:-0}" = 1 ] && split_flag="$split_flag --clusters-only"
[ "${BULK_X:-0}" = 1 ] && split_flag="$split_flag --bulk-x"
[ "${TMA_X:-0}" = 1 ] && split_flag="$split_flag --tma-x"
[ "${HALF_TILES:-0}" = 1 ] && split_flag="$split_flag --half-tiles"
[ "${L2_PREFETCH:-0}" = 1 ] && split_flag="$split_flag --l2-prefetch"
[ "${X_COPIES_ONLY:-0}" = 1 ] && split_flag="$split_flag --x-copies-only"
[ "${DEEP_RINGS:-0}" = 1 ] && split_flag="$split_flag --deep-rings"
[ "${ALIASED_ONLY:-0}" = 1 ] && split_flag="$split_flag --aliased-only"
[ "${NARROW_ONLY:-0}" = 1 ] && split_flag="$split_flag --narrow-only"
[ "${PAST_16_ONLY:-0}" = 1 ] && split_flag="$split_flag --past-16-only"
[ "${SWIGLU:-0}" = 1 ] && split_flag="$split_flag --swiglu"
[ -n "${FP8:-}" ] && split_flag="$split_flag --fp8 $FP8"
offset=0
for tool in $TOOLS; do
  for shard in $(seq 0 $((SHARDS - 1))); do
    tool_flags=""; [ "$tool" = memcheck ] && tool_flags=${MEMCHECK_FLAGS---report-api-errors no}
    ( timeout -k 5 "${CASE_LIMIT:-600}" "$CS" --tool "$tool" --print-limit 20 --error-exitcode 9 \
        $tool_flags ${SANITIZER_FLAGS:-} \
        python3 scripts/reliability.py cases --subset "$subset" --offset $offset \
        --shard "$shard" --shards "$SHARDS" $split_flag --progress > "$LOGS/$tool-$shard.log" 2>&1
      echo $? > "$LOGS/$tool-$shard.rc" ) &
  done
  offset=$((offset + 1))
done
wait
status=0
for tool in $TOOLS; do
  line="$tool ($subset):"
  for shard in $(seq 0 $((SHARDS - 1))); do
    rc=$(cat "$LOGS/$tool-$shard.rc" 2>/dev/null || echo none)
    line="$line [shard $shard exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|cases,' "$LOGS/$tool-$shard.log" | tr '\n' ' ')]"
    [ "$rc" != 0 ] && status=1
  done
  echo "$line"
done
for log in "$LOGS"/*.log; do
  echo "=== $(basename "$log")"
  grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|cases,' "$log"
  echo "--- kinds"
  grep -E '^========= +(Invalid|Program hit|Race|Error|Warning|Uninitialized|Barrier|Misaligned|Out of|Address|Hazard|[A-Z][a-z]+ [a-z]+ hazard)' "$log" \
    | sed -E 's/0x[0-9a-f]+/ADDR/g; s/[0-9]+ bytes/N bytes/g; s/thread \([0-9,]+\)/thread (T)/g; s/block \([0-9,]+\)/block (B)/g' \
    | sort | uniq -c | sort -rn | head -15
  echo "--- first errors"
  grep -m1 -n -E '^========= +[A-Z]' "$log" >/dev/null && \
    awk '/^========= +[A-Z]/{n++} n>=1 && n<=4' "$log" | grep -v -E 'Host Frame|^========= +$' | head -60
done > "$OUT/sanitizer-report.txt"
tar -czf "$OUT/sanitizer-logs.tar.gz" -C "$LOGS" .
exit $status
