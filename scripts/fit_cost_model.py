"""Fit the cost model (warpsplitk.planning.cost_model) to the measurement records.

    python scripts/fit_cost_model.py            # write src/warpsplitk/data/cost-model-h200.json
    python scripts/fit_cost_model.py --check    # exit 1 if the shipped model is not this fit
    python scripts/fit_cost_model.py --held-out-shapes   # the held-out benchmark's N,K list

Inputs (bench/results/): the tuner logs (every tactic timed per cell, and
cuBLAS; ``h200-tune-log-table.jsonl``: the built-in plan's tactic and cuBLAS
per cell of the shape table) and the model benchmark (the default and
reference heuristics' tactics and cuBLAS on nine models' shards): calibration
records only, never the benchmark records that measure the default (a
re-run benchmark leaves the fit, and so the default, as it is). Shapes of the held-out models
(``cost_model.HELD_OUT_MODELS``, at every TP degree) are dropped from the
fit. The model's meta records what went in, and the shape-grouped
five-fold cross-validation: how far the tactic the model ranks first among
a cell's measured ones is from the cell's fastest measured one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from warpsplitk import models
from warpsplitk.planning import cost_model, measured_options, tune_log  # noqa: E402
from warpsplitk.planning.decode_plan import CUBLAS  # noqa: E402
from warpsplitk.tactics import WarpSplitKTactic, is_legal, shape_refusal  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TUNE_LOGS = ("h200-tune-log.jsonl", "h200-tune-log-models.jsonl", "h200-tune-log-shapes.jsonl",
             "h200-tune-log-table.jsonl")
BENCH_MODELS = "h200-bench-models.json"
OUTPUT = ROOT / "src" / "warpsplitk" / "data" / cost_model.MODEL_FILES["h200"]
FOLDS = 5
#: the option pairs cross-validated: those whose tactic is this close to its
#: cell's fastest without options (the tactics the default starts from)
NEAR_BEST = 1.08
#: The held-out models' TP shards the held-out benchmark times (single GPU
#: and sharded, small and large): bench/results/h100-bench-heldout.json.
HELD_OUT_BENCH = (("gemma-3-12b", 1), ("gemma-3-12b", 8), ("llama-3.2-3b", 1),
                  ("llama-3.2-3b", 4), ("qwen3-4b", 2), ("gemma-2-27b", 4))


def held_out_bench_shapes() -> list[tuple[int, int]]:
    """The kernel-legal shapes of ``HELD_OUT_BENCH``, each once, in order."""
    shapes = []
    for name, tp in HELD_OUT_BENCH:
        for p in models.projections(name, tp):
            shape = (p["n"], p["k"])
            if shape_refusal(*shape) is None and shape not in shapes:
                shapes.append(shape)
    return shapes


def held_out_shapes() -> set:
    shapes = set()
    for name in cost_model.HELD_OUT_MODELS:
        for tp in (1, 2, 4, 8):
            try:
                projections = models.projections(name, tp)
            except ValueError:
                continue
            shapes |= {(p["n"], p["k"]) for p in projections}
    return shapes


def load_records():
    """``(cells, cublas)``: ``{(n, k, m): {tactic: us}}`` and ``{(n, k, m): us}``."""
    cells, cublas = {}, {}

    def add(n, k, m, tactic, us):
        if us and is_legal(tactic, n, k):
            cells.setdefault((n, k, m), {})[tactic] = us

    for name in TUNE_LOGS:
        for rec in tune_log.read_log(str(RESULTS / name)).values():
            if not rec.get("ok") or rec.get("confirm"):
                continue
            if rec["tactic"] == CUBLAS:
                cublas[(rec["n"], rec["k"], rec["m"])] = rec["us"]
            else:
                add(rec["n"], rec["k"], rec["m"], WarpSplitKTactic.parse(rec["tactic"]), rec["us"])
    for entry in json.loads((RESULTS / BENCH_MODELS).read_text())["models"]:
        for row in entry["rows"]:
            n, k, m = row["n"], row["k"], row["m"]
            if row.get("source") == "default" and row.get("tactic") != CUBLAS:
                add(n, k, m, WarpSplitKTactic.parse(row["tactic"]), row.get("default_us"))
            if row.get("reference_tactic"):
                add(n, k, m, WarpSplitKTactic.parse(row["reference_tactic"]), row.get("reference_us"))
            if row.get("cublas_us"):
                cublas.setdefault((n, k, m), row["cublas_us"])
    held = held_out_shapes()
    cells = {key: v for key, v in cells.items() if key[:2] not in held}
    cublas = {key: v for key, v in cublas.items() if key[:2] not in held}
    return cells, cublas


def cross_validate(cells, cublas):
    """Shape-grouped five-fold cross-validation: per cell with 5+ measured
    tactics (late trigger), the measured time of the model's first-ranked
    one over the cell's fastest; cuBLAS's predicted over measured time; and
    per option, over the measured (tactic, twin) pairs whose tactic is
    within ``NEAR_BEST`` of its cell's fastest tactic without options, the
    pairs the nearest pairs of the other folds accept and their measured
    ratio (``measured_options.apply_options``' rule)."""
    shapes = sorted({key[:2] for key in cells})
    random.Random(0).shuffle(shapes)
    regrets, cublas_ratio = [], []
    options = {name: [] for name in measured_options.TWINS}
    for fold in range(FOLDS):
        out = set(shapes[fold::FOLDS])
        model = cost_model.fit({c: v for c, v in cells.items() if c[:2] not in out},
                               {c: v for c, v in cublas.items() if c[:2] not in out})
        threshold = math.log(1.0 - measured_options.MARGIN)
        for (n, k, m), timings in cells.items():
            if (n, k) not in out:
                continue
            late = {t: us for t, us in timings.items() if not t.early_launch}
            if len(late) >= 5:
                pick = min(late, key=lambda t: model.predict_us(t, m, n, k))
                regrets.append(late[pick] / min(late.values()))
            plain = [us for t, us in timings.items() if not (
                t.early_launch or t.l2_prefetch or t.k_split > 1 or t.half_tiles
                or t.x_copy == "tma")]
            for tactic, us in timings.items():
                if not plain or us > NEAR_BEST * min(plain):
                    continue
                for name, twin_of in measured_options.TWINS.items():
                    twin = twin_of(tactic, m, n, k)
                    if twin in timings:
                        gain = measured_options.estimate(model.option_pairs[name],
                                                   measured_options.describe(tactic, m, n, k))
                        options[name].append((gain is not None and gain < threshold,
                                              timings[twin] / us))
        for (n, k, m), us in cublas.items():
            if (n, k) in out:
                cublas_ratio.append(model.predict_cublas_us(m, n, k) / us)
    regrets.sort()
    cublas_ratio.sort()
    option_cv = {}
    for name, rows in options.items():
        taken = [ratio for accepted, ratio in rows if accepted]
        option_cv[name] = {"pairs": len(rows), "accepted": len(taken),
                           "accepted_ratio_median": round(statistics.median(taken), 4)
                           if taken else None,
                           "accepted_over_1_03": sum(r > 1.03 for r in taken),
                           "all_ratio_median": round(statistics.median(r for _, r in rows), 4)
                           if rows else None}
    return {"cells": len(regrets),
            "pick_over_fastest_median": round(statistics.median(regrets), 4),
            "pick_over_fastest_mean": round(statistics.mean(regrets), 4),
            "pick_over_fastest_p90": round(regrets[int(0.9 * (len(regrets) - 1))], 4),
            "pick_over_fastest_worst": round(regrets[-1], 4),
            "cublas_cells": len(cublas_ratio),
            "cublas_predicted_over_measured_median": round(statistics.median(cublas_ratio), 4),
            "cublas_predicted_over_measured_p5_p95": [
                round(cublas_ratio[int(0.05 * (len(cublas_ratio) - 1))], 4),
                round(cublas_ratio[int(0.95 * (len(cublas_ratio) - 1))], 4)],
            "options": option_cv}


def build() -> cost_model.CostModel:
    cells, cublas = load_records()
    inputs = {name: hashlib.sha256((RESULTS / name).read_bytes()).hexdigest()[:16]
              for name in (*TUNE_LOGS, BENCH_MODELS)}
    meta = {"gpu": "NVIDIA H200", "sm_count": cost_model.DEFAULT_SM_COUNT,
            "command": "python scripts/fit_cost_model.py",
            "inputs": {f"bench/results/{name}": digest for name, digest in inputs.items()},
            "held_out_models": list(cost_model.HELD_OUT_MODELS),
            "shapes": len({key[:2] for key in cells}), "cells": len(cells),
            "timings": sum(len(v) for v in cells.values()), "cublas_cells": len(cublas),
            "cross_validation": cross_validate(cells, cublas)}
    return cost_model.fit(cells, cublas, meta=meta)


def to_text(model: cost_model.CostModel) -> str:
    """The model's JSON, indented, each list of numbers on one line (the
    option pairs are thousands of rows)."""
    text = json.dumps(model.to_json(), indent=1)
    return re.sub(r"\[\s*([-+0-9.eE,\s]+?)\s*\]",
                  lambda match: "[" + ", ".join(x.strip() for x in match.group(1).split(",")) + "]",
                  text) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the shipped model differs from a fit of the records")
    parser.add_argument("--held-out-shapes", action="store_true",
                        help="print the held-out benchmark's N,K shapes and exit")
    args = parser.parse_args(argv)
    if args.held_out_shapes:
        print(" ".join(f"{n},{k}" for n, k in held_out_bench_shapes()))
        return 0
    model = build()
    text = to_text(model)
    if args.check:
        if OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(ROOT)} is not the fit of bench/results: run "
                  "python scripts/fit_cost_model.py")
            return 1
        return 0
    OUTPUT.write_text(text)
    cv = model.meta["cross_validation"]
    print(f"wrote {OUTPUT.relative_to(ROOT)}: {model.meta['shapes']} shapes, "
          f"{model.meta['cells']} cells, {model.meta['timings']} timings; cross-validated pick "
          f"over fastest median {cv['pick_over_fastest_median']}, worst "
          f"{cv['pick_over_fastest_worst']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
