"""``warpsplitk plan``: per shape and M, the tactic a plan (or the cost
model) gives, its grid on the SMs, shared memory, registers (compiled for
the target arch, or modelled) and HBM floor (no GPU, no torch)."""
from __future__ import annotations

import sys

from ..contract import ARCH_GPUS
from ..kernel import layout
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

COLUMNS = (f"{'projection':<34} {'from':>9} {'N':>5} {'K':>5} {'M':>3} {'tactic':>30} "
           f"{'CTAs':>5} {'waves':>5} {'SM load':>7} {'CTA/SM':>6} {'smem B':>7} {'regs':>4} "
           f"{'L2 x':>5} {'floor us':>8} {'meas us':>7} {'%floor':>6}")


def add_parser(sub):
    p = sub.add_parser("plan", help="show tactics, occupancy, registers and the HBM floor per "
                                    "shape and M (no GPU)")
    options.add_plan(p)
    options.add_shapes(p)
    options.add_ms(p)
    options.add_arch(p)
    options.add_sm_count(p, "SMs of the target GPU")
    p.add_argument("--tbps", type=options.positive_float,
                   help=f"peak HBM TB/s for the floor (default by --arch, the datasheet "
                        f"peak: {options.per_arch(lambda gpu, sms: DATASHEET_TBPS[gpu])})")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="registers from the model instead of compiled for --arch (compiled "
                        "ones are kept in the disk cache)")
    options.add_jobs(p, "the kernels the disk cache lacks")
    p.set_defaults(func=run)


def run(args, argv):
    checks.arch_defaults(args)
    plan, source = checks.resolve_plan(args.plan or checks.default_plan(ARCH_GPUS[args.arch]))
    rows = _rows(plan, checks.shape_entries(args), args.m, args.sm_count)
    registers = _compiled_registers(rows, args.arch, args.jobs) if args.compile else None
    print(_header(plan, source, rows, args))
    print(COLUMNS)
    for row in rows:
        print(_line(row, plan, registers, args))
    return 0


def _rows(plan, entries, ms, sm_count) -> list[tuple]:
    """``(shape, m, tactic, origin)`` per shape and M: the plan's tactic
    ("plan"), else the default's ("default"); no tactic ("cublas") for a
    shape the kernel refuses."""
    rows = []
    for shape in entries:
        n, k = shape["n"], shape["k"]
        refusal = shape_refusal(n, k)
        for m in ms:
            if refusal is not None:  # no tactic: the shape runs on cuBLAS
                rows.append((shape, m, None, "cublas"))
                continue
            tactic = plan.lookup(n, k, m)
            origin = "plan"
            if tactic is None:
                tactic, origin = default_choice(m, n, k, sm_count=sm_count), "default"
            rows.append((shape, m, tactic, origin))
    return rows


def _compiled_registers(rows, arch, jobs) -> dict:
    """``{(n, k, tactic): registers}`` of the rows' kernels compiled for
    ``arch``: read from the disk cache, compiling first what it lacks."""
    kernels = [(s["n"], s["k"], t, False, True) for s, _, t, _ in rows
               if t is not None and t != CUBLAS]
    precompile.precompile_resources(kernels, arch, jobs, _progress_line(arch))
    registers = {}
    for n, k, tactic, _, _ in kernels:
        if (n, k, tactic) not in registers:
            registers[(n, k, tactic)] = compiler.arch_resources(n, k, tactic,
                                                                arch)["registers"]
    return registers


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


def _header(plan, source, rows, args) -> str:
    from_plan = sum(1 for *_, origin in rows if origin == "plan")
    where = " where the plan has none" if plan.entries else ""
    return (f"# tactics from {source} ({from_plan} of {len(rows)} rows; 'default': the cost "
            f"model's choice{where}; 'cublas': a shape the kernel does not take); "
            f"{args.arch}, {args.sm_count} SMs; floor at "
            f"{args.tbps} TB/s; registers "
            f"{'compiled for ' + args.arch if args.compile else 'from the model'}")


def _line(row, plan, registers, args) -> str:
    """One row of the table."""
    shape, m, tactic, origin = row
    n, k = shape["n"], shape["k"]
    name = f"{shape.get('model', '')} {shape.get('projection', '')}".strip()[:34]
    lead = f"{name:<34} {origin:>9} {n:>5} {k:>5} {m:>3}"
    if tactic is None:
        return f"{lead} {shape_refusal(n, k)}"
    floor = n * k * layout.ELEMENT_BYTES / (args.tbps * 1e6)
    if tactic == CUBLAS:  # measured (plan) or predicted (default) faster for this M
        measured = _measured(plan, n, k, m)
        shown = "-" if measured is None else f"{measured:.2f}"
        return f"{lead} {'cublas':>30} {'':>58} {floor:>8.2f} {shown:>7}"
    regs = registers[(n, k, tactic)] if registers is not None else register_estimate(tactic)
    # the time the tuner measured for this M, where it measured this M
    measured = _measured(plan, n, k, m) if origin == "plan" else None
    shown = ("-", "-") if measured is None else (f"{measured:.2f}",
                                                 f"{100 * floor / measured:.0f}")
    return (f"{lead} {tactic.short():>30} "
            f"{grid_ctas(tactic, m, n):>5} {waves(tactic, m, n, args.sm_count):>5.2f} "
            f"{sm_balance(tactic, m, n, args.sm_count):>7.2f} {ctas_per_sm(tactic):>6} "
            f"{tactic.smem_bytes:>7} {regs if regs is not None else '-':>4} "
            f"{l2_read_factor(tactic, m):>5.2f} {floor:>8.2f} {shown[0]:>7} {shown[1]:>6}")


def _measured(plan, n, k, m):
    """The time the plan's entry for ``(n, k)`` records at ``m``, or None."""
    return plan.entries.get((n, k), {}).get(m, (None, None))[1]
