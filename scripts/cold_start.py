"""Time to prepare the whole decode table (every shape, M = 1..32) before capture.

    python3 scripts/cold_start.py [--plan h200|none|FILE] [--cache-dir DIR] [--json OUT]

Prints the total seconds, the number of distinct kernels, and how many of
them were compiled and how many loaded from the disk cache
(warpsplitk.disk_cache). Run it twice with the same empty --cache-dir for
"cold" (everything compiled) and "warm" (everything loaded).
"""

import argparse
import json
import os
import time

import torch

from warpsplitk import shapes
from warpsplitk.compile import _compile_cached
from warpsplitk.decode import DecodePlan, builtin_plan, load_plan, prepare_model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--plan", default="h200")
    p.add_argument("--cache-dir", help="WARPSPLITK_CACHE_DIR for this run")
    p.add_argument("--json")
    args = p.parse_args()
    if args.cache_dir:
        os.environ["WARPSPLITK_CACHE_DIR"] = args.cache_dir
    from warpsplitk import disk_cache
    stored_before = len(disk_cache.entries())
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
    compiled = len(disk_cache.entries()) - stored_before
    print(f"prepared {len(weights)} projections x M 1..32: {total:.1f} s, {kernels} kernels "
          f"({compiled} compiled, {kernels - compiled} loaded from {disk_cache.cache_dir()})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": round(total, 2), "kernels": kernels, "compiled": compiled,
                       "loaded": kernels - compiled, "plan": args.plan}, f)


if __name__ == "__main__":
    main()
