"""The parts of the command line several commands share: the usage error,
the parser that reports it in one line, the argument types, the help texts
and the arguments that mean the same in every command."""
from __future__ import annotations

import argparse

from .. import models, shapes as shape_table
from ..contract import ARCH_GPUS, FP8_SCALE_KINDS, SUPPORTED_ARCHS as ARCHS
from ..tactics import WarpSplitKTactic

DEFAULT_M_TEXT = ",".join(map(str, shape_table.DEFAULT_MS))
M_HELP = (f"Ms in 1..32, e.g. 8, 1,4,8, 1-32 or 1-8,16 (default: the plan's M buckets, "
          f"{DEFAULT_M_TEXT})")
SHAPES_HELP = "N,K pairs and/or .json shape tables (default: the built-in table)"
PLAN_HELP = ("'h200': the built-in H200 plan; 'none': the default (cost model); else a plan "
             "JSON file (default: the built-in plan of the target GPU model, if one was "
             "measured on it: 'h200' on the H200, else none)")
MODEL_HELP = ("the decode projections of a model (warpsplitk.models: e.g. llama-3.1-8b, "
              "qwen3-32b, deepseek-v3, kimi-k3; 'list' prints every name; or a Hugging Face "
              "config.json: its path, its folder, or the id of a downloaded model), merged and "
              "sharded as vLLM runs them")


class UsageError(Exception):
    """A bad argument or input file: one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    # argparse prints its usage, then the error: one line only, as ours
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


# ------------------------------------------------------------ argument types


def ms(text):
    try:
        return shape_table.parse_ms(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def one_m(text):
    try:
        m = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"one M in 1..{shape_table.MAX_M}, got {text!r}") from None
    if not 1 <= m <= shape_table.MAX_M:
        raise argparse.ArgumentTypeError(f"one M in 1..{shape_table.MAX_M}, got {m}")
    return m


def int_at_least(low):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def integer(text):
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer, got {text!r}") from None


def positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a positive number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"a positive number, got {text!r}")
    return value


def tactic(text):
    try:
        return WarpSplitKTactic.parse(text)
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a tactic "
                                         f"(o,t,k,s,b[,...], e.g. 16,8,128,4,1): {error}") from None


# ------------------------------------------------------------ shared arguments


def per_arch(value) -> str:
    """``value(gpu, sms)`` of each --arch's GPU, for a help text."""
    return ", ".join(f"{value(gpu, sms)} for {arch} ({gpu.removeprefix('NVIDIA ')})"
                     for arch, (gpu, sms) in ARCH_GPUS.items())


def add_plan(p):
    p.add_argument("--plan", help=PLAN_HELP)


class ModelName(argparse.Action):
    """--model: the name kept; ``list`` prints every name, one a line, and
    ends the command (exit 0) before anything else is checked."""

    def __call__(self, parser, namespace, value, option_string=None):
        if value.strip().lower() == "list":
            print("\n".join(models.listing()), flush=True)
            parser.exit(0)
        setattr(namespace, self.dest, value)


def add_shapes(p):
    """--shapes, then --model and --tp: the shapes a command runs on."""
    p.add_argument("--shapes", nargs="*", help=SHAPES_HELP)
    p.add_argument("--model", metavar="NAME", action=ModelName, help=MODEL_HELP)
    p.add_argument("--tp", type=int_at_least(1), metavar="P",
                   help="with --model: the shards one rank of P holds (column-parallel N / P, "
                        "row-parallel K / P; default 1)")


def add_weight_dtype(p, dtype_help, scales_help):
    """--dtype (bf16 or fp8) and --scales (an FP8 weight's scale kind,
    ``fp8_scales`` reads them)."""
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help=dtype_help)
    p.add_argument("--scales", choices=FP8_SCALE_KINDS, help=scales_help)


def fp8_scales(args) -> str | None:
    """The FP8 scale kind --dtype and --scales ask for ("channel" unless
    given), None for BF16 weights; ``UsageError`` for --scales without
    --dtype fp8."""
    if args.scales is not None and args.dtype != "fp8":
        raise UsageError(f"argument --scales: only with --dtype fp8, got --dtype {args.dtype}")
    return (args.scales or "channel") if args.dtype == "fp8" else None


def add_ms(p, text=M_HELP):
    p.add_argument("--m", type=ms, default=DEFAULT_M_TEXT, help=text)


def add_arch(p, default="sm_90a", text="target arch (default sm_90a)"):
    p.add_argument("--arch", default=default, choices=ARCHS, help=text)


def add_sm_count(p, chosen_for):
    """--sm-count, its default by --arch; ``chosen_for``: what the SMs are for."""
    p.add_argument("--sm-count", type=int_at_least(1),
                   help=f"{chosen_for} (default by --arch: {per_arch(lambda gpu, sms: sms)})")


def add_jobs(p, compiling):
    """--jobs; ``compiling``: what the processes compile."""
    p.add_argument("--jobs", type=int_at_least(1),
                   help=f"processes compiling {compiling} (default: WARPSPLITK_COMPILE_JOBS, "
                        "else one per core but one, at most 16)")
