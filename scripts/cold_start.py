"""Time to prepare the whole decode table (every shape, M = 1..32) before capture.

    python3 scripts/cold_start.py [--plan h200|none|FILE] [--json OUT]

Prints per-shape and total seconds, and the number of distinct kernels compiled.
Run it twice in two processes for "cold" and "warm": warpsplitk keeps compiled
code per process only (the CuTe DSL's file cache does not cover cute.compile).
"""

import argparse
import json
import time

import torch

from warpsplitk import shapes
from warpsplitk.compile import _compile_cached
from warpsplitk.decode import DecodePlan, builtin_plan, load_plan, prepare_model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--plan", default="h200")
    p.add_argument("--json")
    args = p.parse_args()
    plan = (builtin_plan("h200") if args.plan == "h200" else
            DecodePlan() if args.plan == "none" else load_plan(args.plan))
    weights = {f"{s['model']} {s['projection']}": torch.randn(s["n"], s["k"], device="cuda",
                                                              dtype=torch.bfloat16)
               for s in shapes.load()["shapes"]}
    torch.cuda.synchronize()
    start = time.perf_counter()
    prepare_model(weights, plan, range(1, 33))
    total = time.perf_counter() - start
    kernels = _compile_cached.cache_info().currsize
    print(f"prepared {len(weights)} projections x M 1..32: {total:.1f} s, {kernels} kernels")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": round(total, 2), "kernels": kernels, "plan": args.plan}, f)


if __name__ == "__main__":
    main()
