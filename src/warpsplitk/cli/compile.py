"""``warpsplitk compile``: one kernel compiled for a target arch on any
machine (no GPU); its resources and PTX audit, and the register count kept
in the disk cache for ``warpsplitk plan``."""
from __future__ import annotations

from .. import tactics
from ..planning import choose
from ..runtime import compile as compiler
from ..runtime import disk_cache
from . import checks, options
from .options import UsageError


def add_parser(sub):
    p = sub.add_parser("compile", help="compile one kernel for a target arch (no GPU)")
    p.add_argument("--n", type=options.int_at_least(1), required=True,
                   help="weight rows (output features)")
    p.add_argument("--k", type=options.int_at_least(1), required=True,
                   help="weight columns (input features)")
    p.add_argument("--m", type=options.one_m, default=1,
                   help="the M (1..32) the default tactic is chosen for (default 1)")
    p.add_argument("--tactic", type=options.tactic,
                   help="o,t,k,s,b[...] (default: default_tactic's)")
    options.add_arch(p)
    p.add_argument("--bias", action="store_true", help="compile the bias epilogue")
    p.add_argument("--fp8-scales", choices=compiler.FP8_SCALES,
                   help="the kernel for e4m3 weights with these FP32 scales (tensor, channel "
                        "or block128; default tactic: the FP8 default)")
    options.add_sm_count(p, "SMs the default tactic is chosen for")
    p.add_argument("--emit-ptx", metavar="PATH", help="write the PTX here")
    p.set_defaults(func=run)


def run(args, argv):
    checks.arch_defaults(args)
    tactic = _checked_tactic(args)
    checks.output_folder("--emit-ptx", args.emit_ptx)
    report = compiler.compile_for_arch(args.n, args.k, tactic, args.arch, has_bias=args.bias,
                                       fp8_scales=args.fp8_scales)
    if args.fp8_scales is None:  # (the resource records are BF16 kernels', for plan)
        disk_cache.store_resources(
            disk_cache.key(args.arch, args.n, args.k, tactic, args.bias, True),
            {"registers": report.registers, "spill_bytes": report.spill_bytes,
             "local_bytes": report.local_bytes}, describe=(args.n, args.k, tactic, args.arch))
    problems = _print_report(tactic, report)
    if args.emit_ptx:
        with open(args.emit_ptx, "w") as f:
            f.write(report.ptx)
        print(f"ptx written to {args.emit_ptx}")
    return 1 if problems else 0


def _checked_tactic(args):
    """``--tactic``, else the default tactic for ``--m`` on ``--sm-count`` SMs,
    checked against N and K."""
    try:
        fp8 = args.fp8_scales is not None
        tactic = args.tactic or choose.default_tactic(
            args.m, args.n, args.k, sm_count=args.sm_count, fp8=fp8,
            fp8_scales=args.fp8_scales or "channel")
        tactics.check_tactic(tactic, args.n, args.k, fp8=fp8)
    except ValueError as error:
        raise UsageError(f"{'argument --tactic: ' if args.tactic else ''}N={args.n} K={args.k}: "
                         f"{error}") from None
    return tactic


def _print_report(tactic, report) -> list[str]:
    """The compiled kernel's resources and PTX audit; the audit's problems."""
    print(f"tactic        {tactic.short()}  (output_tile,token_tile,k_tile,stages,b_loader_warps)")
    print(f"arch          {report.arch}")
    print(f"threads       {report.threads}")
    print(f"shared memory {report.smem_bytes} B")
    print(f"registers     {report.registers}")
    print(f"spills        {report.spill_bytes} B local frame")
    problems = report.audit()
    print("ptx audit     " + ("ok" if not problems else "; ".join(problems)))
    return problems
