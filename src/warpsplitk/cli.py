"""warpsplitk command line: plan | compile | bench | tune | cache.

Every argument is checked before anything heavy (torch, the CuTe DSL)
loads; a bad one ends the command with exit status 2 and one line on
stderr, "warpsplitk <command>: error: ...", naming the argument, what was
given and what is allowed. The same flag means the same in every command:

--plan    h200: the built-in H200 plan; none: the default (cost model);
          else a plan JSON file (default: the built-in plan of the target
          GPU model where one was measured on it, else none).
--m       Ms in 1..32, e.g. 8, 1,4,8, 1-32 (default: the plan's M
          buckets, 1,4,8,16,24,32); compile --m is one M.
--shapes  N,K pairs and .json shape tables (default: the built-in table).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

from . import shapes as shape_table
from .runtime.timing import DATASHEET_TBPS, ROUNDS

from .contract import ARCH_GPUS, SUPPORTED_ARCHS as ARCHS
DEFAULT_M_TEXT = ",".join(map(str, shape_table.DEFAULT_MS))
M_HELP = (f"Ms in 1..32, e.g. 8, 1,4,8, 1-32 or 1-8,16 (default: the plan's M buckets, "
          f"{DEFAULT_M_TEXT})")
SHAPES_HELP = "N,K pairs and/or .json shape tables (default: the built-in table)"
PLAN_HELP = ("'h200': the built-in H200 plan; 'none': the default (cost model); else a plan "
             "JSON file (default: the built-in plan of the target GPU model, if one was "
             "measured on it: 'h200' on the H200, else none)")


class UsageError(Exception):
    """A bad argument or input file: one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    # argparse prints its usage, then the error: one line only, as ours
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


# ------------------------------------------------------------ argument types


def _ms(text):
    try:
        return shape_table.parse_ms(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _one_m(text):
    try:
        m = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"one M in 1..{shape_table.MAX_M}, got {text!r}") from None
    if not 1 <= m <= shape_table.MAX_M:
        raise argparse.ArgumentTypeError(f"one M in 1..{shape_table.MAX_M}, got {m}")
    return m


def _int_at_least(low):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def _int(text):
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer, got {text!r}") from None


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a positive number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"a positive number, got {text!r}")
    return value


def _tactic(text):
    from .tactics import WarpSplitKTactic
    try:
        return WarpSplitKTactic.parse(text)
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a tactic "
                                         f"(o,t,k,s,b[,...], e.g. 16,8,128,4,1): {error}") from None


# ------------------------------------------------------------ checks (light)


def _shape_entries(args) -> list[dict]:
    """The shapes a command runs on: ``--model`` (sharded by ``--tp``) and
    ``--shapes`` together, or the built-in table when neither is given."""
    entries = []
    model = getattr(args, "model", None)
    if model is None and getattr(args, "tp", None) is not None:
        raise UsageError(f"argument --tp: shards a --model's projections; no --model given "
                         f"(got --tp {args.tp})")
    if model is not None:
        from . import models
        try:
            entries += models.projections(model, args.tp or 1)
            config = models.config(model)
        except ValueError as error:
            raise UsageError(f"argument --model: {error}") from None
        if config.get("mlp") == "moe" or "dense_layers" in config:
            dense = config.get("dense_layers", 0)
            print(f"# {config['name']}: the MLPs of experts ({config['layers'] - dense} of "
                  f"{config['layers']} layers) are grouped GEMMs, not listed", flush=True)
    if args.shapes is not None:
        try:
            entries += shape_table.shape_entries(args.shapes)
        except ValueError as error:
            raise UsageError(f"argument --shapes: {error}") from None
    return entries if entries else shape_table.load()["shapes"]


def _kernel_shapes(entries) -> list[tuple[int, int]]:
    """The distinct (N, K) of ``entries`` the kernel takes; a line for each
    it refuses (those run on cuBLAS)."""
    from .tactics import shape_refusal
    shapes, refused = [], []
    for shape in entries:
        n, k = shape["n"], shape["k"]
        why = shape_refusal(n, k)
        if why is not None:
            name = f"{shape.get('model', '')} {shape.get('projection', '')}".strip()
            refused.append(f"{name + ': ' if name else ''}{n}x{k} left to cuBLAS: {why}")
        elif (n, k) not in shapes:
            shapes.append((n, k))
    if not shapes:  # a usage error: one line, the reasons in it
        raise UsageError("no shape the kernel takes (N a multiple of 16, K of 128): "
                         + "; ".join(refused))
    for line in refused:
        print(f"# {line}", flush=True)
    return shapes


