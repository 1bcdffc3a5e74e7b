"""``warpsplitk`` command line: compile | bench | plan | tune."""

from __future__ import annotations

import argparse
import sys

from . import shapes as shape_table
from .tactics import WarpSplitKTactic, default_tactic


def _cmd_compile(args):
    from .compile import audit_ptx, compile_for_arch
    tactic = (WarpSplitKTactic.parse(args.tactic) if args.tactic
              else default_tactic(args.m, args.n, args.k, sm_count=args.sm_count))
    report = compile_for_arch(args.n, args.k, tactic, args.arch, has_bias=args.bias)
    print(f"tactic        {tactic.short()}  (output_tile,token_tile,k_tile,stages,b_loader_warps)")
    print(f"arch          {report.arch}")
    print(f"threads       {report.threads}")
    print(f"shared memory {report.smem_bytes} B")
    print(f"registers     {report.registers}")
    print(f"spills        {report.spill_bytes} B local frame")
    problems = audit_ptx(report.ptx)
    print("ptx audit     " + ("ok" if not problems else "; ".join(problems)))
    if args.emit_ptx:
        with open(args.emit_ptx, "w") as f:
            f.write(report.ptx)
        print(f"ptx written to {args.emit_ptx}")
    return 1 if problems else 0


def _cmd_bench(args):
    from . import bench
    plan = None
    if args.plan:
        from .decode import load_plan
        plan = load_plan(args.plan)
    shapes = shape_table.parse_shapes(args.shapes) if args.shapes else bench.default_shapes()
    ms = shape_table.parse_ms(args.m)
    print(bench.HEADER, flush=True)
    env, rows = bench.run_bench(shapes, ms, plan, progress=lambda line: print(line, flush=True))
    print(f"# {env['gpu']}  read {env['read_TBps']} TB/s (datasheet {env['datasheet_TBps']})  "
          f"torch {env['torch']}  cutlass-dsl {env['cutlass_dsl']}  {env['date']}")
    if args.json:
        bench.write_json(args.json, env, rows)
    if args.plot:
        from .plot import plot_rows
        plot_rows(rows, env, args.plot)
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
    p.add_argument("--plan", help="decode plan JSON (default: the heuristic)")
    p.add_argument("--json", help="write rows and environment here")
    p.add_argument("--plot", help="write a PNG plot here")
    p.set_defaults(func=_cmd_bench)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as error:
        print(f"warpsplitk: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
