"""``warpsplitk bench``: warpsplitk against torch.matmul on this GPU, per
shape (``--shapes``, ``--model``), in dependent chains (``--chain``) or
along one decode layer's GEMM path (``--layer``)."""
from __future__ import annotations

import importlib.util
import json
import shlex
from dataclasses import asdict

from .. import models
from ..measure import bench as measure_bench
from ..measure import fp8_bench, hf_fp8, layer_bench, plot
from ..runtime.timing import ROUNDS
from . import checks, options
from .options import UsageError


def add_parser(sub):
    p = sub.add_parser("bench", help="time warpsplitk against torch.matmul on this GPU")
    options.add_shapes(p)
    options.add_ms(p)
    options.add_plan(p)
    p.add_argument("--json", metavar="PATH",
                   help="write rows and environment (with this command line) here")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot here")
    p.add_argument("--rounds", type=options.integer, default=None,
                   help="graphs per configuration, alternating; the median one counts "
                        f"(default {ROUNDS})")
    p.add_argument("--chain", action="store_true",
                   help="dependent chains (each output feeds the next input): table shape pairs, "
                        "or with --model one layer's projections in order, against the reference "
                        "heuristic and cuBLAS")
    options.add_weight_dtype(
        p, "fp8: e4m3 weights with per-channel scales, our FP8 kernel (--plan's FP8 entries, "
           "else the FP8 default) against our BF16 kernel, cuBLAS and torch._scaled_mm "
           "(row-wise, x quantized in the call) on each shape (default bf16)",
        "with --dtype fp8: the weight's FP32 scales, one per row (default), one, or one per "
        "128x128 block (then also against transformers' FP8Linear)")
    p.add_argument("--hf-fp8-kernel", metavar="DIR",
                   help="with --scales block128 where the Hub cannot be reached: a checkout of "
                        "kernels-community's finegrained-fp8, the Triton kernel transformers' "
                        "FP8Linear runs (else it is fetched, or its column stays empty)")
    p.add_argument("--layer", action="store_true",
                   help="with --model: one decode layer's GEMM path (merged q/k/v, an attention "
                        "stand-in, o, gate/up with the SwiGLU epilogue, down) against the same "
                        "path unmerged and against cuBLAS with PyTorch's SiLU; and its MLP block")
    p.set_defaults(func=run)


def run(args, argv):
    plan, shapes = _checked(args)
    checks.require_gpu("bench")
    if plan is None:  # no --plan: this GPU's built-in plan, if one was measured on it
        plan, _ = checks.resolve_plan(checks.default_plan(_device_gpu()))
    command = "warpsplitk " + shlex.join(argv)
    if args.dtype == "fp8":  # --plan's entries, else the defaults (as the records)
        return _run_fp8(args, shapes, command, plan if args.plan is not None else None)
    if args.layer:
        return _run_layer_path(args, plan, command)
    if args.chain:
        return _run_chain(args, plan, command)
    return _run_shapes(args, plan, shapes, command)


def _device_gpu() -> tuple[str, int]:
    """The current CUDA device's (name, SM count): the GPU model a plan is measured on."""
    import torch  # torch loads only once the GPU check has passed
    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    return properties.name, properties.multi_processor_count


def _tp(args) -> int:
    return args.tp if args.tp is not None else 1


# ------------------------------------------------------------ checks


def _checked(args):
    """Every argument checked before the GPU: ``(the --plan given, or None;
    the shapes to time, or None for --chain and --layer)``."""
    _check_modes(args)
    plan = checks.resolve_plan(args.plan)[0] if args.plan is not None else None
    if args.chain and args.model is not None:
        _check_chain_model(args)
    shapes = None if args.chain or args.layer else checks.kernel_shapes(checks.shape_entries(args))
    checks.output_folder("--json", args.json)
    checks.output_folder("--plot", args.plot)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("argument --plot: needs matplotlib (pip install 'warpsplitk[plot]')")
    return plan, shapes


def _check_modes(args):
    """--rounds, and the flags --chain and --layer take."""
    if args.rounds is not None and args.rounds < 1:
        raise UsageError(f"--rounds must be at least 1, got {args.rounds} (graphs timed per "
                         "configuration; default 3)")
    if args.chain and args.shapes is not None:
        raise UsageError("argument --shapes: not with --chain (it times the built-in chains of "
                         "table shape pairs, or with --model one layer of that model)")
    if args.chain and args.plot:
        raise UsageError("argument --plot: not with --chain (it plots the per-shape rows)")
    if args.layer:
        _check_layer(args)
    args.scales = options.fp8_scales(args)
    if args.hf_fp8_kernel is not None:
        _check_hf_kernel(args)
    if args.dtype == "fp8":
        for flag, given in (("--chain", args.chain), ("--layer", args.layer),
                            ("--plot", args.plot)):
            if given:
                raise UsageError(f"argument {flag}: not with --dtype fp8 (it times each shape's "
                                 "FP8 call alone)")


