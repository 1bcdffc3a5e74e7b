"""``warpsplitk`` command line: compile | bench | plan | tune."""

from __future__ import annotations

import argparse
import sys

from . import shapes as shape_table
from .tactics import WarpSplitKTactic, default_tactic


def _cmd_compile(args):
    from .compile import compile_for_arch
    tactic = (WarpSplitKTactic.parse(args.tactic) if args.tactic
              else default_tactic(args.m, args.n, args.k, sm_count=args.sm_count))
    report = compile_for_arch(args.n, args.k, tactic, args.arch, has_bias=args.bias)
    print(f"tactic        {tactic.short()}  (output_tile,token_tile,k_tile,stages,b_loader_warps)")
    print(f"arch          {report.arch}")
    print(f"threads       {report.threads}")
    print(f"shared memory {report.smem_bytes} B")
    print(f"registers     {report.registers}")
    print(f"spills        {report.spill_bytes} B local frame")
    problems = report.audit()
    print("ptx audit     " + ("ok" if not problems else "; ".join(problems)))
    if args.emit_ptx:
        with open(args.emit_ptx, "w") as f:
            f.write(report.ptx)
        print(f"ptx written to {args.emit_ptx}")
    return 1 if problems else 0


def _resolve_plan(text):
    """``none`` -> the default heuristic, ``h200`` -> the built-in plan, else a file."""
    from .decode import DecodePlan, builtin_plan, load_plan
    if text == "none":
        return DecodePlan(), "default heuristic"
    if text == "h200":
        return builtin_plan("h200"), "built-in H200 plan"
    return load_plan(text), text


def _cmd_bench(args):
    from . import bench
    plan = _resolve_plan(args.plan)[0] if args.plan else None
    ms = shape_table.parse_ms(args.m)
    from .timing import resolve_rounds
    try:
        rounds = resolve_rounds(args.rounds)
    except ValueError as error:
        print(f"warpsplitk bench: --{error}", file=sys.stderr)
        return 2
    if args.chain:
        print("first -> second, M, tactics, warpsplitk us per pair, cuBLAS us, speedup", flush=True)
        rows = bench.bench_chain(bench.DEFAULT_CHAINS, ms, plan, rounds=rounds,
                                 progress=lambda line: print(line, flush=True))
        if args.json:
            import json
            from dataclasses import asdict
            with open(args.json, "w") as f:
                json.dump({"mode": "chain", "rounds": rounds,
                           "rows": [asdict(r) for r in rows]}, f, indent=1)
        return 0
    shapes = shape_table.parse_shapes(args.shapes) if args.shapes else bench.default_shapes()
    print(bench.HEADER, flush=True)
    env, rows = bench.run_bench(shapes, ms, plan, progress=lambda line: print(line, flush=True),
                                rounds=rounds)
    print(f"# {env['gpu']}  read {env['read_TBps']} TB/s (datasheet {env['datasheet_TBps']})  "
          f"torch {env['torch']}  cutlass-dsl {env['cutlass_dsl']}  {env['date']}")
    if args.json:
        bench.write_json(args.json, env, rows)
    if args.plot:
        from .plot import plot_rows
        plot_rows(rows, env, args.plot)
    return 0


def _cmd_plan_from_log(args):
    import os

    from .tune import plan_from_log, plan_meta
    if not os.path.exists(args.log):
        print(f"warpsplitk tune --from-log: no log at {args.log}", file=sys.stderr)
        return 2
    meta = plan_meta(args.gpu or "unknown", args.sm_count, None)
    plan, partial = plan_from_log(args.log, shape_table.parse_ms(args.m), meta,
                                  narrow=args.narrow_tiles,
                                  records=args.log_records, stale=args.stale_records,
                                  revision=args.kernel_revision)
    for (n, k), missing in partial.items():
        print(f"N={n} K={k}: left out, no measurement for M={missing}")
    plan.save(args.output)
    print(f"plan for {len(plan.entries)} shapes written to {args.output} from {args.log}")
    return 0


def _cmd_tune(args):
    if args.from_log:
        return _cmd_plan_from_log(args)
    from .tune import tune
    shapes = shape_table.parse_shapes(args.shapes) if args.shapes else \
        [(s["n"], s["k"]) for s in shape_table.load()["shapes"]]
    ms = shape_table.parse_ms(args.m)
    plan = tune(shapes, ms, log_path=args.log, resume=not args.fresh,
                progress=lambda line: print(line, flush=True), time_budget_s=args.time_budget,
                k_splits=(1, 2) if args.k_split else (1,),
                early_launches=(False, True) if args.early_launch else (False,), jobs=args.jobs,
                confirm=args.confirm, bulk_xs=(False, True) if args.bulk_x else (False,),
                l2_prefetch=args.l2_prefetch, tma=args.tma_x, mixed=args.mixed_tiles,
                narrow=args.narrow_tiles, bounded_prefetch=args.bounded_prefetch)
    plan.save(args.output)
    print(f"plan for {len(shapes)} shapes x {len(ms)} Ms written to {args.output}")
    return 0


