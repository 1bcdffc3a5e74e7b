#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over every
# tactic family with each ring variant (scripts/reliability.py cases; SUBSET=rotate
# takes one variant per family and tool instead). Every tool's cases are
# split into SHARDS processes and all processes run at once: compiling is
# CPU-bound and correctness does not mind a shared GPU. Logs in
# $OUT/sanitizer-TOOL-SHARD.log, one summary line per tool.
set -u
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
TOOLS=${TOOLS:-memcheck racecheck synccheck initcheck}
SHARDS=${SHARDS:-2}
subset=${SUBSET:-all}
offset=0
for tool in $TOOLS; do
  for shard in $(seq 0 $((SHARDS - 1))); do
    ( timeout -k 5 "${CASE_LIMIT:-600}" "$CS" --tool "$tool" --print-limit 20 --error-exitcode 9 \
        python3 scripts/reliability.py cases --subset "$subset" --offset $offset \
        --shard "$shard" --shards "$SHARDS" > "$OUT/sanitizer-$tool-$shard.log" 2>&1
      echo $? > "$OUT/sanitizer-$tool-$shard.rc" ) &
  done
  offset=$((offset + 1))
done
wait
status=0
for tool in $TOOLS; do
  line="$tool ($subset):"
  for shard in $(seq 0 $((SHARDS - 1))); do
    rc=$(cat "$OUT/sanitizer-$tool-$shard.rc" 2>/dev/null || echo none)
    line="$line [shard $shard exit $rc; $(grep -E 'ERROR SUMMARY|cases,' "$OUT/sanitizer-$tool-$shard.log" | tr '\n' ' ')]"
    [ "$rc" != 0 ] && status=1
  done
  echo "$line"
done
exit $status
