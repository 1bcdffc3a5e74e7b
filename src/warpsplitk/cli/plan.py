"""``warpsplitk plan``: per shape and M, the tactic a plan (or the cost
model) gives, its grid on the SMs, shared memory, registers and local
memory (compiled for the target arch, or modelled) and HBM floor (no GPU,
no torch)."""
from __future__ import annotations

import argparse
import sys
import textwrap

from ..contract import GPUS
from ..kernel import layout
from ..planning.choose import default_tactic
from ..planning.plans import CUBLAS, default_choice
from ..runtime import compile as compiler
from ..runtime import disk_cache, precompile
from ..runtime.timing import DATASHEET_TBPS
from ..tactics import (
    ctas_per_sm,
    grid_ctas,
    l2_read_factor,
    register_estimate,
    shape_refusal,
    sm_balance,
    waves,
)
from . import checks, options

#: The table's columns and the least width of each (a wider cell widens its column).
COLUMNS = {"projection": 34, "from": 9, "N": 5, "K": 5, "M": 3, "tactic": 30, "CTAs": 5,
           "waves": 5, "SM load": 7, "CTA/SM": 6, "smem B": 7, "regs": 4, "local B": 7,
           "L2 x": 5, "floor us": 8, "meas us": 7, "%floor": 6}
HEADINGS = tuple(COLUMNS)
#: The cells before the tactic: a shape the kernel refuses has its reason there instead.
LEAD = HEADINGS.index("tactic")

#: What each column means: printed under the table and in ``plan --help``.
LEGEND = (
    ("N K M", "out[M, N] = x[M, K] @ W[N, K]^T: the weight's rows and columns, the tokens"),
    ("from", "plan: the plan's tactic for this cell; default: the cost model's (the plan has "
             "none); cublas: a shape the kernel does not take"),
    ("tactic", "o,t,k,s,b[,c] and options (README, Tactics); cublas: the plan measured (or, "
               "without an entry, the default expects) cuBLAS faster at this M"),
    ("CTAs", "thread blocks in the grid"),
    ("waves", "CTAs over the CTAs the whole GPU holds at once (SMs x CTA/SM)"),
    ("SM load", "L2 bytes the busiest SM reads over the mean per SM (1.00: even; idle SMs "
                "count)"),
    ("CTA/SM", "CTAs one SM holds at once (shared memory, threads, registers)"),
    ("smem B", "shared memory per CTA, bytes"),
    ("regs", "registers per thread: compiled for --arch, or the model's with --no-compile"),
    ("local B", "local memory frame per thread, bytes (ptxas: spills, local arrays); "
                "-: not compiled"),
    ("L2 x", "bytes read through L2 (weight and x) per weight byte from HBM: each token tile "
             "rereads the weight"),
    ("floor us", "the weight read once at the GPU's datasheet HBM bandwidth (--gpu, --tbps)"),
    ("meas us", "the time the tuner measured for this cell when the plan was made (its own "
                "run and process); BENCHMARKS.md's come from a separate `bench` run and "
                "kernels of a few us vary run to run, so the two can differ; -: not measured"),
    ("%floor", "floor us / meas us, percent"),
)
LEGEND_LINES = tuple(line for name, text in LEGEND for line in textwrap.wrap(
    text, 96, initial_indent=f"{name:<10}", subsequent_indent=" " * 10))

GPU_HELP = ("the target GPU: its arch, SMs and datasheet HBM bandwidth ("
            + "; ".join(f"{key}: {arch}, {sms} SMs, {DATASHEET_TBPS[name]} TB/s"
                        for key, (name, sms, arch) in GPUS.items())
            + "). Default: --arch's; for sm_90a the h200, the GPU the built-in plan and the "
              "cost model were measured on (on an H100 give h100: its floor, and no plan "
              "unless --plan h200)")


def add_parser(sub):
    p = sub.add_parser("plan", help="show tactics, occupancy, registers and the HBM floor per "
                                    "shape and M (no GPU)",
                       epilog="columns:\n" + "\n".join("  " + line for line in LEGEND_LINES),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_plan(p)
    options.add_shapes(p)
    options.add_ms(p)
    p.add_argument("--gpu", type=str.lower, choices=tuple(GPUS), help=GPU_HELP)
    options.add_arch(p, default=None, text="target arch (default: --gpu's, else sm_90a)")
    p.add_argument("--sm-count", type=options.int_at_least(1),
                   help="SMs of the target GPU (default: --gpu's)")
    p.add_argument("--tbps", type=options.positive_float,
                   help="peak HBM TB/s for the floor (default: --gpu's datasheet peak)")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="registers from the model, local memory unknown, instead of compiled "
                        "for --arch (compiled ones are kept in the disk cache)")
    options.add_jobs(p, "the kernels the disk cache lacks")
    options.add_weight_dtype(
        p, "fp8: e4m3 weights (W8A16): the plan's FP8 entries for --scales, else the FP8 "
           "default; the FP8 kernel's rings and registers; the floor at one byte a weight "
           "(default bf16)",
        "with --dtype fp8: the weights' FP32 scales, one (tensor), one per row (channel, the "
        "default) or one per 128x128 block (block128)")
    p.set_defaults(func=run)