def _check_hf_kernel(args):
    if args.dtype != "fp8" or args.scales != "block128":
        raise UsageError("argument --hf-fp8-kernel: only with --dtype fp8 --scales block128 "
                         "(transformers' FP8Linear takes 128x128 block scales)")
    try:
        hf_fp8.package_dir(args.hf_fp8_kernel)
    except ValueError as error:
        raise UsageError(f"argument --hf-fp8-kernel: {error}") from None


def _check_layer(args):
    if args.model is None:
        raise UsageError("argument --layer: needs --model NAME (the layer's sizes)")
    if args.chain or args.shapes is not None or args.plot:
        raise UsageError("argument --layer: not with --chain, --shapes or --plot")
    try:
        layer_bench.layer_shape(args.model, _tp(args))
    except ValueError as error:
        raise UsageError(f"argument --model: {error}") from None


def _check_chain_model(args):
    try:
        layer = models.layer_chain(args.model, _tp(args))
    except ValueError as error:
        raise UsageError(f"argument --model: {error}") from None
    if not layer:
        raise UsageError(f"argument --model: {args.model} has no layer projections to chain")


# ------------------------------------------------------------ runs


def _progress(line):
    print(line, flush=True)


def _run_layer_path(args, plan, command):
    rows = layer_bench.bench_layer_path(args.model, _tp(args), args.m, plan, rounds=args.rounds,
                            progress=_progress)
    if args.json:
        _write_json(args.json, command, args.rounds, "layer-path", [asdict(r) for r in rows])
    return 0


def _run_chain(args, plan, command):
    if args.model is not None:
        mode = "layer"
        rows = measure_bench.bench_layer(args.model, _tp(args), args.m, plan,
                                         rounds=args.rounds, progress=_progress)
        records = [asdict(r) | {"speedup": round(r.speedup, 3)} for r in rows]
    else:
        mode = "chain"
        print("first -> second, M, tactics, warpsplitk us per pair, cuBLAS us, speedup",
              flush=True)
        rows = measure_bench.bench_chain(measure_bench.DEFAULT_CHAINS, args.m, plan,
                                         rounds=args.rounds, progress=_progress)
        records = [asdict(r) for r in rows]
    if args.json:
        _write_json(args.json, command, args.rounds, mode, records)
    return 0


def _write_json(path, command, rounds, mode, records):
    """The rows of --chain or --layer, with the environment and this command line."""
    with open(path, "w") as f:
        environment = {**measure_bench.environment(), "command": command, "rounds": rounds}
        json.dump({"environment": environment, "mode": mode, "rows": records}, f, indent=1)


def _environment_line(env, command):
    """The run's command into ``env``, and its one-line summary printed."""
    env["command"] = command
    print(f"# {env['gpu']}  read {env['read_TBps']} TB/s (datasheet {env['datasheet_TBps']})  "
          f"torch {env['torch']}  cutlass-dsl {env['cutlass_dsl']}  {env['date']}")


def _run_fp8(args, shapes, command, plan):
    hf_kernel = (hf_fp8.use_local_kernel(args.hf_fp8_kernel)
                 if args.hf_fp8_kernel is not None else None)
    print(fp8_bench.HEADER, flush=True)
    env, rows = fp8_bench.run_fp8_bench(shapes, args.m, progress=_progress, rounds=args.rounds,
                                        scales=args.scales, plan=plan)
    if hf_kernel is not None:
        env["hf_fp8_kernel"] = hf_kernel
    _environment_line(env, command)
    if args.json:
        fp8_bench.write_json(args.json, env, rows)
    return 0


def _run_shapes(args, plan, shapes, command):
    print(measure_bench.HEADER, flush=True)
    env, rows = measure_bench.run_bench(shapes, args.m, plan, progress=_progress,
                                        rounds=args.rounds)
    _environment_line(env, command)
    if args.json:
        measure_bench.write_json(args.json, env, rows)
    if args.plot:
        plot.plot_rows(rows, env, args.plot)
    return 0