def _cmd_cache(args):
    from . import disk_cache
    folder = disk_cache.cache_dir()
    if args.clear:
        print(f"removed {disk_cache.clear()} compiled kernels from {folder}")
        return 0
    if args.prune:
        print(f"removed {disk_cache.prune()} stale compiled kernels from {folder}")
        return 0
    files = disk_cache.entries()
    size = sum(f.stat().st_size for f in files)
    state = "on" if disk_cache.enabled() else "off (WARPSPLITK_DISK_CACHE)"
    print(f"{folder}: {len(files)} compiled kernels, {size / 1e6:.1f} MB "
          f"({len(disk_cache.stale())} stale: other versions or kernel sources, "
          f"'warpsplitk cache --prune' removes them); disk cache {state}")
    return 0


def _cmd_plan(args):
    from . import layout
    from .tactics import (ctas_per_sm, grid_ctas, l2_read_factor, register_estimate, sm_balance,
                          waves)
    plan, source = _resolve_plan(args.plan or "h200")
    entries = (shape_table.shape_entries(args.shapes) if args.shapes
               else shape_table.load()["shapes"])
    ms = shape_table.parse_ms(args.m)
    print(f"# tactics from {source}; {args.arch}, {args.sm_count} SMs; floor at "
          f"{args.tbps} TB/s; registers {'compiled here' if args.compile else 'from the model'}")
    print(f"{'projection':<34} {'N':>5} {'K':>5} {'M':>3} {'tactic':>30} {'CTAs':>5} {'waves':>5} "
          f"{'SM load':>7} {'CTA/SM':>6} {'smem B':>7} {'regs':>4} {'L2 x':>5} {'floor us':>8} "
          f"{'meas us':>7} {'%floor':>6}")
    for shape in entries:
        n, k = shape["n"], shape["k"]
        for m in ms:
            tactic = plan.lookup(n, k, m) or default_tactic(m, n, k, sm_count=args.sm_count)
            if args.compile:
                from .compile import compile_for_arch
                regs = compile_for_arch(n, k, tactic, args.arch).registers
            else:
                regs = register_estimate(tactic)
            name = f"{shape.get('model', '')} {shape.get('projection', '')}".strip()[:34]
            floor = n * k * layout.ELEMENT_BYTES / (args.tbps * 1e6)
            # the time the tuner measured for this M, where it measured this M
            measured = plan.entries.get((n, k), {}).get(m, (None, None))[1]
            shown = ("-", "-") if measured is None else (f"{measured:.2f}",
                                                         f"{100 * floor / measured:.0f}")
            print(f"{name:<34} {n:>5} {k:>5} {m:>3} {tactic.short():>30} "
                  f"{grid_ctas(tactic, m, n):>5} {waves(tactic, m, n, args.sm_count):>5.2f} "
                  f"{sm_balance(tactic, m, n, args.sm_count):>7.2f} {ctas_per_sm(tactic):>6} {tactic.smem_bytes:>7} {regs:>4} "
                  f"{l2_read_factor(tactic, m):>5.2f} {floor:>8.2f} {shown[0]:>7} {shown[1]:>6}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="warpsplitk", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compile", help="compile one kernel for a target arch (no GPU needed)")
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--k", type=int, required=True)
    p.add_argument("--m", type=int, default=1, help="M the default tactic is chosen for")
    p.add_argument("--tactic", help="o,t,k,s,b (default: the heuristic's)")
    p.add_argument("--arch", default="sm_90a", choices=("sm_90a", "sm_100a"))
    p.add_argument("--bias", action="store_true", help="compile the bias epilogue")
    p.add_argument("--sm-count", type=int, default=132)
    p.add_argument("--emit-ptx", metavar="PATH")
    p.set_defaults(func=_cmd_compile)

    p = sub.add_parser("bench", help="time warpsplitk vs torch.matmul on this GPU")
    p.add_argument("--shapes", nargs="*", help="N,K pairs or .json shape tables (default: built-in)")
    p.add_argument("--m", default="1,4,8,16,32", help="Ms, e.g. 1-32 or 1,4,8")
    p.add_argument("--plan", help="plan JSON, 'h200' (built-in) or 'none' (default: the heuristic)")
    p.add_argument("--json", help="write rows and environment here")
    p.add_argument("--plot", help="write a PNG plot here")
    p.add_argument("--rounds", type=int, default=None,
                   help="graphs per configuration, alternating; the median one counts "
                        "(default: timing.ROUNDS = 3)")
    p.add_argument("--chain", action="store_true",
                   help="dependent chains (each output feeds the next input) of table shape pairs")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("tune", help="measure tactics on this GPU and write a decode plan")
    p.add_argument("--shapes", nargs="*", help="N,K pairs or .json shape tables (default: built-in)")
    p.add_argument("--m", default="1-32")
    p.add_argument("-o", "--output", required=True, help="plan JSON to write")
    p.add_argument("--log", default="tune-log.jsonl", help="every measured candidate (JSON lines)")
    p.add_argument("--fresh", action="store_true", help="ignore measurements already in the log")
    p.add_argument("--time-budget", type=float,
                   help="seconds: start no new shape after this (rerun with the log to go on)")
    p.add_argument("--k-split", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure the cluster split of K (k_split 2) where the grid "
                        "leaves SMs idle (default: on)")
    p.add_argument("--k-split-4", action="store_true",
                   help="also the split of K in four where the split in two leaves SMs idle "
                        "(won no cell on the H200)")
    p.add_argument("--x-multicast", action="store_true",
                   help="also measure the experimental activation multicast (x_multicast 2-4) "
                        "for 16- and 32-token tiles")
    p.add_argument("--early-launch", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure every candidate with the early PDL trigger; it is "
                        "chosen only where it wins by more than 2%% (default: on)")
    p.add_argument("--bulk-x", action=argparse.BooleanOptionalAction, default=True,
                   help="at M = 1 also measure every candidate with its activation row "
                        "copied in bulk (default: on)")
    p.add_argument("--l2-prefetch", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure each cell's fastest candidates with the L2 prefetch of "
                        "the weight past the ring, for weights up to 16 MiB (default: on)")
    p.add_argument("--bounded-prefetch", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure each cell's 2 fastest candidates with the L2 prefetch "
                        "bounded to 1-4 K tiles past the ring, any weight size "
                        "(default: on)")
    p.add_argument("--tma-x", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure each cell's 3 fastest candidates with their activations "
                        "as TMA boxes, and its fastest with 16+ token rows with the boxes "
                        "multicast over clusters of 2-4 (default: on)")
    p.add_argument("--mixed-tiles", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure each cell's fastest uneven grids as mixed grids of tiles "
                        "and half tiles, one CTA per SM (default: on)")
    p.add_argument("--narrow-tiles", action=argparse.BooleanOptionalAction, default=True,
                   help="at M <= 4 also measure each cell's 3 fastest 8-token candidates with "
                        "a 1-, 2- or 4-row token tile, at the ring depths its smaller stages "
                        "allow (default: on)")
    p.add_argument("--confirm", type=int, default=None,
                   help="time each cell's N fastest candidates and its default tactic in "
                        "two more graphs and rank by the median of the three (default: 3; "
                        "0 times each once)")
    p.add_argument("--from-log", action="store_true",
                   help="no GPU: rebuild the plan from the measurements already in --log")
    p.add_argument("--log-records", type=int,
                   help="with --from-log: only the log's first N lines (the log as it stood "
                        "when a plan was made; a plan's meta records its count)")
    p.add_argument("--stale-records", action="store_true",
                   help="with --from-log: also count timings of kernels changed since they "
                        "were logged (async activation rings before the release fence): how a "
                        "plan made before the change is rebuilt")
    p.add_argument("--kernel-revision", type=int, default=None,
                   help="with --from-log: count the timings valid at this kernel revision (a "
                        "plan's meta records its kernel_revision; default: the current one)")
    p.add_argument("--gpu", help="with --from-log: the GPU the log was measured on")
    p.add_argument("--sm-count", type=int, help="with --from-log: that GPU's SM count")
    p.add_argument("--jobs", type=int,
                   help="processes compiling the candidates first (default: one per core but one)")
    p.set_defaults(func=_cmd_tune)

    p = sub.add_parser("cache", help="show, prune or clear the compiled kernels kept on disk")
    p.add_argument("--clear", action="store_true", help="remove them all")
    p.add_argument("--prune", action="store_true",
                   help="remove those built by other warpsplitk or CuTe DSL versions or "
                        "other kernel sources")
    p.set_defaults(func=_cmd_cache)

    p = sub.add_parser("plan", help="show tactics, occupancy and the HBM floor per shape (no GPU)")
    p.add_argument("--plan", help="plan JSON, 'h200' (built-in, the default) or 'none' (the heuristic)")
    p.add_argument("--shapes", nargs="*", help="N,K pairs or .json shape tables (default: built-in)")
    p.add_argument("--m", default="1,8,16,24,32", help="M buckets to show")
    p.add_argument("--arch", default="sm_90a", choices=("sm_90a", "sm_100a"))
    p.add_argument("--sm-count", type=int, default=132)
    p.add_argument("--tbps", type=float, default=4.8, help="peak HBM TB/s for the floor")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="registers from the model instead of compiling each tactic")
    p.set_defaults(func=_cmd_plan)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as error:
        print(f"warpsplitk: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `warpsplitk plan | head`: the reader has gone
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
