#!/usr/bin/env bash
# compute-sanitizer over every tactic family (scripts/reliability.py cases).
# memcheck runs all ring variants; racecheck, synccheck and initcheck one
# variant per family (they are slower). Summaries to $OUT/sanitizer-*.log.
set -u
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
status=0
for tool in ${TOOLS:-memcheck racecheck synccheck initcheck}; do
  subset=rotate; [ "$tool" = memcheck ] && subset=all
  "$CS" --tool "$tool" --print-limit 20 --error-exitcode 9 \
    python3 scripts/reliability.py cases --subset $subset > "$OUT/sanitizer-$tool.log" 2>&1
  rc=$?
  echo "$tool ($subset): exit $rc; $(grep -E 'ERROR SUMMARY|cases,' "$OUT/sanitizer-$tool.log" | tr '\n' ' ')"
  [ $rc -ne 0 ] && status=1
done
exit $status