def _resolve_plan(text):
    """``none`` -> the default (cost model), ``h200`` -> the built-in plan, else a file:
    ``(plan, description)``."""
    from .planning.plans import DecodePlan, builtin_plan, load_plan
    try:
        if text == "none":
            return DecodePlan(), "no plan: the default (cost model)"
        if text == "h200":
            return builtin_plan("h200"), "built-in H200 plan"
        return load_plan(text), text
    except ValueError as error:
        raise UsageError(f"argument --plan: {error} (give 'h200', 'none' or a plan JSON file)") \
            from None


def _device_gpu() -> tuple[str, int]:
    """The current CUDA device's (name, SM count): the GPU model a plan is measured on."""
    import torch
    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    return properties.name, properties.multi_processor_count


def _default_plan(gpu) -> str:
    """``--plan`` not given: the built-in plan of ``gpu`` (``(name, SMs)``), else 'none'."""
    from .planning.plan_cache import builtin_plan_for
    return builtin_plan_for(*gpu) or "none"


def _output_folder(flag, path):
    """Refuse, before any work, an output file that could not be written."""
    if path is None:
        return
    if not path or path.endswith(os.sep):
        raise UsageError(f"argument {flag}: a file to write, got {path!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"argument {flag}: {path}: folder {folder} does not exist")
    if os.path.isdir(path):
        raise UsageError(f"argument {flag}: {path} is a folder, not a file to write")
    # an existing file is opened for writing as it is (its folder may be read-only)
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        raise UsageError(f"argument {flag}: {path}: not writable")


def _read_log(path, required):
    """The tuning log's records, checked line by line by the tuner's own
    reader (``[]`` when it is absent and not ``required``)."""
    from .planning.tune_log import read_log_records
    try:
        numbered = read_log_records(path)
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


def _require_gpu(command):
    """One line and exit 2 where no CUDA GPU warpsplitk runs on is usable."""
    try:
        import torch
    except ImportError as error:
        raise UsageError(f"`warpsplitk {command}` needs torch ({error})") from None
    if not torch.cuda.is_available():
        build = ("a CPU-only build" if torch.version.cuda is None
                 else f"built for CUDA {torch.version.cuda}")
        raise UsageError(f"no usable CUDA GPU: torch {torch.__version__} ({build}) sees none; "
                         f"`warpsplitk {command}` runs kernels on an sm_90a or sm_100a GPU "
                         "(`warpsplitk plan` and `warpsplitk compile` need none)")
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    arch = f"sm_{major}{minor}a"
    if arch not in ARCHS:
        raise UsageError(f"GPU {index} ({torch.cuda.get_device_name(index)}) is {arch}; "
                         f"warpsplitk runs on {', '.join(ARCHS)}")


def _arch_defaults(args):
    """``--sm-count`` and ``--tbps`` not given: those of the GPU ``--arch`` stands for."""
    gpu, sm_count = ARCH_GPUS[args.arch]
    if args.sm_count is None:
        args.sm_count = sm_count
    if getattr(args, "tbps", 0) is None:
        args.tbps = DATASHEET_TBPS[gpu]


def _planned_ms(ms):
    """The Ms a plan tuned for ``ms`` covers: the tuner measures each M's
    bucket (``tune.REPRESENTATIVE_MS``), and every M of a measured bucket
    takes its winner."""
    from .planning.selection import representative
    buckets = {representative(m) for m in ms}
    return [m for m in range(1, shape_table.MAX_M + 1) if representative(m) in buckets]


# ------------------------------------------------------------ commands


def _cmd_compile(args, argv):
    from .planning.choose import default_tactic
    from .tactics import check_tactic
    _arch_defaults(args)
    try:
        tactic = args.tactic or default_tactic(args.m, args.n, args.k, sm_count=args.sm_count)
        check_tactic(tactic, args.n, args.k)
    except ValueError as error:
        raise UsageError(f"{'argument --tactic: ' if args.tactic else ''}N={args.n} K={args.k}: "
                         f"{error}") from None
    _output_folder("--emit-ptx", args.emit_ptx)
    from .runtime import disk_cache
    from .runtime.compile import compile_for_arch
    report = compile_for_arch(args.n, args.k, tactic, args.arch, has_bias=args.bias)
    disk_cache.store_resources(
        disk_cache.key(args.arch, args.n, args.k, tactic, args.bias, True),
        {"registers": report.registers, "spill_bytes": report.spill_bytes,
         "local_bytes": report.local_bytes}, describe=(args.n, args.k, tactic, args.arch))
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


def _cmd_bench(args, argv):
    if args.rounds is not None and args.rounds < 1:
        raise UsageError(f"--rounds must be at least 1, got {args.rounds} (graphs timed per "
                         "configuration; default 3)")
    if args.chain and args.shapes is not None:
        raise UsageError("argument --shapes: not with --chain (it times the built-in chains of "
                         "table shape pairs, or with --model one layer of that model)")
    if args.chain and args.plot:
        raise UsageError("argument --plot: not with --chain (it plots the per-shape rows)")
    if args.layer:
        if args.model is None:
            raise UsageError("argument --layer: needs --model NAME (the layer's sizes)")
        if args.chain or args.shapes is not None or args.plot:
            raise UsageError("argument --layer: not with --chain, --shapes or --plot")
        from .measure.layer_bench import layer_shape
        try:
            layer_shape(args.model, args.tp if args.tp is not None else 1)
        except ValueError as error:
            raise UsageError(f"argument --model: {error}") from None
    if args.plan is not None:  # refused before any GPU work; else this GPU's, below
        plan, _ = _resolve_plan(args.plan)
    if args.chain and args.model is not None:
        from . import models
        try:
            layer = models.layer_chain(args.model, args.tp if args.tp is not None else 1)
        except ValueError as error:
            raise UsageError(f"argument --model: {error}") from None
        if not layer:
            raise UsageError(f"argument --model: {args.model} has no layer projections to chain")
    shapes = None if args.chain or args.layer else _kernel_shapes(_shape_entries(args))
    _output_folder("--json", args.json)
    _output_folder("--plot", args.plot)
    if args.plot:
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            raise UsageError("argument --plot: needs matplotlib (pip install 'warpsplitk[plot]')")
    _require_gpu("bench")
    if args.plan is None:
        plan, _ = _resolve_plan(_default_plan(_device_gpu()))
    from dataclasses import asdict

    from .measure import bench
    command = "warpsplitk " + shlex.join(argv)
    if args.layer:
        from .measure.layer_bench import bench_layer_path
        rows = bench_layer_path(args.model, args.tp if args.tp is not None else 1, args.m, plan,
                                rounds=args.rounds, progress=lambda line: print(line, flush=True))
        if args.json:
            import json
            with open(args.json, "w") as f:
                environment = {**bench._environment(), "command": command,
                               "rounds": args.rounds}
                json.dump({"environment": environment, "mode": "layer-path",
                           "rows": [asdict(r) for r in rows]}, f, indent=1)
        return 0
    if args.chain:
        if args.model is not None:
            mode = "layer"
            rows = bench.bench_layer(args.model, args.tp if args.tp is not None else 1, args.m,
                                     plan, rounds=args.rounds,
                                     progress=lambda line: print(line, flush=True))
            records = [asdict(r) | {"speedup": round(r.speedup, 3)} for r in rows]
        else:
            mode = "chain"
            print("first -> second, M, tactics, warpsplitk us per pair, cuBLAS us, speedup",
                  flush=True)
            rows = bench.bench_chain(bench.DEFAULT_CHAINS, args.m, plan, rounds=args.rounds,
                                     progress=lambda line: print(line, flush=True))
            records = [asdict(r) for r in rows]
        if args.json:
            import json
            with open(args.json, "w") as f:
                environment = {**bench._environment(), "command": command,
                               "rounds": args.rounds}
                json.dump({"environment": environment, "mode": mode, "rows": records}, f,
                          indent=1)
        return 0
    print(bench.HEADER, flush=True)
    env, rows = bench.run_bench(shapes, args.m, plan, progress=lambda line: print(line, flush=True),
                                rounds=args.rounds)
    env["command"] = command
    print(f"# {env['gpu']}  read {env['read_TBps']} TB/s (datasheet {env['datasheet_TBps']})  "
          f"torch {env['torch']}  cutlass-dsl {env['cutlass_dsl']}  {env['date']}")
    if args.json:
        bench.write_json(args.json, env, rows)
    if args.plot:
        from .measure.plot import plot_rows
        plot_rows(rows, env, args.plot)
    return 0


def _cmd_tune(args, argv):
    _output_folder("--output", args.output)
    if args.from_log and args.fresh:
        raise UsageError("argument --fresh: not with --from-log (which reads the log --fresh "
                         "would ignore)")
    records = _read_log(args.log, required=args.from_log) if (args.from_log or not args.fresh) \
        else []
    ms = _planned_ms(args.m)
    if args.from_log:
        from .planning.selection import plan_from_log
        from .planning.tune import plan_meta
        if args.shapes is not None or args.model is not None:
            raise UsageError(f"argument {'--model' if args.model else '--shapes'}: not with "
                             "--from-log (the plan has every shape the log measured)")
        # what the log's provenance lines ({"meta": ...}) say of the GPU
        named = [r["meta"] for r in reversed(records) if "meta" in r]
        gpu = next((p["gpu"] for p in named if p.get("gpu")), "unknown")
        sm_count = next((p["sm_count"] for p in named if p.get("sm_count")), 132)
        plan, partial = plan_from_log(args.log, ms, plan_meta(gpu, sm_count, None))
        for (n, k), missing in partial.items():
            print(f"N={n} K={k}: left out, no measurement for M={missing}")
        plan.save(args.output)
        print(f"plan for {len(plan.entries)} shapes written to {args.output} from {args.log}")
        return 0
    shapes = _kernel_shapes(_shape_entries(args))
    _require_gpu("tune")
    from .planning.tune import SHORTLIST, tune
    plan = tune(shapes, ms, log_path=args.log, resume=not args.fresh,
                progress=lambda line: print(line, flush=True), time_budget_s=args.time_budget,
                jobs=args.jobs, shortlist=0 if args.exhaustive else SHORTLIST)
    plan.save(args.output)
    print(f"plan for {len(shapes)} shapes x {len(ms)} Ms written to {args.output}")
    return 0


def _size(path) -> int:
    """A cached file's size; 0 once gone (another process pruning or clearing)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _cmd_cache(args, argv):
    from .runtime import disk_cache
    folder = disk_cache.cache_dir()
    if args.clear or args.prune:
        kernels, records, kept = (disk_cache.clear if args.clear else disk_cache.prune)(detail=True)
        what = "" if args.clear else "stale "
        print(f"removed {kernels} {what}compiled kernels and {records} {what}resource records "
              f"from {folder}" + (f"; could not remove {len(kept)} (e.g. {kept[0]})" if kept
                                  else ""))
        return 1 if kept else 0
    kernels = disk_cache.entries() + [p for p in disk_cache.legacy_entries() if p.suffix == ".o"]
    records = disk_cache.resource_entries()
    stale = {p for p in disk_cache.stale() if not p.name.endswith(".build.json")}
    from .planning import plan_cache
    plans = plan_cache.entries()
    if args.list:
        for path in plans:
            try:
                shapes = len(plan_cache.read_file(path).entries)
            except (OSError, ValueError):  # not a plan, or not this user's alone
                shapes = "unreadable"
            print(f"plan     {path.name}  {shapes} shapes")
        for path in kernels:
            print(f"kernel   {path.name}  {_size(path) / 1e6:.2f} MB"
                  f"{'  stale' if path in stale else ''}")
        for path in records:
            what = disk_cache.describe_resources(path)
            print(f"registers {what}{'  stale' if path in stale else ''}")
    state = "on" if disk_cache.enabled() else "off (WARPSPLITK_DISK_CACHE)"
    print(f"{folder}: {len(kernels)} compiled kernels, {len(records)} resource records "
          f"(registers for `warpsplitk plan`), {disk_cache.size() / 1e6:.1f} MB of "
          f"{disk_cache.max_bytes() / (1 << 30):.1f} GiB (WARPSPLITK_CACHE_MAX_SIZE; the least "
          f"recently used go first) ({len(stale)} stale: other versions, builds or kernel "
          f"sources, 'warpsplitk cache --prune' removes them); {len(plans)} GPU plans "
          f"(plan='auto'; --clear and --prune keep them); disk cache {state}")
    return 0


def _progress_line(arch):
    tty = sys.stderr.isatty()
    from .runtime import disk_cache
    # say where the records go only where they do go
    where = "kept in the disk cache" if disk_cache.writable() is None else "not kept: no disk cache"

    def show(done, total):
        line = f"compiling {done}/{total} kernels for {arch} (registers; {where})"
        if tty:
            print("\r" + line, end="\n" if done == total else "", file=sys.stderr, flush=True)
        elif done == 1 or done == total or done % 10 == 0:
            print(line, file=sys.stderr, flush=True)
    return show


def _cmd_plan(args, argv):
    _arch_defaults(args)
    plan, source = _resolve_plan(args.plan or _default_plan(ARCH_GPUS[args.arch]))
    entries = _shape_entries(args)
    from .kernel import layout
    from .tactics import (
        ctas_per_sm,
        grid_ctas,
        l2_read_factor,
        register_estimate,
        sm_balance,
        waves,
    )
    from .planning.plans import CUBLAS, default_choice
    from .tactics import shape_refusal
    rows = []
    for shape in entries:
        n, k = shape["n"], shape["k"]
        refusal = shape_refusal(n, k)
        for m in args.m:
            if refusal is not None:  # no tactic: the shape runs on cuBLAS
                rows.append((shape, m, None, "cublas"))
                continue
            tactic = plan.lookup(n, k, m)
            origin = "plan"
            if tactic is None:
                tactic, origin = default_choice(m, n, k, sm_count=args.sm_count), "default"
            rows.append((shape, m, tactic, origin))
    registers = {}
    if args.compile:
        from .runtime import compile as compiler
        kernels = [(s["n"], s["k"], t, False, True) for s, _, t, _ in rows
                   if t is not None and t != CUBLAS]
        from .runtime.precompile import precompile_resources
        precompile_resources(kernels, args.arch, args.jobs, _progress_line(args.arch))
        for n, k, tactic, _, _ in kernels:
            if (n, k, tactic) not in registers:
                registers[(n, k, tactic)] = compiler.arch_resources(n, k, tactic,
                                                                       args.arch)["registers"]
    from_plan = sum(1 for *_, origin in rows if origin == "plan")
    where = " where the plan has none" if plan.entries else ""
    print(f"# tactics from {source} ({from_plan} of {len(rows)} rows; 'default': the cost "
          f"model's choice{where}; 'cublas': a shape the kernel does not take); "
          f"{args.arch}, {args.sm_count} SMs; floor at "
          f"{args.tbps} TB/s; registers "
          f"{'compiled for ' + args.arch if args.compile else 'from the model'}")
    print(f"{'projection':<34} {'from':>9} {'N':>5} {'K':>5} {'M':>3} {'tactic':>30} {'CTAs':>5} "
          f"{'waves':>5} {'SM load':>7} {'CTA/SM':>6} {'smem B':>7} {'regs':>4} {'L2 x':>5} "
          f"{'floor us':>8} {'meas us':>7} {'%floor':>6}")
    for shape, m, tactic, origin in rows:
        n, k = shape["n"], shape["k"]
        name = f"{shape.get('model', '')} {shape.get('projection', '')}".strip()[:34]
        if tactic is None:
            print(f"{name:<34} {origin:>9} {n:>5} {k:>5} {m:>3} {shape_refusal(n, k)}")
            continue
        floor = n * k * layout.ELEMENT_BYTES / (args.tbps * 1e6)
        if tactic == CUBLAS:  # measured (plan) or predicted (default) faster for this M
            measured = plan.entries.get((n, k), {}).get(m, (None, None))[1]
            shown = "-" if measured is None else f"{measured:.2f}"
            print(f"{name:<34} {origin:>9} {n:>5} {k:>5} {m:>3} {'cublas':>30} {'':>58} "
                  f"{floor:>8.2f} {shown:>7}")
            continue
        regs = registers[(n, k, tactic)] if args.compile else register_estimate(tactic)
        # the time the tuner measured for this M, where it measured this M
        measured = plan.entries.get((n, k), {}).get(m, (None, None))[1] if origin == "plan" \
            else None
        shown = ("-", "-") if measured is None else (f"{measured:.2f}",
                                                     f"{100 * floor / measured:.0f}")
        print(f"{name:<34} {origin:>9} {n:>5} {k:>5} {m:>3} {tactic.short():>30} "
              f"{grid_ctas(tactic, m, n):>5} {waves(tactic, m, n, args.sm_count):>5.2f} "
              f"{sm_balance(tactic, m, n, args.sm_count):>7.2f} {ctas_per_sm(tactic):>6} "
              f"{tactic.smem_bytes:>7} {regs if regs is not None else '-':>4} "
              f"{l2_read_factor(tactic, m):>5.2f} {floor:>8.2f} {shown[0]:>7} {shown[1]:>6}")
    return 0


# ------------------------------------------------------------ parser


def _per_arch(value) -> str:
    """``value(gpu, sms)`` of each --arch's GPU, for a help text."""
    return ", ".join(f"{value(gpu, sms)} for {arch} ({gpu.removeprefix('NVIDIA ')})"
                     for arch, (gpu, sms) in ARCH_GPUS.items())


MODEL_HELP = ("the decode projections of a model (warpsplitk.models: e.g. llama-3.1-8b, "
              "qwen3-32b, deepseek-v3; or a Hugging Face config.json: its path, its folder, "
              "or the id of a downloaded model), merged and sharded as vLLM runs them")


def _model_arguments(p):
    p.add_argument("--model", metavar="NAME", help=MODEL_HELP)
    p.add_argument("--tp", type=_int_at_least(1), metavar="P",
                   help="with --model: the shards one rank of P holds (column-parallel N / P, "
                        "row-parallel K / P; default 1)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="warpsplitk", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("plan", help="show tactics, occupancy, registers and the HBM floor per "
                                    "shape and M (no GPU)")
    p.add_argument("--plan", help=PLAN_HELP)
    p.add_argument("--shapes", nargs="*", help=SHAPES_HELP)
    _model_arguments(p)
    p.add_argument("--m", type=_ms, default=DEFAULT_M_TEXT, help=M_HELP)
    p.add_argument("--arch", default="sm_90a", choices=ARCHS, help="target arch (default sm_90a)")
    p.add_argument("--sm-count", type=_int_at_least(1),
                   help=f"SMs of the target GPU (default by --arch: "
                        f"{_per_arch(lambda gpu, sms: sms)})")
    p.add_argument("--tbps", type=_positive_float,
                   help=f"peak HBM TB/s for the floor (default by --arch, the datasheet "
                        f"peak: {_per_arch(lambda gpu, sms: DATASHEET_TBPS[gpu])})")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="registers from the model instead of compiled for --arch (compiled "
                        "ones are kept in the disk cache)")
    p.add_argument("--jobs", type=_int_at_least(1),
                   help="processes compiling the kernels the disk cache lacks (default: "
                        "WARPSPLITK_COMPILE_JOBS, else one per core but one, at most 16)")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("compile", help="compile one kernel for a target arch (no GPU)")
    p.add_argument("--n", type=_int_at_least(1), required=True, help="weight rows (output features)")
    p.add_argument("--k", type=_int_at_least(1), required=True, help="weight columns (input features)")
    p.add_argument("--m", type=_one_m, default=1,
                   help="the M (1..32) the default tactic is chosen for (default 1)")
    p.add_argument("--tactic", type=_tactic, help="o,t,k,s,b[...] (default: default_tactic's)")
    p.add_argument("--arch", default="sm_90a", choices=ARCHS, help="target arch (default sm_90a)")
    p.add_argument("--bias", action="store_true", help="compile the bias epilogue")
    p.add_argument("--sm-count", type=_int_at_least(1),
                   help=f"SMs the default tactic is chosen for (default by --arch: "
                        f"{_per_arch(lambda gpu, sms: sms)})")
    p.add_argument("--emit-ptx", metavar="PATH", help="write the PTX here")
    p.set_defaults(func=_cmd_compile)

    p = sub.add_parser("bench", help="time warpsplitk against torch.matmul on this GPU")
    p.add_argument("--shapes", nargs="*", help=SHAPES_HELP)
    _model_arguments(p)
    p.add_argument("--m", type=_ms, default=DEFAULT_M_TEXT, help=M_HELP)
    p.add_argument("--plan", help=PLAN_HELP)
    p.add_argument("--json", metavar="PATH",
                   help="write rows and environment (with this command line) here")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot here")
    p.add_argument("--rounds", type=_int, default=None,
                   help="graphs per configuration, alternating; the median one counts "
                        f"(default {ROUNDS})")
    p.add_argument("--chain", action="store_true",
                   help="dependent chains (each output feeds the next input): table shape pairs, "
                        "or with --model one layer's projections in order, against the reference "
                        "heuristic and cuBLAS")
    p.add_argument("--layer", action="store_true",
                   help="with --model: one decode layer's GEMM path (merged q/k/v, an attention "
                        "stand-in, o, gate/up with the SwiGLU epilogue, down) against the same "
                        "path unmerged and against cuBLAS with PyTorch's SiLU; and its MLP block")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("tune", help="measure tactics on this GPU and write a decode plan")
    p.add_argument("--shapes", nargs="*", help=SHAPES_HELP)
    _model_arguments(p)
    p.add_argument("--m", type=_ms, default=DEFAULT_M_TEXT,
                   help=M_HELP + "; each M is measured at its bucket and the plan covers every "
                                 "M of the buckets measured (the default: 1..32)")
    p.add_argument("-o", "--output", required=True, metavar="PATH", help="plan JSON to write")
    p.add_argument("--log", default="tune-log.jsonl", metavar="PATH",
                   help="every measurement, one JSON line each; a rerun resumes from it "
                        "(default tune-log.jsonl)")
    p.add_argument("--time-budget", type=_positive_float, metavar="SECONDS",
                   help="start no new shape after this (rerun with the log to go on)")
    p.add_argument("--jobs", type=_int_at_least(1),
                   help="processes compiling the candidates first (default: "
                        "WARPSPLITK_COMPILE_JOBS, else one per core but one, at most 16)")
    p.add_argument("--fresh", action="store_true",
                   help="measure everything again, ignoring the log's measurements")
    p.add_argument("--from-log", action="store_true",
                   help="no GPU: rebuild the plan from the measurements in --log")
    p.add_argument("--exhaustive", action="store_true",
                   help="measure the whole tactic space of each cell, not only the cost "
                        "model's shortlist (minutes per shape instead of seconds)")
    p.set_defaults(func=_cmd_tune)

    p = sub.add_parser("cache", help="show, list, prune or clear the compiled kernels and "
                                     "register records kept on disk")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--list", action="store_true", help="one line per file")
    what.add_argument("--clear", action="store_true", help="remove them all")
    what.add_argument("--prune", action="store_true",
                      help="remove those built by other warpsplitk or CuTe DSL versions or "
                           "other kernel sources")
    p.set_defaults(func=_cmd_cache)
    parser.commands = sub.choices
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # named by the command they were given to, as argparse's other errors
            parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)} "
                                                f"(see warpsplitk {args.command} --help)")
    except SystemExit as done:  # --help, or argparse's one-line error
        return done.code if isinstance(done.code, int) else 2
    prog = f"warpsplitk {args.command}"
    try:
        return args.func(args, argv)
    except (UsageError, ValueError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `warpsplitk plan | head`: the reader has gone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as error:  # the file system said no: one line, not a traceback
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] == __package__:
            raise  # a module of this package missing is a bug, not the user's set-up
        print(f"{prog}: error: {error}", file=sys.stderr)  # a dependency not installed
        return 1


if __name__ == "__main__":
    sys.exit(main())