def run(args, argv):
    given = [flag for flag, value in (("--sm-count", args.sm_count), ("--tbps", args.tbps))
             if value is not None]
    gpu = checks.target_gpu(args)
    default = checks.default_plan(gpu[:2]) if args.plan is None else None
    plan, source = checks.resolve_plan(args.plan or default)
    args.scales = options.fp8_scales(args)
    rows = _rows(plan, checks.shape_entries(args), args.m, args.sm_count, args.scales)
    resources = (_compiled_resources(rows, args.arch, args.jobs, args.scales) if args.compile
                 else None)
    print(_target_line(gpu, given, args))
    print(_plan_line(plan, source, rows, default == "none" and gpu[0], args.scales))
    print("\n".join(_table([_cells(row, plan, resources, args) for row in rows])))
    print("\n".join("# " + line for line in LEGEND_LINES))
    return 0


def _rows(plan, entries, ms, sm_count, fp8_scales=None) -> list[tuple]:
    """``(shape, m, tactic, origin)`` per shape and M: the plan's tactic
    ("plan"), else the default's ("default"); no tactic ("cublas") for a
    shape the kernel refuses. ``fp8_scales``: of e4m3 weights with those
    scales (the plan's FP8 entries, the FP8 default)."""
    rows = []
    for shape in entries:
        n, k = shape["n"], shape["k"]
        refusal = shape_refusal(n, k)
        for m in ms:
            if refusal is not None:  # no tactic: the shape runs on cuBLAS
                rows.append((shape, m, None, "cublas"))
                continue
            tactic = plan.lookup(n, k, m, fp8_scales=fp8_scales)
            origin = "plan"
            if tactic is None and fp8_scales is not None:
                tactic, origin = default_tactic(m, n, k, sm_count, fp8=True,
                                                fp8_scales=fp8_scales), "default"
            elif tactic is None:
                tactic, origin = default_choice(m, n, k, sm_count=sm_count), "default"
            rows.append((shape, m, tactic, origin))
    return rows


def _compiled_resources(rows, arch, jobs, fp8_scales=None) -> dict:
    """``{(n, k, tactic): {"registers", "spill_bytes", "local_bytes"}}`` of
    the rows' kernels (``fp8_scales``: the FP8-weight kernel's) compiled for
    ``arch``: read from the disk cache, compiling first what it lacks."""
    kernels = [(s["n"], s["k"], t, False, True, False, fp8_scales) for s, _, t, _ in rows
               if t is not None and t != CUBLAS]
    precompile.precompile_resources(kernels, arch, jobs, _progress_line(arch))
    resources = {}
    for n, k, tactic, *_ in kernels:
        if (n, k, tactic) not in resources:
            resources[(n, k, tactic)] = compiler.arch_resources(n, k, tactic, arch,
                                                                fp8_scales=fp8_scales)
    return resources


def _progress_line(arch):
    tty = sys.stderr.isatty()
    # say where the records go only where they do go
    where = "kept in the disk cache" if disk_cache.writable() is None else "not kept: no disk cache"

    def show(done, total):
        line = f"compiling {done}/{total} kernels for {arch} (registers; {where})"
        if tty:
            print("\r" + line, end="\n" if done == total else "", file=sys.stderr, flush=True)
        elif done == 1 or done == total or done % 10 == 0:
            print(line, file=sys.stderr, flush=True)
    return show


def _target_line(gpu, given, args) -> str:
    """The GPU the view is for: its model, arch, SMs and HBM bandwidth,
    each marked where a flag overrode the model's."""
    name, sm_count, _ = gpu
    sms = f"{args.sm_count} SMs" + (" (--sm-count)" if "--sm-count" in given else "")
    tbps = f"{args.tbps} TB/s" + (" (--tbps)" if "--tbps" in given else " (datasheet)")
    registers = f"compiled for {args.arch}" if args.compile else "from the model"
    return (f"# GPU {name} (--gpu {args.gpu}): {args.arch}, {sms}; floor at {tbps}; "
            f"registers {registers}")


