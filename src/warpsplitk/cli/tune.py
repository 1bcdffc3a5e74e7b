"""``warpsplitk tune``: measure tactics on this GPU and write a decode plan;
``--from-log`` rebuilds the plan from a tuning log without a GPU. With
``--dtype fp8`` the weights are e4m3 with FP32 scales (``--scales``) and the
plan's entries are FP8 entries."""
from __future__ import annotations

from .. import shapes as shape_table
from ..planning import choose, selection, tune, tune_log
from . import checks, options
from .options import UsageError


def add_parser(sub):
    p = sub.add_parser("tune", help="measure tactics on this GPU and write a decode plan")
    options.add_shapes(p)
    options.add_ms(p, options.M_HELP + "; each M is measured at its bucket and the plan covers "
                                       "every M of the buckets measured (the default: 1..32)")
    p.add_argument("-o", "--output", required=True, metavar="PATH", help="plan JSON to write")
    p.add_argument("--log", default="tune-log.jsonl", metavar="PATH",
                   help="every measurement, one JSON line each; a rerun resumes from it "
                        "(default tune-log.jsonl)")
    p.add_argument("--time-budget", type=options.positive_float, metavar="SECONDS",
                   help="start no new shape after this (rerun with the log to go on)")
    options.add_jobs(p, "the candidates first")
    p.add_argument("--fresh", action="store_true",
                   help="measure everything again, ignoring the log's measurements")
    p.add_argument("--from-log", action="store_true",
                   help="no GPU: rebuild the plan from the measurements in --log")
    p.add_argument("--exhaustive", action="store_true",
                   help="measure the whole tactic space of each cell, not only the cost "
                        "model's shortlist (minutes per shape instead of seconds)")
    options.add_weight_dtype(
        p, "fp8: tune for e4m3 weights (W8A16) into the plan's FP8 entries, each cell's pruned "
           "FP8 space measured, no cuBLAS (default bf16)",
        "with --dtype fp8: the FP32 scales the weights are timed with, and the plan's entries "
        "are for: one (tensor), one per row (channel, the default) or one per 128x128 block "
        "(block128)")
    p.set_defaults(func=run)


def run(args, argv):
    checks.output_folder("--output", args.output)
    if args.from_log and args.fresh:
        raise UsageError("argument --fresh: not with --from-log (which reads the log --fresh "
                         "would ignore)")
    fp8_scales = options.fp8_scales(args)
    records = _read_log(args.log, required=args.from_log) if (args.from_log or not args.fresh) \
        else []
    ms = _planned_ms(args.m)
    if args.from_log:
        return _plan_from_log(args, records, ms, fp8_scales)
    shapes = checks.kernel_shapes(checks.shape_entries(args))
    checks.require_gpu("tune")
    plan = tune.tune(shapes, ms, log_path=args.log, resume=not args.fresh,
                     progress=lambda line: print(line, flush=True),
                     time_budget_s=args.time_budget, jobs=args.jobs,
                     shortlist=0 if args.exhaustive else choose.SHORTLIST, fp8_scales=fp8_scales)
    plan.save(args.output)
    what = f"FP8 plan ({fp8_scales} scales)" if fp8_scales else "plan"
    print(f"{what} for {len(shapes)} shapes x {len(ms)} Ms written to {args.output}")
    return 0


def _plan_from_log(args, records, ms, fp8_scales):
    """--from-log: the plan of every shape the log measured, for the GPU it names."""
    if args.shapes is not None or args.model is not None:
        raise UsageError(f"argument {'--model' if args.model else '--shapes'}: not with "
                         "--from-log (the plan has every shape the log measured)")
    # what the log's provenance lines ({"meta": ...}) say of the GPU
    named = [r["meta"] for r in reversed(records) if "meta" in r]
    gpu = next((p["gpu"] for p in named if p.get("gpu")), "unknown")
    sm_count = next((p["sm_count"] for p in named if p.get("sm_count")), 132)
    plan, partial = selection.plan_from_log(args.log, ms, tune.plan_meta(gpu, sm_count, None),
                                            fp8_scales=fp8_scales)
    for (n, k), missing in partial.items():
        print(f"N={n} K={k}: left out, no measurement for M={missing}")
    plan.save(args.output)
    what = f"FP8 plan ({fp8_scales} scales)" if fp8_scales else "plan"
    print(f"{what} for {len(plan.table(fp8_scales))} shapes written to "
          f"{args.output} from {args.log}")
    return 0


def _read_log(path, required):
    """The tuning log's records, checked line by line by the tuner's own
    reader (``[]`` when it is absent and not ``required``)."""
    try:
        numbered = tune_log.read_log_records(path)
    except FileNotFoundError:
        if required:
            raise UsageError(f"argument --log: {path}: no such tuning log (--from-log rebuilds "
                             "a plan from the log a `warpsplitk tune` run wrote)") from None
        return []
    except OSError as error:
        raise UsageError(f"argument --log: {path}: cannot read the tuning log ({error})") from None
    except ValueError as error:  # a broken line: the reader names the file and the line
        raise UsageError(f"argument --log: {error}") from None
    records = [record for _, record in numbered]
    if required and not records:
        raise UsageError(f"argument --log: {path}: the tuning log has no records")
    return records


def _planned_ms(ms):
    """The Ms a plan tuned for ``ms`` covers: the tuner measures each M's
    bucket (``selection.REPRESENTATIVE_MS``), and every M of a measured bucket
    takes its winner."""
    buckets = {selection.representative(m) for m in ms}
    return [m for m in range(1, shape_table.MAX_M + 1) if selection.representative(m) in buckets]
