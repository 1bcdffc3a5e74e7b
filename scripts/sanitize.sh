#!/usr/bin/env bash
# compute-sanitizer over every tactic family (scripts/reliability.py cases).
# Each tool runs one ring variant per family (SUBSET=all: every variant),
# rotated between tools so that the variants are all covered. Summaries to
# $OUT/sanitizer-*.log.
set -u
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
status=0
offset=0
for tool in ${TOOLS:-memcheck racecheck synccheck initcheck}; do
  subset=${SUBSET:-rotate}
  "$CS" --tool "$tool" --print-limit 20 --error-exitcode 9 \
    python3 scripts/reliability.py cases --subset $subset --offset $offset > "$OUT/sanitizer-$tool.log" 2>&1
  rc=$?
  echo "$tool ($subset): exit $rc; $(grep -E 'ERROR SUMMARY|cases,' "$OUT/sanitizer-$tool.log" | tr '\n' ' ')"
  [ $rc -ne 0 ] && status=1
  offset=$((offset + 1))
done
exit $status