def _plan_line(plan, source, rows, unmeasured_gpu, fp8_scales=None) -> str:
    """Where the tactics come from; ``unmeasured_gpu``: the GPU with no
    built-in plan whose default is no plan (else False); ``fp8_scales``:
    the rows are of e4m3 weights with those scales."""
    from_plan = sum(1 for *_, origin in rows if origin == "plan")
    where = " where the plan has none" if plan.table(fp8_scales) else ""
    default = "the FP8 default" if fp8_scales else "the cost model's choice"
    line = (f"# tactics from {source} ({from_plan} of {len(rows)} rows; 'default': "
            f"{default}{where}; 'cublas': a shape the kernel does not take)")
    if fp8_scales:
        line += f"; e4m3 weights with {fp8_scales} scales"
    if unmeasured_gpu:
        line += (f"; no plan was measured on the {unmeasured_gpu.removeprefix('NVIDIA ')}: "
                 "--plan h200 shows the H200's")
    fp8_shapes = sum(map(len, plan.fp8_entries.values()))
    if fp8_shapes and not fp8_scales:
        line += (f"; BF16 weights: the plan's FP8 entries ({fp8_shapes} shapes) show with "
                 "--dtype fp8")
    return line


def _name(shape) -> str:
    """The row's projection, ``N×K`` for a shape given without a name."""
    name = f"{shape.get('model', '')} {shape.get('projection', '')}".strip()
    return name or f"{shape['n']}{_times()}{shape['k']}"


def _times() -> str:
    """The multiplication sign where standard output can write it, else x."""
    try:
        "\u00d7".encode(sys.stdout.encoding or "ascii")
    except (LookupError, UnicodeEncodeError):
        return "x"
    return "\u00d7"


def _cells(row, plan, resources, args) -> list[str]:
    """One row of the table as its cells; a shape the kernel refuses: the
    cells up to M, then the reason."""
    shape, m, tactic, origin = row
    n, k = shape["n"], shape["k"]
    lead = [_name(shape), origin, str(n), str(k), str(m)]
    if tactic is None:
        return lead + [shape_refusal(n, k)]
    fp8 = args.scales is not None
    floor = n * k * (1 if fp8 else layout.ELEMENT_BYTES) / (args.tbps * 1e6)
    if tactic == CUBLAS:  # measured (plan) or predicted (default) faster for this M
        measured = _measured(plan, n, k, m)
        shown = "-" if measured is None else f"{measured:.2f}"
        return lead + ["cublas"] + [""] * 8 + [f"{floor:.2f}", shown, ""]
    if resources is None:
        regs, local = register_estimate(tactic), None
    else:
        found = resources[(n, k, tactic)]
        regs, local = found["registers"], found["spill_bytes"]
    # the time the tuner measured for this M, where it measured this M
    measured = _measured(plan, n, k, m, args.scales) if origin == "plan" else None
    shown = ["-", "-"] if measured is None else [f"{measured:.2f}",
                                                 f"{100 * floor / measured:.0f}"]
    return lead + [
        tactic.short(), str(grid_ctas(tactic, m, n)),
        f"{waves(tactic, m, n, args.sm_count, fp8):.2f}",
        f"{sm_balance(tactic, m, n, args.sm_count, fp8):.2f}", str(ctas_per_sm(tactic, fp8)),
        str(tactic.smem_plan_for(fp8).total), "-" if regs is None else str(regs),
        "-" if local is None else str(local), f"{l2_read_factor(tactic, m, fp8):.2f}",
        f"{floor:.2f}"] + shown


def _table(rows) -> list[str]:
    """The headings and ``rows`` (``_cells``), each column as wide as its
    widest cell: the projection left-aligned, the rest right-aligned."""
    full = [cells for cells in rows if len(cells) == len(HEADINGS)]
    widths = [max(least, *map(len, column)) for least, column in
              zip(COLUMNS.values(), zip(HEADINGS, *full))]
    widths[:LEAD] = [max(least, *map(len, column)) for least, column in
                     zip(COLUMNS.values(), zip(HEADINGS[:LEAD], *(c[:LEAD] for c in rows)))]

    def line(cells):
        first = f"{cells[0]:<{widths[0]}}"
        if len(cells) != len(HEADINGS):  # refused: the reason after M
            return " ".join([first] + [f"{c:>{w}}" for c, w in zip(cells[1:LEAD], widths[1:])]
                            + cells[LEAD:])
        return " ".join([first] + [f"{c:>{w}}" for c, w in zip(cells[1:], widths[1:])]).rstrip()
    return [line(HEADINGS)] + [line(cells) for cells in rows]


def _measured(plan, n, k, m, fp8_scales=None):
    """The time the plan's entry for ``(n, k)`` (``fp8_scales``: its FP8
    entry for those scales) records at ``m``, or None."""
    return plan.table(fp8_scales).get((n, k), {}).get(m, (None, None))[1]
