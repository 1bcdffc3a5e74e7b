"""Tune the built-in shape table, then benchmark the plan, in one process.

One process so the benchmark reuses the kernels the tuner compiled (a device
call is short). Writes plan, tune log, bench JSON and logs to $OUT.

    python3 scripts/tune_and_bench.py [--m 1-32] [--bench-m 1,4,8,16,32]
"""

import argparse
import os
import time

from warpsplitk import bench, shapes
from warpsplitk.tune import tune


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="1-32")
    p.add_argument("--bench-m", default="1,4,8,16,32")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--log", help="tune log to resume from (default: OUT/tune-log.jsonl)")
    p.add_argument("--tune-budget", type=float, help="seconds of tuning before the bench")
    p.add_argument("--shapes", nargs="*", help="N,K pairs (default: the built-in table)")
    args = p.parse_args()
    table = (shapes.parse_shapes(args.shapes) if args.shapes
             else [(s["n"], s["k"]) for s in shapes.load()["shapes"]])
    # largest weights first: with a time budget, those matter most
    tune_order = sorted(table, key=lambda s: -s[0] * s[1])
    log = args.log or os.path.join(args.out, "tune-log.jsonl")
    start = time.perf_counter()
    plan = tune(tune_order, shapes.parse_ms(args.m), log_path=log,
                progress=lambda line: print(line, flush=True), time_budget_s=args.tune_budget)
    plan.save(os.path.join(args.out, "plan-h200.json"))
    print(f"tuned in {time.perf_counter() - start:.0f} s", flush=True)
    print(bench.HEADER, flush=True)
    env, rows = bench.run_bench(table, shapes.parse_ms(args.bench_m), plan,
                                progress=lambda line: print(line, flush=True))
    bench.write_json(os.path.join(args.out, "bench.json"), env, rows)
    print(f"# {env['gpu']} read {env['read_TBps']} TB/s  torch {env['torch']}  "
          f"cutlass-dsl {env['cutlass_dsl']}  {env['date']}")


if __name__ == "__main__":
    main()
