"""Write a GPU test or sanitizer run as one JSON record for bench/results/.

    python3 scripts/gpu_record.py tests REPORT_DIR --command CMD --out OUT.json
    python3 scripts/gpu_record.py sanitizer LOG_DIR --command CMD --out OUT.json
    python3 scripts/gpu_record.py layers JSON_DIR --command CMD --out OUT.json
    python3 scripts/gpu_record.py layer-paths JSON_DIR --command CMD --out OUT.json

Each record holds the command, the date, the GPU and the versions
(``warpsplitk.measure.bench``'s), then the counts: per test module
passed/failed/skipped/errors and the failed test ids; per sanitizer tool the
cases run, the cases wrong, the errors or hazards the tool reported and each
shard's exit code; for layer chains (``warpsplitk bench --model --chain``
records, one per model and TP degree) their rows, in one list. Used by
``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import xml.etree.ElementTree as ElementTree


def environment(command):
    from warpsplitk.measure import bench
    return {**bench.environment(), "command": command}


def test_counts(report_dir):
    """Per test module ``NAME``: ``NAME.rc`` (its exit status) and, unless it
    was killed, ``NAME.xml`` (pytest's JUnit report) in ``report_dir``."""
    modules, failed = {}, []
    for rc_path in sorted(glob.glob(os.path.join(report_dir, "*.rc"))):
        name = os.path.basename(rc_path).removesuffix(".rc")
        path = os.path.join(report_dir, name + ".xml")
        rc = open(rc_path).read().strip()
        counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "seconds": 0.0,
                  "exit": rc}
        try:
            root = ElementTree.parse(path).getroot()
        except (OSError, ElementTree.ParseError):
            # killed by its time limit (124, 137) or crashed before its report
            counts["errors"] = 1
            failed.append(f"{name}: no report, exit status {rc}")
            modules[name] = counts
            continue
        for case in root.iter("testcase"):
            counts["seconds"] += float(case.get("time", 0))
            test_id = f"{case.get('classname')}::{case.get('name')}"
            if case.find("failure") is not None:
                counts["failed"] += 1
                failed.append(test_id)
            elif case.find("error") is not None:
                counts["errors"] += 1
                failed.append(test_id)
            elif case.find("skipped") is not None:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
        counts["seconds"] = round(counts["seconds"], 1)
        modules[name] = counts
    totals = {key: sum(m[key] for m in modules.values())
              for key in ("passed", "failed", "skipped", "errors")}
    return {"totals": totals, "modules": modules, "failed": failed}


#: compute-sanitizer's summary line, and reliability.py's per-shard line
SUMMARY = re.compile(r"(ERROR|RACECHECK) SUMMARY: (\d+) (errors|hazards)")
CASES = re.compile(r"^(\d+) cases, (\d+) wrong", re.M)


def sanitizer_counts(log_dir):
    tools = {}
    for log in sorted(glob.glob(os.path.join(log_dir, "*.log"))):
        tool, _, shard = os.path.basename(log).removesuffix(".log").rpartition("-")
        text = open(log, errors="replace").read()
        rc_path = log.removesuffix(".log") + ".rc"
        rc = open(rc_path).read().strip() if os.path.exists(rc_path) else "none"
        entry = tools.setdefault(tool, {"cases": 0, "wrong": 0, "reported": 0, "shards": {}})
        for found in CASES.finditer(text):
            entry["cases"] += int(found.group(1))
            entry["wrong"] += int(found.group(2))
        entry["reported"] += sum(int(found.group(2)) for found in SUMMARY.finditer(text))
        entry["shards"][shard] = {"exit": rc, "finished": bool(CASES.search(text))}
    return {"tools": tools,
            "clean": all(t["wrong"] == 0 and t["reported"] == 0
                         and all(s["exit"] == "0" and s["finished"] for s in t["shards"].values())
                         for t in tools.values()) and bool(tools)}


def layer_rows(json_dir):
    """The rows of every ``bench --model --chain`` record in ``json_dir``, in
    file name order: ``{"rows": [...], "totals": {...}}``."""
    rows = []
    for path in sorted(glob.glob(os.path.join(json_dir, "*.json"))):
        with open(path) as f:
            rows += json.load(f)["rows"]
    return {"rows": rows, "totals": {"layers": len(rows),
                                     "faster_than_cublas": sum(r["speedup"] > 1 for r in rows),
                                     "at_least_reference": sum(r["ours_us"] <= r["reference_us"]
                                                               for r in rows)}}


def layer_path_rows(json_dir):
    """The rows of every ``bench --model --layer`` record in ``json_dir``, in
    file name order, with the ratios the layer-path targets read:
    ``{"rows": [...], "totals": {...}}``."""
    rows = []
    for path in sorted(glob.glob(os.path.join(json_dir, "*.json"))):
        with open(path) as f:
            rows += json.load(f)["rows"]
    small = [r for r in rows if r["m"] <= 8]
    return {"rows": rows, "totals": {
        "rows": len(rows),
        "mlp_fused_over_unmerged_min": min((r["mlp_unmerged_us"] / r["mlp_fused_us"]
                                            for r in rows), default=None),
        "mlp_fused_over_cublas_min_m_le_8": min((r["mlp_cublas_us"] / r["mlp_fused_us"]
                                                 for r in small), default=None)}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("tests", "sanitizer", "layers", "layer-paths"))
    parser.add_argument("inputs", nargs=1, help="the report, log or JSON folder")
    parser.add_argument("--command", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    counts = {"tests": test_counts, "sanitizer": sanitizer_counts, "layers": layer_rows,
              "layer-paths": layer_path_rows}[args.kind](args.inputs[0])
    with open(args.out, "w") as f:
        json.dump({"environment": environment(args.command), "kind": args.kind, **counts}, f,
                  indent=1)
    print(json.dumps(counts.get("totals") or {t: {k: v for k, v in c.items() if k != "shards"}
                                              for t, c in counts["tools"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
