"""Checks several commands make before any work, each turning what was given
into what the command runs on, or a ``UsageError`` naming the argument:
the shapes, the plan, an output file, the GPU."""
from __future__ import annotations

import os

from .. import models, shapes as shape_table
from ..contract import ARCH_GPUS, GPUS, SUPPORTED_ARCHS as ARCHS
from ..planning.plan_cache import builtin_plan_for
from ..planning.plans import DecodePlan, builtin_plan, load_plan
from ..runtime.timing import DATASHEET_TBPS
from ..tactics import shape_refusal
from .options import UsageError


def shape_entries(args) -> list[dict]:
    """The shapes a command runs on: ``--model`` (sharded by ``--tp``) and
    ``--shapes`` together, or the built-in table when neither is given."""
    entries = []
    model = getattr(args, "model", None)
    if model is None and getattr(args, "tp", None) is not None:
        raise UsageError(f"argument --tp: shards a --model's projections; no --model given "
                         f"(got --tp {args.tp})")
    if model is not None:
        entries += _model_entries(model, args.tp or 1)
    if args.shapes is not None:
        try:
            entries += shape_table.shape_entries(args.shapes)
        except ValueError as error:
            raise UsageError(f"argument --shapes: {error}") from None
    return entries if entries else shape_table.load()["shapes"]


def _model_entries(model, tp) -> list[dict]:
    """``model``'s projections on one rank of ``tp``; a line where the name
    is an alias, and one where it leaves out the MLPs of experts."""
    try:
        entries = models.projections(model, tp)
        # the shape table's own models have its rows and no config
        config = {} if model.strip().lower() in models.shape_table_models() else \
            models.config(model)
    except ValueError as error:
        raise UsageError(f"argument --model: {error}") from None
    if models.alias_of(model):
        print(f"# {model}: alias of {models.alias_of(model)}", flush=True)
    if config.get("mlp") == "moe" or "dense_layers" in config:
        dense = config.get("dense_layers", 0)
        print(f"# {config['name']}: the MLPs of experts ({config['layers'] - dense} of "
              f"{config['layers']} layers) are grouped GEMMs, not listed", flush=True)
    return entries


def kernel_shapes(entries) -> list[tuple[int, int]]:
    """The distinct (N, K) of ``entries`` the kernel takes; a line for each
    it refuses (those run on cuBLAS)."""
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


def resolve_plan(text):
    """``none`` -> the default (cost model), ``h200`` -> the built-in plan, else a file:
    ``(plan, description)``."""
    try:
        if text == "none":
            return DecodePlan(), "no plan: the default (cost model)"
        if text == "h200":
            return builtin_plan("h200"), "built-in H200 plan"
        return load_plan(text), text
    except ValueError as error:
        raise UsageError(f"argument --plan: {error} (give 'h200', 'none' or a plan JSON file)") \
            from None


def default_plan(gpu) -> str:
    """``--plan`` not given: the built-in plan of ``gpu`` (``(name, SMs)``), else 'none'."""
    return builtin_plan_for(*gpu) or "none"


def output_folder(flag, path):
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


def require_gpu(command):
    """One line and exit 2 where no CUDA GPU warpsplitk runs on is usable."""
    try:
        import torch  # torch loads only for the commands that run kernels
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


def arch_defaults(args):
    """``--sm-count`` and ``--tbps`` not given: those of the GPU ``--arch`` stands for."""
    gpu, sm_count = ARCH_GPUS[args.arch]
    if args.sm_count is None:
        args.sm_count = sm_count
    if getattr(args, "tbps", 0) is None:
        args.tbps = DATASHEET_TBPS[gpu]


def target_gpu(args) -> tuple:
    """``plan``'s ``--gpu`` and ``--arch``: either names the other (neither:
    sm_90a), and ``--sm-count`` and ``--tbps`` not given take the GPU's.
    The GPU's ``(name, SMs, arch)``; a ``UsageError`` where the two disagree."""
    if args.gpu is None:
        args.arch = args.arch or ARCHS[0]
        args.gpu = next(key for key, gpu in GPUS.items() if gpu[:2] == ARCH_GPUS[args.arch])
    elif args.arch not in (None, GPUS[args.gpu][2]):
        raise UsageError(f"argument --gpu: {args.gpu} is an {GPUS[args.gpu][2]} GPU, not "
                         f"--arch {args.arch}'s (give one of the two)")
    name, sm_count, args.arch = GPUS[args.gpu]
    if args.sm_count is None:
        args.sm_count = sm_count
    if args.tbps is None:
        args.tbps = DATASHEET_TBPS[name]
    return GPUS[args.gpu]
